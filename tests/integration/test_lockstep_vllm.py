"""Lockstep mode against the two real vLLM servers, which carry the dualvllm plugin."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import textwrap

import aiohttp
import numpy as np
import psutil
import pytest

from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.engines.launcher import VLLMServer, pair_configs
from dualvllm.engines.vllm_plugin import spin
from tests import processes
from tests.waiting import eventually
from dualvllm.tinymodels.task import problems

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# How often a wait scrapes the servers' /metrics: each scrape takes CPU the servers share.
SCRAPE_POLL_S = 0.1
# How often a wait asks the coordinator for its statistics (~1 ms of its loop each time).
STATS_POLL_S = 0.01


def config(pair, **kw) -> CoordinatorConfig:
    theta, t = pair
    return CoordinatorConfig(theta_url=theta.url, t_url=t.url, top_k=20, **kw)


async def generate_in(mode: str, pair, prompts, **kw):
    async with DualVLLMCoordinator(config(pair, mode=mode, max_batch_size=16)) as c:
        assert c.mode == mode
        outputs = await c.generate_batch(prompts, **kw)
        return outputs, c.get_statistics()


@pytest.mark.parametrize("kw", [
    dict(max_tokens=8, seed=5),  # EOS and max_tokens
    dict(max_tokens=8, seed=6, stop=["1"], temperature=0.7),  # stop strings (a digit of many answers)
    dict(max_tokens=30, seed=7, ignore_eos=True),  # long sequences: many steps per request
], ids=["eos", "stop-string", "long"])
async def test_lockstep_generates_what_per_token_mode_generates(vllm_pair, kw):
    prompts = [p.prompt for p in problems("test", n=24, seed=8)]
    lockstep, stats = await generate_in("lockstep", vllm_pair, prompts, **kw)
    per_token, _ = await generate_in("per_token", vllm_pair, prompts, **kw)
    for got, want in zip(lockstep, per_token):
        assert got.ok, got.error
        assert (got.generated_tokens, got.generated_text, got.finish_reason) == \
            (want.generated_tokens, want.generated_text, want.finish_reason)
        np.testing.assert_allclose(got.logprobs_q, want.logprobs_q, atol=1e-5)
        np.testing.assert_allclose(got.alpha_history, want.alpha_history, atol=1e-6)
    if "stop" in kw:
        assert any(o.finish_reason == "stop_string" for o in lockstep)
    else:
        assert any(o.finish_reason == ("max_tokens" if kw.get("ignore_eos") else "eos") for o in lockstep)
    assert stats["tokens"] == sum(len(o.generated_tokens) for o in lockstep)
    assert stats["lockstep_reports"] > 0


async def test_stop_strings_cut_each_text_where_it_first_holds_one(vllm_pair, caplog):
    """Against the text generated without them, on the servers' real tokenizer: the check's
    pre-filter (coordinator/stop_filter.py) skips most windows, and must never skip a stop."""
    prompts = [p.prompt for p in problems("test", n=16, seed=9)]
    kw = dict(max_tokens=24, seed=11, ignore_eos=True, temperature=1.0)
    async with DualVLLMCoordinator(config(vllm_pair, mode="lockstep", max_batch_size=16)) as c:
        full = await c.generate_batch(prompts, **kw)
        texts = [out.generated_text for out in full]
        # Two-character pieces from the middle of the texts: they span tokens, and most texts hold one.
        pieces = sorted({text[n:n + 2] for text in texts for n in range(4, len(text) - 2)} - {""})
        stops = [piece for piece in pieces if sum(piece in text for text in texts) >= 2][:3]
        assert stops, texts
        cut = await c.generate_batch(prompts, stop=stops, **kw)
        for before, after in zip(full, cut):
            assert after.ok, after.error
            found = [i for i in (before.generated_text.find(stop) for stop in stops) if i >= 0]
            if not found:
                assert (after.generated_tokens, after.finish_reason) == (before.generated_tokens, "max_tokens")
                continue
            n = len(after.generated_tokens)
            assert after.finish_reason == "stop_string"
            assert after.generated_tokens == before.generated_tokens[:n]
            assert after.generated_text == before.generated_text[:min(found)]
            # ... and at the first token whose text completes one
            shorter = await c.detokenize(after.generated_tokens[:n - 1])
            assert not any(stop in shorter for stop in stops), (shorter, stops)
        statistics = c.get_statistics()
    assert sum(after.finish_reason == "stop_string" for after in cut) >= 4
    # The filter stayed on for this tokenizer, and settled most checks without the server.
    assert "every stop-string check is decoded" not in caplog.text
    assert statistics["stop_checks_decoded"] < statistics["stop_checks"] / 2, statistics


async def test_a_batch_cancelled_mid_flight_leaves_the_coordinator_serving_the_next(vllm_pair):
    """Issue 23: cancel a lockstep batch while both servers hold its requests, then run another
    batch on the same coordinator: it gives per-token mode's tokens, and no request is left
    running on either server."""
    theta, t = vllm_pair
    prompts = [p.prompt for p in problems("test", n=16, seed=9)]
    async with DualVLLMCoordinator(config(vllm_pair, mode="lockstep", max_batch_size=16)) as c:
        cancelled = asyncio.create_task(c.generate_batch(prompts, max_tokens=40, ignore_eos=True, seed=1))
        await eventually(lambda: c.get_statistics()["tokens"] >= 4 * len(prompts),
                         "the first batch's first 4 tokens per sequence", timeout_s=30, poll_s=STATS_POLL_S)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        following = await asyncio.wait_for(c.generate_batch(prompts, max_tokens=8, seed=2), 300)
    per_token, _ = await generate_in("per_token", vllm_pair, prompts, max_tokens=8, seed=2)
    for got, want in zip(following, per_token):
        assert got.ok, got.error
        assert got.generated_tokens == want.generated_tokens
    for url in (theta.url, t.url):
        assert await _running_requests(url) == 0, url


async def _running_requests(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))


async def test_a_killed_coordinator_leaves_the_servers_serving(vllm_pair):
    """SIGKILL a process mid-way through a lockstep run: its requests end within the plugin's
    timeout (15 s here), and other clients are served meanwhile and after."""
    theta, t = vllm_pair
    script = textwrap.dedent(f"""
        import asyncio, sys
        from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
        async def main():
            cfg = CoordinatorConfig(theta_url="{theta.url}", t_url="{t.url}", mode="lockstep", max_batch_size=8)
            async with DualVLLMCoordinator(cfg) as c:
                async for out in c.stream(["12+34="] * 8, max_tokens=50, ignore_eos=True, seed=0):
                    print("first output", flush=True)
                    await asyncio.sleep(3600)  # never reached: the first output ends at 50 tokens
        asyncio.run(main())
    """)
    process = processes.start([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        # Kill it once both servers hold its requests.
        async def both_hold_its_requests() -> bool:
            assert process.poll() is None, process.stderr.read()
            return await _running_requests(theta.url) > 0 and await _running_requests(t.url) > 0

        await eventually(both_hold_its_requests, "the lockstep run's requests on both servers", timeout_s=60,
                         poll_s=SCRAPE_POLL_S)
        process.send_signal(signal.SIGKILL)
        process.wait()
        # Another client is served (per-token requests wait at most for the plugin's timeout).
        async with DualVLLMCoordinator(config(vllm_pair, mode="per_token")) as c:
            [out] = await c.generate_batch(["40+2="], max_tokens=3, seed=0)
        assert out.ok, out.error
        async def both_idle() -> bool:
            return await _running_requests(theta.url) == 0 and await _running_requests(t.url) == 0

        await eventually(both_idle, "the dead coordinator's requests ended on both servers", timeout_s=60,
                         poll_s=SCRAPE_POLL_S)
        # And lockstep works again for a new coordinator.
        outputs, _ = await generate_in("lockstep", vllm_pair, ["12+34=", "56+7="], max_tokens=4, seed=1)
        assert all(o.ok for o in outputs)
    finally:
        if process.poll() is None:
            process.kill()


# A missed wake-up of a parked engine core costs vLLM's recheck interval, 5 s; the spin plugin
# (engines/vllm_plugin/spin.py) makes it 20 ms. A 4-token request taking this long is a stall.
STALL_S = 4.0


async def test_plain_requests_to_a_lockstep_server_do_not_stall_while_lockstep_sequences_run(vllm_pair):
    """Ordinary requests sent to a lockstep server while lockstep sequences decode are answered
    without multi-second stalls. The launcher's servers run the model inside the engine core (the
    uni executor: no worker queue to wait on); with vLLM's mp layout (test below) the launcher
    lowers the engine's spin (1 ms after a read instead of 1 s) and its missed-wake-up recheck
    together, and the hook's variable is set for every lockstep server alike."""
    theta, _ = vllm_pair
    # vLLM loads the hook from this environment's entry points; the launcher sets its variable for
    # the server (unit tests check what the hook does with it). Its log line is no proof: importing
    # TRL sets VLLM_LOGGING_LEVEL=ERROR in os.environ, which every server started afterwards inherits.
    hooks = {e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert "dualvllm.engines.vllm_plugin.spin:register" in hooks, "dualvllm is not installed with its entry points"
    # (Its engine processes inherit the API server's environment; their own /proc environ is
    # overwritten by vLLM's process titles.)
    assert psutil.Process(theta.pid).environ().get(spin.SPIN_ENV) == "0.001"
    async with DualVLLMCoordinator(config(vllm_pair, mode="lockstep", max_batch_size=8)) as c, \
            aiohttp.ClientSession() as session:
        model = (await (await session.get(f"{theta.url}/v1/models")).json())["data"][0]["id"]
        run = asyncio.create_task(c.generate_batch(["12+34="] * 8, max_tokens=40, ignore_eos=True, seed=3))
        latencies = []
        try:
            while not run.done() or len(latencies) < 3:
                started = asyncio.get_running_loop().time()
                async with session.post(f"{theta.url}/v1/completions", json={
                        "model": model, "prompt": "1+1=", "max_tokens": 4, "temperature": 0.0}) as answer:
                    assert answer.status == 200, await answer.text()
                latencies.append(asyncio.get_running_loop().time() - started)
            outputs = await run
        finally:
            run.cancel()
    assert all(o.ok and len(o.generated_tokens) == 40 for o in outputs)
    assert max(latencies) < STALL_S, f"a plain request stalled: {max(latencies):.2f} s (all: {latencies})"


async def test_a_teacher_on_vllms_own_mp_executor_runs_lockstep_with_per_token_modes_tokens(vllm_pair, tmp_path):
    """ServerConfig(cpu_executor="mp"): vLLM's own CPU layout, the model in a worker process that
    vLLM binds to the server's cores, and the engine core waiting on it with the spin hook's
    settings. (The default, uni, runs the model inside the engine core with its OpenMP threads
    pinned by the launcher: every other test here runs on it.) Lockstep with such a teacher
    beside the session's base (one server start instead of two: the plugin is the same in
    either role) gives per-token mode's tokens."""
    _, t_config = pair_configs(log_dir=tmp_path, max_logprobs=20, lockstep=True, lockstep_timeout_s=15,
                               cpu_executor="mp")
    async with VLLMServer(t_config, name="t") as teacher:
        api = psutil.Process(teacher.pid)
        assert "--distributed-executor-backend" not in api.cmdline()
        environment = api.environ()  # its engine core and worker inherit it
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in environment and "GOMP_CPU_AFFINITY" not in environment
        assert environment["VLLM_CPU_OMP_THREADS_BIND"] == t_config.cpu_cores
        assert environment.get(spin.SPIN_ENV) == "0.001"
        pair = (vllm_pair[0], teacher)
        prompts = [p.prompt for p in problems("test", n=12, seed=9)]
        lockstep, _ = await generate_in("lockstep", pair, prompts, max_tokens=8, seed=5)
        per_token, _ = await generate_in("per_token", pair, prompts, max_tokens=8, seed=5)
    for got, want in zip(lockstep, per_token):
        assert got.ok, got.error
        assert (got.generated_tokens, got.finish_reason) == (want.generated_tokens, want.finish_reason)
