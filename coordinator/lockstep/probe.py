"""Whether a server can run lockstep sequences: one probe, at start-up and when a replica rejoins.

A probe is a real lockstep request of two tokens. A server with the plugin reports its
first step to the coordinator (and is told END); one without it generates both tokens
itself. The report is then judged by `refusal`: chunked prefill off, and room for the
sequences the coordinator places there. Start-up reads the servers' capacity from it; a
replica restarted with other settings stays out of its pool.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import numpy as np

from dualvllm.common.errors import LockstepUnavailableError
from dualvllm.engines.lockstep_channel import LockstepChannel
from dualvllm.engines.protocol import ModelInfo
from dualvllm.engines.vllm_client import VLLMClient
from dualvllm.engines.vllm_plugin import wire

NO_PLUGIN = (
    "it has no dualvllm lockstep plugin: it generated a lockstep request's tokens itself (start it "
    "with `dualvllm serve --lockstep`, or add --logits-processors "
    "dualvllm.engines.vllm_plugin.processor:LockstepProcessor --no-enable-chunked-prefill)"
)


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


def refusal(report: wire.Report, needed: int = 1) -> str | None:
    """Why a server whose plugin sent `report` cannot take lockstep sequences, or None if it can.

    `needed`: the requests the coordinator may hold on this server at once (1 at start-up,
    where capacity is read, not checked)."""
    if report.flags & wire.FLAG_CHUNKED_PREFILL:
        return (
            "it runs with chunked prefill, which splits prompts over steps the plugin would count as "
            "tokens; restart it with --no-enable-chunked-prefill (`dualvllm serve --lockstep` does)"
        )
    if report.capacity < needed:
        # Requests past its max_num_seqs would wait in its queue while their other halves
        # decode: a park at every step.
        return (
            f"it runs at most {report.capacity} sequences at once (max_num_seqs), fewer than the {needed} "
            f"this coordinator places on each server; restart it with --max-num-seqs {needed} or more"
        )
    return None


async def probe_plugin(
    engine: VLLMClient,
    *,
    address: str,
    probe_id: int,
    reported: asyncio.Future[wire.Report],
    prompt_ids: Sequence[int],
    stop_token: int,
    timeout_s: float,
    needed: int = 1,
    until_ended: bool = False,
) -> wire.Report:
    """Send `engine` a probe tagged `probe_id` and judge its plugin's first report, which whoever
    reads the channel at `address` sets on `reported` -> the report. Raises LockstepUnavailableError
    ("<role> server at <url>: why") when the server cannot run lockstep sequences.

    `until_ended`: wait (up to `timeout_s`) for the request to end on its own after the report,
    as it does when the reader answers END at once (start-up), so that the server sees a
    finished request rather than a dropped connection. A running scheduler may hold its
    replies behind an admission gate, so on rejoin the request is dropped instead."""
    args = wire.request_args(wire.Tagged(address, probe_id, offset=0, top_k=1, stop=stop_token))
    request = asyncio.create_task(
        engine.forced_generation(list(prompt_ids), max_tokens=2, stop_token=stop_token, lockstep_args=args)
    )
    where = f"{engine.name} server at {engine.url}"
    try:
        either: set[asyncio.Future[Any]] = {request, reported}
        await asyncio.wait(either, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if reported.done():
            if reported.exception() is not None:  # it cannot read our END either: no wait for the end
                raise LockstepUnavailableError(
                    f"{where}: its plugin's report could not be read: {reported.exception()}"
                )
            if until_ended:  # told END, the request ends at the server's next step
                await asyncio.wait({request}, timeout=timeout_s)
            reason = refusal(reported.result(), needed)
            if reason is not None:
                raise LockstepUnavailableError(f"{where}: {reason}")
            return reported.result()
        if request.done():
            try:
                request.result()
            except Exception as err:  # a refusal by the plugin (HTTP 400) says why
                raise LockstepUnavailableError(f"{where}: a lockstep probe request failed: {err}") from err
            raise LockstepUnavailableError(f"{where}: {NO_PLUGIN}")
        raise LockstepUnavailableError(f"{where}: its lockstep probe got no answer within {timeout_s:g} s")
    finally:
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)


@dataclass(frozen=True)
class Probe:
    """What the start-up probes found: why lockstep cannot run (None: it can), and how many
    sequences the servers can run at once (the smaller max_num_seqs, per request a sequence
    needs there)."""

    unavailable: str | None
    capacity: int


async def probe_servers(
    channel: LockstepChannel, engines: list[VLLMClient], prompt_ids: list[int], stop_token: int, timeout_s: float
) -> Probe:
    """Probe each distinct server once, before a scheduler reads the channel: the probe's reports
    are read here, answered END, and the first of each probe is judged."""
    per_server: dict[str, int] = {}
    for engine in engines:  # one server in both roles (a self-teacher) holds two requests per sequence
        per_server[engine.url] = per_server.get(engine.url, 0) + 1
    capacity = 2**31
    probed: set[str] = set()
    for engine in engines:
        if engine.url in probed:
            continue
        probed.add(engine.url)
        probe_id = secrets.randbits(62)
        reported: asyncio.Future[wire.Report] = asyncio.get_running_loop().create_future()
        reader = asyncio.create_task(_answer_end(channel, probe_id, reported))
        try:
            report = await probe_plugin(
                engine,
                address=channel.address,
                probe_id=probe_id,
                reported=reported,
                prompt_ids=prompt_ids,
                stop_token=stop_token,
                timeout_s=timeout_s,
                until_ended=True,
            )
        except LockstepUnavailableError as err:
            return Probe(str(err), 0)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        capacity = min(capacity, report.capacity // per_server[engine.url])
    return Probe(None, capacity)


async def _answer_end(channel: LockstepChannel, probe_id: int, reported: asyncio.Future[wire.Report]) -> None:
    """Answer every report END (ending the probe), and hand the first one of `probe_id` over; a
    report that cannot be read (another dualvllm's plugin) is handed over as its WireError."""
    while True:
        try:
            identity, report = await channel.receive()
        except wire.WireError as err:  # only the probed server reports here now
            if not reported.done():
                reported.set_exception(err)
            continue
        channel.reply(identity, report.step, np.full(len(report.ids), wire.END, dtype=np.int64))
        if not reported.done() and probe_id in report.ids.tolist():
            reported.set_result(report)
