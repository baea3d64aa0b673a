"""The `dualvllm` command as a user runs it, against real vLLM servers."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import dualvllm
from tests.recipes import TINY_ARITH
from tests.waiting import eventually
from dualvllm.tinymodels.task import problems

REPO = Path(__file__).resolve().parents[2]
# How often a wait reads the files of a run in progress: often enough, without taking CPU from it.
FILE_POLL_S = 0.05


def wait_for(condition, process: subprocess.Popen, what: str, timeout_s: float = 600) -> None:
    """Wait (tests/waiting.py) until `condition()` holds; fail at once if `process` exits first
    (with its stderr)."""
    def holds() -> bool:
        assert process.poll() is None, f"exited before {what}: {process.stderr.read()[-3000:]}"
        return bool(condition())

    asyncio.run(eventually(holds, what, timeout_s=timeout_s, poll_s=FILE_POLL_S))


def assert_all_exit(processes: list[psutil.Process], timeout_s: float = 120) -> None:
    """Every process of a killed run ends: the servers on SIGTERM, the verifier pool on SIGKILL."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    described = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive if p.is_running()]
    assert not described, f"left behind by the killed run: {described}"


def read_ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def assert_top_k_above_max_logprobs_is_refused(urls: list[str], top_k: int) -> None:
    """serve passed --max-logprobs to vLLM, and the coordinator's start-up says how to fix a larger top_k."""
    from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
    from dualvllm.common.errors import TopKUnsupportedError

    async def connect() -> None:
        async with DualVLLMCoordinator(CoordinatorConfig(theta_url=urls[0], t_url=urls[1], top_k=top_k)):
            pass

    with pytest.raises(TopKUnsupportedError, match=f"--max-logprobs {top_k}"):
        asyncio.run(connect())


def test_generate_resumes_after_a_kill_without_losing_or_duplicating(vllm_pair, tmp_path):
    theta, t = vllm_pair
    tasks = problems("test", n=60, seed=3)
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p.prompt, "answer": p.answer}) + "\n"
                              for i, p in enumerate(tasks)))
    out = tmp_path / "out.jsonl"
    args = ["generate", "--input", str(source), "--output", str(out), "--theta-url", theta.url,
            "--t-url", t.url, "--max-tokens", "6", "--max-batch-size", "2", "--seed", "7", "--quiet"]

    first = dualvllm(*args)
    wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 5, first, "5 records written")
    # Frozen the moment the 5th record is seen, killed after: the kill lands mid-run (55
    # prompts to go at 2 at a time) however fast the machine is.
    first.send_signal(signal.SIGSTOP)
    first.send_signal(signal.SIGKILL)
    first.wait()
    with open(out, "a") as torn:  # a line half-written when the process died
        torn.write('{"id": "p59", "generated_te')
    done_before = len(out.read_text().splitlines()) - 1
    assert 5 <= done_before < len(tasks), "the kill should land mid-run"

    second = dualvllm(*args)
    stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    assert f"{done_before} already done" in stdout
    ids = read_ids(out)
    assert sorted(ids) == sorted(f"p{i}" for i in range(len(tasks)))  # all there, none twice
    record = json.loads(out.read_text().splitlines()[0])
    assert record["metadata"]["answer"] == tasks[int(record["id"][1:])].answer
    assert len(record["alpha_history"]) == len(record["generated_tokens"])

    # Seeds are per id, so the resumed prompts sample as an uninterrupted run would.
    fresh = tmp_path / "fresh.jsonl"
    third = dualvllm(*[a if a != str(out) else str(fresh) for a in args])
    assert third.wait(timeout=300) == 0
    by_id = lambda p: {r["id"]: r["generated_tokens"] for r in map(json.loads, p.read_text().splitlines())}
    assert by_id(fresh) == by_id(out)


def test_generate_rejects_a_malformed_line_with_its_number(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"prompt": "12+34="}\n{"prompt": 12}\n')
    run = dualvllm("generate", "--input", str(source), "--output", str(tmp_path / "o.jsonl"))
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 2
    assert f"{source}:2:" in stderr and "non-empty string" in stderr


def test_demo_reports_all_three_arms(vllm_pair):
    theta, t = vllm_pair
    run = dualvllm("demo", "--num-prompts", "32", "--theta-url", theta.url, "--t-url", t.url)
    stdout, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-3000:]
    rows = {line.split("  ")[0].strip(): line for line in stdout.splitlines() if "%" in line}
    accuracy = {name: float(line.split("%")[0].split()[-1]) for name, line in rows.items()}
    assert set(accuracy) == {"base (alpha=0)", "teacher (alpha=1)", "q* (alpha*)"}
    assert accuracy["teacher (alpha=1)"] > accuracy["base (alpha=0)"]


def read_endpoint(run: subprocess.Popen) -> tuple[list[str], str, str]:
    """(the servers' URLs `serve` printed, its endpoint, its model name), read from its output."""
    urls: list[str] = []
    endpoint = model = ""
    assert run.stdout is not None
    for line in run.stdout:  # serve prints the servers' URLs, then the endpoint's once it listens
        if line.startswith("export "):
            urls = [part.split("=", 1)[1] for part in line.split()[1:]]
        if line.startswith("q* endpoint: "):
            endpoint, model = line.split()[2], line.split("'")[1]
            break
    assert endpoint.startswith("http://127.0.0.1:") and endpoint.endswith("/v1"), run.stderr.read()
    return urls, endpoint, model


def assert_completes(endpoint: str, model: str) -> None:
    request = urllib.request.Request(
        endpoint + "/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "prompt": "12+34=", "max_tokens": 4, "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 200 and json.load(answer)["choices"][0]["finish_reason"] in ("stop", "length")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_serve_prints_both_urls_and_sigterm_stops_both(tmp_path):
    run = dualvllm("serve", "--log-dir", str(tmp_path), "--max-logprobs", "10", "--top-k", "10",
                   "--service-port", "0")
    try:
        urls, endpoint, model = read_endpoint(run)
        assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls), run.stderr.read()
        assert all(answers(url) for url in urls)
        assert_top_k_above_max_logprobs_is_refused(urls, top_k=20)
        assert_completes(endpoint, model)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=120) == 130
    finally:
        run.kill()
        run.wait()
    alive = [url for url in [*urls, endpoint.removesuffix("/v1")] if answers(url)]
    assert not alive, f"{alive} still answer after the signal: servers and endpoint must be gone, not orphaned"
    assert (tmp_path / "theta.log").stat().st_size > 0 and (tmp_path / "t.log").stat().st_size > 0


def test_serve_on_given_servers_stops_on_ctrl_c_and_leaves_them_serving(vllm_pair):
    theta, t = vllm_pair
    # Started with SIGINT ignored, as a shell's background job is: Ctrl-C must still work.
    run = dualvllm("serve", "--theta-url", theta.url, "--t-url", t.url, "--top-k", "10", "--service-port", "0",
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        urls, endpoint, model = read_endpoint(run)
        assert urls == []  # it started no server, so it prints none
        assert_completes(endpoint, model)
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=120) == 130
    finally:
        run.kill()
        run.wait()
    assert not answers(endpoint.removesuffix("/v1")), "the endpoint still answers after Ctrl-C"
    assert answers(theta.url) and answers(t.url), "serve stopped servers it did not start"


def serving_worker(endpoint: str, model: str, seed: int) -> str:
    """A completion on a new connection -> the worker that answered (its X-DualVLLM-Worker)."""
    request = urllib.request.Request(
        endpoint + "/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": model, "prompt": "12+34=", "max_tokens": 2, "seed": seed}).encode())
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 200 and json.load(answer)["choices"][0]["finish_reason"] in ("stop", "length")
        return answer.headers["X-DualVLLM-Worker"]


def start_workers(vllm_pair, tmp_path: Path) -> tuple[subprocess.Popen, str, str, list[psutil.Process]]:
    """`serve --workers 2` on the module's pair -> (it, its endpoint, model, its worker process)."""
    theta, t = vllm_pair
    run = dualvllm("serve", "--theta-url", theta.url, "--t-url", t.url, "--top-k", "10", "--service-port", "0",
                   "--workers", "2", "--log-dir", str(tmp_path))
    _, endpoint, model = read_endpoint(run)
    workers = psutil.Process(run.pid).children()
    assert len(workers) == 1 and "dualvllm.service.workers" in " ".join(workers[0].cmdline()), workers
    return run, endpoint, model, workers


def test_serve_spreads_connections_over_its_workers_and_ctrl_c_stops_them_all(vllm_pair, tmp_path):
    theta, t = vllm_pair
    run, endpoint, model, workers = start_workers(vllm_pair, tmp_path)
    try:
        # The kernel spreads connections over the two sockets by address: 24 connections all on
        # one worker would happen once in 8 million runs.
        answered = [serving_worker(endpoint, model, seed) for seed in range(24)]
        assert set(answered) == {"0/2", "1/2"}, answered
        # Either worker's /metrics holds both workers' series, labelled by worker.
        with urllib.request.urlopen(endpoint.removesuffix("/v1") + "/metrics", timeout=30) as scraped:
            families = {f.name: f for f in text_string_to_metric_families(scraped.read().decode())}
        completions = {s.labels["worker"]: s.value for s in families["dualvllm_requests"].samples
                       if s.name == "dualvllm_requests_total" and s.labels["route"] == "/v1/completions"}
        assert completions == {"0": answered.count("0/2"), "1": answered.count("1/2")}, completions
        assert families["dualvllm_workers_scraped"].samples[0].value == 2
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=120) == 130
    finally:
        run.kill()
        run.wait()
    assert_all_exit(workers)
    assert not answers(endpoint.removesuffix("/v1")), "the endpoint still answers after Ctrl-C"
    assert answers(theta.url) and answers(t.url), "serve stopped servers it did not start"
    assert "endpoint worker 1/2 serving" in (tmp_path / "worker-1.log").read_text()


def test_a_worker_that_dies_stops_the_endpoint_with_its_log(vllm_pair, tmp_path):
    run, endpoint, _, workers = start_workers(vllm_pair, tmp_path)
    try:
        workers[0].kill()
        assert run.wait(timeout=120) == 2  # dualvllm's error exit
        stderr = run.stderr.read()
    finally:
        run.kill()
        run.wait()
    assert "endpoint worker 1 exited with status -9" in stderr and "worker-1.log" in stderr, stderr[-3000:]
    assert not answers(endpoint.removesuffix("/v1"))


def train_args(out: Path, lora_rank: str, mode: str) -> list[str]:
    return ["train", "--config", str(TINY_ARITH), "--output-dir", str(out), "--steps", "4", "--prompts-per-step", "2",
            "--group-size", "4", "--eval-every", "2", "--eval-prompts", "16", "--lora-rank", lora_rank, mode]


def assert_trained_and_pushed(out: Path, stdout: str, stderr: str, mode: str) -> None:
    """Four steps, each once, every push in memory and verified, the last checkpoint written."""
    assert "4 steps" in stdout
    assert f"decoding mode: {'lockstep' if mode == '--lockstep' else 'per_token'}" in stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "event" not in r]
    assert steps == sorted(set(steps)) and steps[-1] == 4, steps  # nothing trained twice
    assert all(r["push_max_abs_diff"] < 1e-3 for r in records if "push_max_abs_diff" in r)
    assert all(r["push_via"] == "memory" for r in records if "push_via" in r)  # dev-mode servers on this machine
    assert [p.name for p in sorted((out / "checkpoints").iterdir())][-1] == "step-000004"


def test_train_pushes_verified_weights_and_resumes_after_a_kill(dev_pair, tmp_path):
    """Full fine-tuning rolls out in lockstep (weight pushes fence the base's lockstep
    sequences with /pause); killed mid-run, its servers die with it, and the run resumes without
    training a step twice. The resumed run is given running servers (the session's pair), as a
    user who keeps servers up between runs would: its first push gives their base the checkpoint."""
    theta, t = dev_pair
    out = tmp_path / "run"
    args = [*train_args(out, "0", "--lockstep"), "--checkpoint-every", "2"]
    first = dualvllm(*args)
    try:
        wait_for((out / "checkpoints" / "step-000002").exists, first, "checkpoint step-000002")
        descendants = psutil.Process(first.pid).children(recursive=True)  # servers and verifier workers
        assert len(descendants) >= 3, descendants  # two servers and a verifier worker, at least
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
        first.wait()
    assert_all_exit(descendants)
    second = dualvllm(*args, "--resume", "--theta-urls", theta.url, "--t-urls", t.url)
    stdout, stderr = second.communicate(timeout=900)
    assert second.returncode == 0, stderr[-3000:]
    assert_trained_and_pushed(out, stdout, stderr, "--lockstep")
    # A fresh run refuses to overwrite the finished one.
    third = dualvllm(*args)
    _, stderr = third.communicate(timeout=120)
    assert third.returncode == 2 and "--resume" in stderr


def test_train_lora_per_token_pushes_verified_adapters(dev_pair, tmp_path):
    """LoRA, per-token decoding, one uninterrupted run on running servers (a LoRA checkpoint's
    resume is tests/unit/training/test_lora.py's; the kill and resume of a run that starts its
    servers, the test above)."""
    theta, t = dev_pair
    out = tmp_path / "run"
    run = dualvllm(*train_args(out, "4", "--no-lockstep"), "--theta-urls", theta.url, "--t-urls", t.url)
    stdout, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-3000:]
    assert_trained_and_pushed(out, stdout, stderr, "--no-lockstep")


# Slow (two pair starts, ~130 s): DPO's mining and step are tests/unit/training/test_dpo.py's.
@pytest.mark.slow
def test_train_dpo_mines_pairs_and_trains(tmp_path):
    """With LoRA; full fine-tuning's DPO step is tests/unit/training/test_dpo.py's (in process:
    a run here starts two pairs of servers, one to mine and one to evaluate the trained base)."""
    out = tmp_path / "dpo"
    run = dualvllm("train", "--config", str(TINY_ARITH), "--method", "dpo", "--output-dir", str(out), "--steps", "2",
                   "--prompts-per-step", "8", "--group-size", "4", "--eval-prompts", "16", "--lora-rank", "4")
    stdout, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-3000:]
    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert pairs and f"{len(pairs)} preference pairs" in stdout
    tasks = {p.prompt: p.answer for p in problems("train")}
    for pair in pairs:  # chosen is the verified answer, rejected is not
        assert pair["chosen"] == tasks[pair["prompt"]] and pair["rejected"] != tasks[pair["prompt"]]
    assert (out / "final" / "model.safetensors").is_file()
