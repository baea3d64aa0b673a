"""The trainer side of an in-memory weight push, on vLLM's native weight-transfer API.

    POST /pause?mode=keep -> init -> start -> update_weights (a chunk at a time) -> finish
    -> POST /reset_prefix_cache?reset_running_requests=true -> POST /resume -> probe

The learner's weights go straight from its memory into the server's, through the server's
weight-transfer engine: on the CPU build dualvllm's shared-memory engine (engines/
weight_transfer.py), driven by `SharedMemoryTrainerEngine` below, one server at a time; on
GPUs vLLM's NCCL engine, one group for every base replica, kept for the run
(dualvllm.training.nccl_push), through the same `WeightTransferTrainerFactory` and the same
`LearnerSource` (dualvllm.training.learner_source); `verify_transfer` checks both. The
trainer code is vLLM's own where the pinned version has it: `WeightSource`,
`TrainerWeightTransferEngine`, the factory and `layerwise_groups`; the HTTP calls are
dualvllm.engines.vllm_client's, bridged to vLLM's synchronous `VLLMWeightSyncClient` protocol.

`pause(mode="keep")` freezes the requests in flight instead of draining them: they keep their
place and, once the cache reset has dropped the KV blocks the old weights computed, recompute
their context with the new weights and go on. Nothing the server generates after `resume`
comes from the old weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.distributed.weight_transfer import (
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from dualvllm.common.errors import ServerError, ServerRejectedError, ServerUnavailableError, WeightSyncError
from dualvllm.engines.vllm_admin import ServedDigest
from dualvllm.engines.vllm_client import VLLMClient
from dualvllm.engines.weight_digest import PushDigest, short
from dualvllm.engines.weight_transfer import BACKEND, SEGMENT_PREFIX, ShmInitInfo, ShmUpdateInfo, aligned, segment_path
from dualvllm.training import lora
from dualvllm.training.learner_source import LearnerSource
from dualvllm.training.push_check import SharedResult, digest_failure, digest_verdict, verified_by
from dualvllm.training.weight_sync import (
    PushReport,
    compare_logprobs,
    learner_logprobs,
    mismatch_message,
    resume_after_failure,
)

log = logging.getLogger("dualvllm.training")

# Bytes per chunk: a chunk is written to shared memory while the server waits, then loaded while
# the trainer waits, so its size trades the segment's memory for round trips (~1 ms each). A
# decoder layer larger than this goes in a chunk of its own.
CHUNK_BYTES = 256 << 20
# How long one phase may take before the push counts as failed. A chunk of CHUNK_BYTES loads in
# well under a second on CPU; init and finish do no bulk work.
PHASE_TIMEOUT_S = 120.0
# What vLLM's worker says when start_weight_update finds an update already open (v1/worker/
# gpu_worker.py, inherited by the CPU worker).
UPDATE_LEFT_OPEN = "while a weight update is already active"


@dataclass
class TransferStats:
    """What one push moved, and where its time went."""

    bytes: int = 0
    chunks: int = 0
    tensors: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # init, start, send (write + load), finish
    digest: str | None = None  # of the bytes sent (dualvllm.engines.weight_digest); None: not digested


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    """Init info of the shared-memory engine's trainer side (`rank` 0 is the one that sends)."""

    backend: ClassVar[str] = BACKEND
    chunk_bytes: int = CHUNK_BYTES
    weight_version: str | None = None


class SharedMemoryTrainerEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Writes each chunk of a `WeightSource` to a new /dev/shm segment and has the server load it.

    Chunks are whole groups (vLLM's `layerwise_groups`: the embeddings, one decoder layer each,
    the final norm and head), packed up to `chunk_bytes`. If anything fails after the update
    started, `finish_weight_update` is still sent, so that the server puts back the old
    tensors of every layer that got nothing and keeps serving; the push then fails its
    verification, or raises, and never leaves the server half-loaded.
    """

    init_info_cls = ShmTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: WeightSource | None = None,
        is_sender: bool = True,
        chunk_bytes: int = CHUNK_BYTES,
        weight_version: str | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.chunk_bytes, self.weight_version = chunk_bytes, weight_version
        self.stats = TransferStats()
        self._dtype: dict[str, torch.dtype] = {}  # the wire dtype of each name, from the source's metadata
        self._digest = PushDigest()  # of every tensor written, as the server digests what it loads

    @classmethod
    def trainer_init(
        cls, init_info: ShmTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> SharedMemoryTrainerEngine:
        if source is None:
            raise ValueError("the shared-memory weight transfer sends a WeightSource; pass one")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            chunk_bytes=init_info.chunk_bytes,
            weight_version=init_info.weight_version,
        )
        if engine.is_sender:
            started = time.perf_counter()
            token = secrets.token_hex(16)
            with _segment(len(token)) as (name, buffer):
                buffer[: len(token)] = token.encode()
                client.init_weight_transfer_engine(asdict(ShmInitInfo(segment=name, token=token)))
            engine.stats.seconds["init"] = time.perf_counter() - started
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:  # a non-sending rank still joins the source's collectives
                pass
            return
        self._dtype = {meta.name: meta.dtype for meta in self.source.metadata()}
        seconds, started = self.stats.seconds, time.perf_counter()
        self._start()
        seconds["start"] = time.perf_counter() - started
        started = time.perf_counter()
        try:
            for chunk in self._chunks():
                self._send(chunk)
        except BaseException:
            # Restore the layers that got nothing; after an error of its own the server has ended the update already.
            with contextlib.suppress(Exception):
                self.client.finish_weight_update(None)
            raise
        seconds["send"] = time.perf_counter() - started
        self.stats.digest = self._digest.hexdigest()
        started = time.perf_counter()
        self.client.finish_weight_update(self.weight_version)
        seconds["finish"] = time.perf_counter() - started

    def _start(self) -> None:
        """start_weight_update; if the server still holds an update that a dead trainer began and
        never finished (vLLM refuses a second start then), finish that one first: it puts back the
        old tensors of every layer it did not get, and the push that follows overwrites them all."""
        try:
            self.client.start_weight_update()
        except ServerError as err:
            if UPDATE_LEFT_OPEN not in str(err):
                raise
            log.warning(
                "the server still held a weight update that was started and never finished (a trainer "
                "that died mid-push?); finishing it before this push"
            )
            try:
                self.client.finish_weight_update(None)
            except ServerUnavailableError:
                # The refused start's 500 left its connection closed (uvicorn closes it after an
                # unhandled error), and the finish sent on it may not have gone out: once more.
                # Had it gone out, vLLM refuses the second finish ("without a matching start").
                with contextlib.suppress(ServerRejectedError):
                    self.client.finish_weight_update(None)
            self.client.start_weight_update()

    def _chunks(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        assert self.source is not None
        dtype = self._dtype
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        for names, tensors in self.source.iter_groups():
            group = sum(aligned(t.numel() * dtype[n].itemsize) for n, t in zip(names, tensors))
            if chunk and size + group > self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk += [(n, t) for n, t in zip(names, tensors)]
            size += group
        if chunk:
            yield chunk

    def _send(self, chunk: list[tuple[str, torch.Tensor]]) -> None:
        dtype = self._dtype
        offsets, end = [], 0
        for name, tensor in chunk:
            offsets.append(end)
            end = aligned(end + tensor.numel() * dtype[name].itemsize)
        dtype_names = [str(dtype[n]).removeprefix("torch.") for n, _ in chunk]
        with _segment(end) as (segment, buffer):
            for (name, tensor), offset, dtype_name in zip(chunk, offsets, dtype_names):
                view = torch.frombuffer(buffer, dtype=dtype[name], count=tensor.numel(), offset=offset)
                view.view(tensor.shape).copy_(tensor)  # casts to the server's dtype on the way
                del view
                # The bytes as written, which the server digests as it loads them; hashed while they are
                # still in cache, ~12 GB/s.
                with memoryview(buffer) as raw:
                    self._digest.add(
                        name, dtype_name, tensor.shape, raw[offset : offset + tensor.numel() * dtype[name].itemsize]
                    )
            info = ShmUpdateInfo(
                segment=segment,
                names=[n for n, _ in chunk],
                dtype_names=dtype_names,
                shapes=[list(t.shape) for _, t in chunk],
                offsets=offsets,
            )
            self.client.update_weights(asdict(info))
        self.stats.bytes += end
        self.stats.chunks += 1
        self.stats.tensors += len(chunk)


@contextlib.contextmanager
def _segment(size: int) -> Iterator[tuple[str, mmap.mmap]]:
    """A new /dev/shm segment of `size` bytes, mapped; unlinked on the way out (the server may
    still map it, and the memory lives until it lets go)."""
    name = SEGMENT_PREFIX + secrets.token_hex(12)
    path = segment_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
        buffer = mmap.mmap(fd, max(size, 1))
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        yield name, buffer
    finally:
        with contextlib.suppress(BufferError):
            buffer.close()
        path.unlink(missing_ok=True)


def register() -> None:
    """The trainer side under BACKEND in vLLM's trainer factory (idempotent)."""
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, SharedMemoryTrainerEngine)


register()


class LoopBridge:
    """vLLM's synchronous `VLLMWeightSyncClient`, over an async VLLMClient: a trainer engine runs
    in a worker thread, and each phase runs on the event loop that owns the client's session."""

    def __init__(
        self, client: VLLMClient, loop: asyncio.AbstractEventLoop, *, timeout_s: float = PHASE_TIMEOUT_S
    ) -> None:
        self._client, self._loop, self._timeout_s = client, loop, timeout_s

    def _run(self, coro: Any) -> Any:
        # The client bounds the request by timeout_s; the margin only guards against a stuck loop.
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s + 30)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self._client.admin.init_weight_transfer_engine(init_info, timeout_s=self._timeout_s))

    def start_weight_update(self) -> None:
        self._run(self._client.admin.start_weight_update(timeout_s=self._timeout_s))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._run(self._client.admin.update_weights(update_info, timeout_s=self._timeout_s))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self._client.admin.finish_weight_update(weight_version, timeout_s=self._timeout_s))


async def send_weights(
    client: VLLMClient,
    model: Any,
    *,
    dtype: str,
    weight_version: str | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    only: set[str] | None = None,
) -> TransferStats:
    """Send `model`'s weights (in `dtype`, the server's) into the server's memory: init, start,
    the chunks, finish. The caller fences it (`pause(mode="keep")`) and verifies it.

    WeightSyncError names the phase that failed; the server keeps serving (see
    SharedMemoryTrainerEngine). `only`: send just the decoder layers that hold these names.
    """
    bridge = LoopBridge(client, asyncio.get_running_loop())
    source = LearnerSource(model, getattr(torch, dtype), only=only)
    phases = {
        "init_weight_transfer_engine": "init",
        "start_weight_update": "start",
        "update_weights": "update",
        "finish_weight_update": "finish",
    }
    started, failed = ["init"], []  # the last phase started; the first that raised

    class Tracking:  # which phase a failure happened in, for the error (not the finish sent to clean up after it)
        def __getattr__(self, name: str) -> Any:
            method = getattr(bridge, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                started[0] = phases.get(name, name)
                try:
                    return method(*args, **kwargs)
                except BaseException:
                    failed.append(started[0])
                    raise

            return call

    def run() -> TransferStats:
        init = ShmTrainerInitInfo(rank=0, chunk_bytes=chunk_bytes, weight_version=weight_version)
        engine = WeightTransferTrainerFactory.trainer_init(init, client=Tracking(), source=source)
        engine.send_weights()
        # The factory is typed for any trainer engine; BACKEND's is this module's (register, below).
        assert isinstance(engine, SharedMemoryTrainerEngine), f"{BACKEND} built a {type(engine).__name__}"
        return engine.stats

    try:
        return await asyncio.to_thread(run)
    except (ServerError, WeightSyncError, OSError, RuntimeError, TimeoutError) as err:
        phase = failed[0] if failed else started[0]
        raise WeightSyncError(
            f"the in-memory weight push to the {client.name} server at {client.url} failed in its {phase} phase: {err}"
        ) from err


def expected_logprobs(model: Any, probes: Sequence[Sequence[int]], dtype: str) -> np.ndarray:
    """What a server computing in `dtype` must answer on `probes` once it holds `model`'s weights
    -> float64 [B, vocab]: the learner's own logprobs in float32, else those of a copy of its
    (merged) weights rounded to `dtype`, built one tensor at a time and freed on return (like
    with like, as dualvllm.training.weight_sync.write_push does from the checkpoint it writes)."""
    if dtype == "float32" and not lora.is_lora(model):
        return learner_logprobs(model, probes)
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    base = model.get_base_model() if lora.is_lora(model) else model
    device = next(base.parameters()).device
    with no_init_weights():  # every weight is overwritten below
        copy = AutoModelForCausalLM.from_config(base.config, dtype=getattr(torch, dtype)).to(device)
    try:
        params = dict(copy.named_parameters())
        with torch.no_grad():
            for name, tensor in LearnerSource(model, getattr(torch, dtype)):
                params[name].copy_(tensor)
        return learner_logprobs(copy, probes)
    finally:
        del copy


async def transfer_and_verify(
    client: VLLMClient,
    model: Any,
    probes: Sequence[Sequence[int]],
    expected: np.ndarray | SharedResult,
    *,
    dtype: str,
    top_k: int,
    tolerance: float,
    previous: np.ndarray | SharedResult | None = None,
    weight_version: str | None = None,
    only: set[str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    probe: bool = True,
    previous_digest: str | None = None,
    expected_digest: str | None = None,
) -> PushReport:
    """Push `model`'s weights into the server's memory, fenced by pause(mode="keep"), then prove
    that it serves them (`verify_transfer`: by digest, and by a probe when `probe` or the digest
    cannot prove it; `expected`: `expected_logprobs`, computed only if a probe runs)."""
    started = time.perf_counter()
    fenced = await client.admin.pause(mode="keep")
    if not fenced:
        log.warning("%s server has no /pause endpoint; pushing weights without fencing requests", client.name)
    try:
        stats = await send_weights(
            client, model, dtype=dtype, weight_version=weight_version, only=only, chunk_bytes=chunk_bytes
        )
        # Requests frozen by the pause hold KV the old weights computed: dropping it (and the prefix
        # cache) makes them recompute their context with the new weights when they resume.
        reset = time.perf_counter()
        await client.admin.reset_prefix_cache(reset_running_requests=True)
        stats.seconds["reset"] = time.perf_counter() - reset
    except BaseException:
        if fenced:
            await resume_after_failure(client)
        raise
    if fenced:
        await client.admin.resume()
    return await verify_transfer(
        client,
        model,
        probes,
        expected,
        stats,
        top_k=top_k,
        tolerance=tolerance,
        previous=previous,
        started=started,
        probe=probe,
        previous_digest=previous_digest,
        expected_digest=expected_digest,
    )


async def verify_transfer(
    client: VLLMClient,
    model: Any,
    probes: Sequence[Sequence[int]],
    expected: np.ndarray | SharedResult,
    stats: TransferStats,
    *,
    top_k: int,
    tolerance: float,
    previous: np.ndarray | SharedResult | None,
    started: float,
    via: str = "memory",
    probe: bool = True,
    previous_digest: str | None = None,
    expected_digest: str | None = None,
) -> PushReport:
    """Prove, after an in-memory push that `stats` describes (begun at `started`, perf_counter),
    that the server serves `model`'s weights; WeightSyncError says what it serves instead.

    The server's digest must equal `expected_digest` (default: the digest of what this push sent;
    a replica catching up compares with the newest push's) and proves the exact step. The
    logprob probe runs when `probe` asks, and whenever the digest does not prove the push
    (dualvllm.training.push_check says when and why); a digest that differs fails the push with
    what the probe found. `previous_digest` / `previous`: the push before's digest / expected
    logprobs, which tell a server that still holds the old step.
    """
    stats = replace(stats, seconds=dict(stats.seconds))  # this server's own times
    verify = time.perf_counter()
    sent = expected_digest or stats.digest
    served = await client.admin.weight_digest() if sent is not None else ServedDigest(None, "the push was not digested")
    verdict = digest_verdict(sent, served.digest, previous_digest)
    diff = None
    if probe or verdict != "equal":
        wanted = expected if isinstance(expected, SharedResult) else SharedResult(expected)
        diff = compare_logprobs(await client.next_token_topk(probes, top_k), await wanted.get())
    stats.seconds["verify"] = time.perf_counter() - verify
    if verdict in ("stale", "differs"):
        assert diff is not None
        found = (
            f"logprobs within tolerance (max |diff| {diff.max_abs_diff:.2e}), as a small step's stay in bf16"
            if diff.within(tolerance)
            else mismatch_message(client, diff, tolerance, [], tied=_ties(model))
        )
        raise WeightSyncError(
            f"{client.name} server at {client.url}, after an in-memory push whose four phases all answered: "
            + digest_failure(verdict, sent, served.digest, found)
        )
    if diff is not None and not diff.within(tolerance):
        earlier = previous.peek() if isinstance(previous, SharedResult) else previous
        stale = earlier is not None and compare_logprobs(await client.next_token_topk(probes, top_k), earlier).within(
            tolerance
        )
        took = " and whose digests agree (the server loaded exactly the bytes sent)" if verdict == "equal" else ""
        raise WeightSyncError(
            f"after an in-memory push whose four phases all answered{took}, "
            + mismatch_message(client, diff, tolerance, [], stale=stale, tied=_ties(model))
        )
    stats.seconds["total"] = time.perf_counter() - started
    how = verified_by(verdict, diff is not None)
    log.info(
        "pushed %.1f MB in %d chunks to %s in memory (%s) in %.2f s (%s); verified by %s%s%s",
        stats.bytes / 1e6,
        stats.chunks,
        client.url,
        via,
        stats.seconds["total"],
        ", ".join(f"{k} {v:.2f} s" for k, v in stats.seconds.items() if k != "total"),
        how,
        "" if served.digest is None else f" (digest {short(served.digest)})",
        "" if diff is None else f", max |logprob diff| {diff.max_abs_diff:.2e} on {len(probes)} probes",
    )
    return PushReport(
        path=None,
        max_abs_diff=None if diff is None else diff.max_abs_diff,
        probes=0 if diff is None else len(probes),
        reload_sends=1,
        via=via,
        bytes_moved=stats.bytes,
        seconds=dict(stats.seconds),
        digest=served.digest,
        verified_by=how,
        no_digest=served.missing if sent is not None else None,
    )


def _ties(model: Any) -> bool:
    base = model.get_base_model() if lora.is_lora(model) else model
    return bool(getattr(base.config, "tie_word_embeddings", False))
