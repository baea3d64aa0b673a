"""Lockstep start-up: whether both servers carry the plugin, and the token that ends a stream.

The coordinator (coordinator/core.py) probes the servers once on entering; the scheduler
itself is coordinator/lockstep.py.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import numpy as np

from engines.lockstep_channel import LockstepChannel
from engines.protocol import ModelInfo
from engines.vllm_client import VLLMClient
from engines.vllm_plugin import wire


def lockstep_stop_token(infos: tuple[ModelInfo, ModelInfo], eos_ids: frozenset[int]) -> int:
    """The token a stream's plugin forces to end its request (any id ends a request that lists it).

    A stream also ends when the coordinator samples this token as an ordinary one, and is then
    resent from its agreed tokens: a request more, and a sequence out of step with the other
    server's. With EOS that happens at every EOS sampled under ignore_eos: the batch-64
    benchmark ran at 190 tokens/s with EOS and at about 900 with the padding token
    (benchmarks/README.md, "Lockstep mode"). A model is never trained to emit its padding
    token, so the models' shared one is preferred.
    """
    pads = {info.pad_token_id for info in infos}
    (pad,) = pads if len(pads) == 1 else (None,)
    return pad if pad is not None and pad not in eos_ids else min(eos_ids)


@dataclass(frozen=True)
class Probe:
    """What the probe requests found: why lockstep cannot run (None: it can), and how many
    sequences the servers can run at once (the smaller max_num_seqs, per request a sequence
    needs there)."""

    unavailable: str | None
    capacity: int


async def probe_servers(channel: LockstepChannel, engines: list[VLLMClient], probe_ids: list[int],
                        stop_token: int, timeout_s: float) -> Probe:
    """Send each server a real lockstep request of two tokens: one with the plugin reports its
    first step here (and is told END); one without it generates both tokens itself."""
    capacity = 2**31
    per_server = {}
    for engine in engines:  # one server in both roles (a self-teacher) holds two requests per sequence
        per_server[engine.url] = per_server.get(engine.url, 0) + 1
    probed: set[str] = set()
    for engine in engines:
        if engine.url in probed:
            continue
        probed.add(engine.url)
        bound = asyncio.timeout(timeout_s)  # not wait_for, which may drop a cancel (common/tasks.py)
        try:
            async with bound:
                reason, server_capacity = await _probe(channel, engine, probe_ids, stop_token)
        except TimeoutError:
            if not bound.expired():
                raise
            reason, server_capacity = f"its probe request got no answer within {timeout_s:g} s", 0
        if reason is not None:
            return Probe(f"{engine.name} server at {engine.url}: {reason}", 0)
        capacity = min(capacity, server_capacity // per_server[engine.url])
    return Probe(None, capacity)


async def _probe(channel: LockstepChannel, engine: VLLMClient, probe_ids: list[int],
                 stop_token: int) -> tuple[str | None, int]:
    args = wire.request_args(wire.Tagged(channel.address, secrets.randbits(62), offset=0, top_k=1, stop=stop_token))
    request = asyncio.create_task(engine.forced_generation(probe_ids, max_tokens=2, stop_token=stop_token,
                                                           lockstep_args=args))
    report: wire.Report | None = None
    try:
        while True:
            receive = asyncio.create_task(channel.receive())
            done, _ = await asyncio.wait({request, receive}, return_when=asyncio.FIRST_COMPLETED)
            if receive in done:
                identity, report = receive.result()
                await channel.reply(identity, report.step, np.full(len(report.ids), wire.END, dtype=np.int64))
                continue
            receive.cancel()
            break
        request.result()
    except Exception as err:  # a refusal by the plugin (HTTP 400) says why
        return f"a lockstep probe request failed: {err}", 0
    finally:
        request.cancel()
    if report is None:
        return ("it has no dualvllm lockstep plugin (start it with `dualvllm serve --lockstep`, or add "
                "--logits-processors engines.vllm_plugin.processor:LockstepProcessor "
                "--no-enable-chunked-prefill)"), 0
    return refusal(report), report.capacity


def refusal(report: wire.Report, needed: int = 1) -> str | None:
    """Why a server whose plugin sent `report` cannot take lockstep sequences, or None if it can.

    The one judgement of a plugin's report, made at start-up and again when a replica rejoins
    its pool (LockstepScheduler.check_plugin): a replica restarted with other settings must
    meet what the running coordinator was sized for. `needed`: the requests the coordinator
    may hold on this server at once (1 at start-up, where capacity is read, not checked)."""
    if report.flags & wire.FLAG_CHUNKED_PREFILL:
        return ("it runs with chunked prefill, which splits prompts over steps the plugin would count as "
                "tokens; restart it with --no-enable-chunked-prefill (`dualvllm serve --lockstep` does)")
    if report.capacity < needed:
        # Requests past its max_num_seqs would wait in its queue while their other halves
        # decode: a park at every step.
        return (f"it runs at most {report.capacity} sequences at once (max_num_seqs), fewer than the {needed} "
                f"this coordinator places on each server; restart it with --max-num-seqs {needed} or more")
    return None
