"""LockstepProcessor: a vLLM v1 logits processor that lets a coordinator pick every token.

Loaded by the server (`--logits-processors dualvllm.engines.vllm_plugin.processor:LockstepProcessor`);
imports only vllm, torch and numpy. A request is a lockstep request when its
`vllm_xargs` carry `wire.ARGS`; every other request is untouched, and a step without
lockstep rows costs one dict check.

At each decode step, for the lockstep rows of each coordinator:
1. log-softmax of the raw logits and their top-k (what per-token mode's top_logprobs
   hold, computed from the same float32 logits);
2. one report to the coordinator (wire.Report, over link.py's TCP connection), then a wait
   for its reply;
3. every logit of the row set to -inf except the chosen token's (0), so the sampler emits
   exactly that token whatever the request's temperature. END emits the request's stop
   token instead, which ends the request.

Liveness: the wait is bounded by DUALVLLM_LOCKSTEP_TIMEOUT_S (default 60 s, well below
vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS of 300 s, past which the engine dies). When it
fires, that coordinator's rows are ended and the server goes on serving everyone else;
raising here would kill the engine, and falling back to the model's own sampling would
let the two servers' sequences diverge silently.

Several coordinators (`serve --workers`, one per data-parallel rank) may share a server: a
step then waits on all of them, and one coordinator's rows can wait on a step that waits on
another's. Each report says so (wire.FLAG_SHARED) for the coordinator to break such a
deadlock across coordinators (coordinator/lockstep/waits.py), which none of them sees whole.

Positions are counted here, per request, from the offset the coordinator gave: never
read from vLLM's output lists, which hold placeholders under async scheduling. A
preempted request keeps its count when it comes back. Rows of a partially prefilled
prompt would be counted as steps, so chunked prefill must be off (the launcher turns it
off); a server with it on says so in every report and the coordinator refuses it.

Security: the processor connects only to the address in the request, and only to a
loopback host unless DUALVLLM_LOCKSTEP_ALLOWED_HOSTS lists the host:
otherwise any client of the server could make it connect anywhere.

Tensor parallelism (untested here, no GPUs): every rank runs its own processor; rank 0
talks to the coordinators and broadcasts the chosen tokens to the others, so every rank
applies the same tokens. Model Runner V2 (the GPU default in vLLM 0.32) has another
processor interface: processor_v2.py runs the same `LockstepSteps` behind it. The launcher
starts lockstep servers on GPUs with V1 (VLLM_USE_V2_MODEL_RUNNER=0) unless the user sets
VLLM_USE_V2_MODEL_RUNNER=1, then with LockstepProcessorV2.
"""

from __future__ import annotations

import os
import time
from urllib.parse import urlsplit

import numpy as np
import torch
from vllm import SamplingParams
from vllm.logger import init_logger
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from dualvllm.engines.vllm_plugin import wire
from dualvllm.engines.vllm_plugin.link import CoordinatorLink, shared
from dualvllm.engines.vllm_plugin.net import is_loopback

log = init_logger("vllm.dualvllm_lockstep")  # under "vllm": the server's own log format and level

TIMEOUT_ENV = "DUALVLLM_LOCKSTEP_TIMEOUT_S"
ALLOWED_HOSTS_ENV = "DUALVLLM_LOCKSTEP_ALLOWED_HOSTS"
DEFAULT_TIMEOUT_S = 60.0
# Positions of requests that were removed without being ended (aborted by their client)
# stay counted; past this many the ones no longer in the batch are forgotten.
MAX_REMEMBERED_POSITIONS = 100_000


def tagged(params: SamplingParams | None) -> wire.Tagged | None:
    """The request's lockstep arguments, or None for an ordinary request; ValueError if malformed."""
    args = (params.extra_args if params is not None else None) or {}
    present = [key for key in wire.ARGS if key in args]
    if not present:
        return None
    missing = [key for key in wire.ARGS if key not in args]
    if missing:
        raise ValueError(f"lockstep request without {missing} in vllm_xargs (it has {present})")
    numbers = {key: args[key] for key in wire.ARGS[1:]}
    if any(not isinstance(v, int) or isinstance(v, bool) for v in numbers.values()):
        raise ValueError(f"lockstep vllm_xargs {sorted(numbers)} must be integers, got {numbers}")
    if numbers[wire.ARG_OFFSET] < 0 or numbers[wire.ARG_TOP_K] < 1 or numbers[wire.ARG_STOP] < 0:
        raise ValueError(f"lockstep vllm_xargs out of range: {numbers}")
    address = args[wire.ARG_ADDRESS]
    check_address(address)
    return wire.Tagged(
        address=address,
        id=numbers[wire.ARG_ID],
        offset=numbers[wire.ARG_OFFSET],
        top_k=numbers[wire.ARG_TOP_K],
        stop=numbers[wire.ARG_STOP],
    )


def check_address(address: object) -> None:
    """Refuse a coordinator address this server may not connect to (ValueError)."""
    if not isinstance(address, str):
        raise ValueError(f"{wire.ARG_ADDRESS} must be a string, got {address!r}")
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:  # a port out of range or not a number
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"{wire.ARG_ADDRESS}={address!r} must be tcp://HOST:PORT")
    allowed = {h.strip() for h in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if h.strip()}
    if not is_loopback(parts.hostname) and parts.hostname not in allowed:
        raise ValueError(
            f"lockstep coordinator {address!r} is not on a loopback address; this server connects "
            f"elsewhere only to hosts listed in {ALLOWED_HOSTS_ENV} when it starts"
        )


def row_topk(logits: torch.Tensor, rows: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k log-softmax values and ids of `rows` of `logits` [B, V] -> ([R, k], [R, k]).

    log_softmax(x) = x - logsumexp(x) shifts a row by one number, so the top-k of the raw
    logits are the top-k of its log-softmax: the row is read twice (top-k, logsumexp) and
    never copied or rewritten. At a real vocabulary this is the plugin's own cost per token
    on CPU: at V = 151,936, 0.8-1.0 ms of CPU per token on one thread, 10-29% less than a
    row copy and a full log_softmax at batch 64-256, the same at 1-8
    (benchmarks/lockstep_plugin_topk.py).
    """
    whole = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
    selected = logits if whole else logits.index_select(0, torch.tensor(rows, device=logits.device))
    top, ids = torch.topk(selected, k, dim=-1)
    return top - torch.logsumexp(selected, dim=-1, keepdim=True), ids


class LockstepSteps:
    """What the plugin does at each decode step, whichever runner calls it: report the lockstep
    rows' top-k to their coordinators, wait for the tokens, force them; count each request's
    positions from the offset its coordinator gave."""

    def __init__(self, vllm_config) -> None:
        self._next_position: dict[tuple[str, int], int] = {}  # (address, id) -> its next position
        self._links: dict[str, CoordinatorLink] = {}
        self._timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        scheduler = vllm_config.scheduler_config
        self._flags = wire.FLAG_CHUNKED_PREFILL if getattr(scheduler, "enable_chunked_prefill", False) else 0
        self._capacity = int(scheduler.max_num_seqs)
        parallel = vllm_config.parallel_config
        self._tp_size = parallel.tensor_parallel_size
        self._rank = 0
        if self._tp_size > 1:
            from vllm.distributed import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()

    def admit(self, request: wire.Tagged) -> None:
        """A request entered the batch (new, or back after preemption: its count stands)."""
        self._next_position.setdefault(request.key, request.offset)

    def forget_all_but(self, live: set[tuple[str, int]]) -> None:
        """Bound the memory of requests removed without being ended (aborted by their client)."""
        if len(self._next_position) > MAX_REMEMBERED_POSITIONS:
            self._next_position = {k: v for k, v in self._next_position.items() if k in live}

    def step(self, logits: torch.Tensor, rows: list[int], requests: list[wire.Tagged]) -> None:
        """Decide `rows` of `logits` (the rows of `requests`, in that order) in place."""
        tokens = self._ask_coordinators(logits, rows, requests) if self._rank == 0 else None
        if self._tp_size > 1:
            from vllm.distributed import get_tp_group

            tokens = get_tp_group().broadcast_object(tokens, src=0)
        self._force(logits, rows, requests, tokens)  # type: ignore[arg-type]

    def _ask_coordinators(self, logits: torch.Tensor, rows: list[int], requests: list[wire.Tagged]) -> list[int]:
        """The token (or wire.END) of every row, in `rows` order, from the rows' coordinators."""
        by_address: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            by_address.setdefault(request.address, []).append(i)
        vocab = logits.shape[-1]
        now = time.monotonic()
        deadline = now + self._timeout_s
        flags = self._flags | (wire.FLAG_SHARED if shared(self._links, by_address, now) else 0)
        asked: list[tuple[CoordinatorLink, list[int]]] = []
        for address, members in by_address.items():
            k = min(max(requests[i].top_k for i in members), vocab)
            values, ids = row_topk(logits, [rows[i] for i in members], k)
            link = self._links.get(address) or self._links.setdefault(address, CoordinatorLink(address))
            link.step += 1
            link.last_report = now
            link.send(
                wire.encode_report(
                    link.step,
                    flags,
                    self._capacity,
                    np.fromiter((requests[i].id for i in members), np.int64, len(members)),
                    np.fromiter((self._position(requests[i]) for i in members), np.int64, len(members)),
                    ids.to(torch.int32).cpu().numpy(),
                    values.cpu().numpy(),
                ),
                deadline,
            )
            asked.append((link, members))
        tokens = [wire.END] * len(requests)
        for link, members in asked:
            answer = link.receive(deadline)
            if answer is None or len(answer) != len(members):
                log.warning(
                    "lockstep coordinator %s %s; ending its %d sequences here (their tokens so far "
                    "stand), the server goes on",
                    link.address,
                    f"{link.problem} (waiting at most {self._timeout_s:g} s, {TIMEOUT_ENV})"
                    if answer is None
                    else f"answered {len(answer)} rows for {len(members)}",
                    len(members),
                )
                continue
            for i, token in zip(members, answer.tolist()):
                tokens[i] = token if 0 <= token < vocab else wire.END
        return tokens

    def _force(self, logits: torch.Tensor, rows: list[int], requests: list[wire.Tagged], tokens: list[int]) -> None:
        """Mask each row to its token (END -> the request's stop token); advance positions."""
        forced = []
        for request, token in zip(requests, tokens):
            if token == wire.END:
                forced.append(request.stop)
                self._next_position.pop(request.key, None)
            else:
                forced.append(token)
                self._next_position[request.key] = self._position(request) + 1
        index = torch.tensor(rows, device=logits.device)
        chosen = torch.tensor(forced, device=logits.device)
        logits.index_fill_(0, index, float("-inf"))
        logits[index, chosen] = 0.0

    def _position(self, request: wire.Tagged) -> int:
        return self._next_position.setdefault(request.key, request.offset)


class LockstepProcessor(LogitsProcessor):
    """The plugin for vLLM's V1 model runner (the CPU build's; `VLLM_USE_V2_MODEL_RUNNER=0` on GPUs)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse malformed lockstep arguments at admission (HTTP 400), not in the engine loop."""
        validate(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, wire.Tagged] = {}  # batch row -> lockstep request
        self._steps = LockstepSteps(vllm_config)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            request = admitted(params)
            if request is None:
                self._rows.pop(index, None)
                continue
            self._rows[index] = request
            self._steps.admit(request)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self._rows.pop(a, None), self._rows.pop(b, None)
            if row_a is not None:
                self._rows[b] = row_a
            if row_b is not None and direction == MoveDirectionality.SWAP:
                self._rows[a] = row_b
        self._steps.forget_all_but({request.key for request in self._rows.values()})

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        rows = sorted(self._rows)
        self._steps.step(logits, rows, [self._rows[r] for r in rows])
        return logits


def validate(sampling_params: SamplingParams) -> None:
    """Both runners' check of a request's lockstep arguments."""
    request = tagged(sampling_params)
    if request is not None and request.stop not in (sampling_params.stop_token_ids or ()):
        raise ValueError(
            f"lockstep request: its stop token {request.stop} ({wire.ARG_STOP}) must be in "
            "stop_token_ids, or END would not end it"
        )


def admitted(params: SamplingParams | None) -> wire.Tagged | None:
    """The lockstep request a batch entry carries, or None."""
    try:
        return tagged(params)
    except ValueError:  # validate_params refused it at admission; never expected here
        return None
