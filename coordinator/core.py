"""DualVLLMCoordinator: the public face of the sampling service.

    async with DualVLLMCoordinator(CoordinatorConfig(theta_url=..., t_url=...)) as c:
        outputs = await c.generate_batch(["12+34="], max_tokens=8)
        async for out in c.stream(prompts, max_tokens=64):
            ...

Entering checks that both servers are healthy, share a tokenizer and EOS, and accept
top_k. Concurrent calls on one coordinator share its continuous batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from dualvllm.coordinator import kernel
from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.outputs import GenerationOutput, Prompt
from dualvllm.coordinator.prompts import encode_prompts
from dualvllm.coordinator.sequence import SamplingParams, SequenceState, TokenListener
from dualvllm.coordinator.startup import Session, open_session
from dualvllm.coordinator.stats import Statistics, StepTiming
from dualvllm.common import heap
from dualvllm.common.errors import InvalidInputError, LifecycleError, TopKUnsupportedError
from dualvllm.engines.pool import as_pool, request_counts, vllm_members
from dualvllm.engines.protocol import Engine
from dualvllm.engines.vllm_transport import CallObserver

log = logging.getLogger("dualvllm.coordinator")


class DualVLLMCoordinator:
    """Samples from q* ∝ pi_theta^(1-alpha*) pi_t^alpha* over two engines."""

    def __init__(
        self,
        config: CoordinatorConfig | None = None,
        *,
        theta_engine: Engine | None = None,
        t_engine: Engine | None = None,
    ) -> None:
        """`theta_engine`/`t_engine` replace the HTTP clients (in-process engines, tests)."""
        self.config = config or CoordinatorConfig()
        self._given_engines = (theta_engine, t_engine)
        self._session: Session | None = None  # set once entered (dualvllm.coordinator.startup)
        self._stack = contextlib.AsyncExitStack()
        self._stats = Statistics()
        self._sequence_keys = itertools.count()
        self._seed_source = np.random.default_rng(self.config.seed)
        self._state = "new"
        given_one = theta_engine is not None and theta_engine is t_engine
        self._self_teacher = given_one or (theta_engine is None and t_engine is None and self.config.self_teacher)

    async def __aenter__(self) -> DualVLLMCoordinator:
        if self._state != "new":
            raise LifecycleError("a DualVLLMCoordinator can be entered once; create a new one")
        self._state = "open"
        if self.config.enable_logging:
            logging.getLogger("dualvllm").setLevel(self.config.log_level)
        # The compiled step loads from numba's cache (or compiles, on a fresh machine) at its
        # first call: done here in a thread, beside the servers' checks, so that the first
        # request does not wait for it (0.5-0.6 s from the cache on these machines, 5 s to compile).
        warming = asyncio.ensure_future(asyncio.to_thread(kernel.warm_up, self.config.step_threads))
        try:
            self._session = await open_session(self.config, self._given_engines, self._stack, self._stats)
            await warming
            if self.config.freeze_gc_heap:  # start-up is over: its objects stay for the run
                heap.freeze()
                self._stack.callback(heap.thaw)
        except BaseException:
            await asyncio.gather(warming, return_exceptions=True)
            await self._stack.aclose()
            self._state = "closed"
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the scheduler, then the clients and pools, each bounded (a ShutdownTimeoutError
        names what did not end); the clients are closed even when the scheduler's close fails."""
        try:
            if self._session is not None:
                await self._session.scheduler.close()
        finally:
            try:
                await self._stack.aclose()
            finally:
                self._state = "closed"

    @property
    def mode(self) -> str:
        """How tokens reach the servers: "lockstep", "speculative" or "per_token" (known once entered)."""
        return self._session.scheduler.mode if self._session is not None else "per_token"

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The end-of-sequence ids generation stops at (known once entered)."""
        return self._session.eos_ids if self._session is not None else frozenset()

    # -- generation ------------------------------------------------------------------

    async def stream(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        show_progress: bool = False,
        on_tokens: TokenListener | None = None,
        **settings: Any,
    ) -> AsyncGenerator[GenerationOutput, None]:
        """Yield each prompt's output as soon as it finishes (any order; see `.index`).

        `params`: a SamplingParams (coordinator/sequence.py documents each field), or its
        fields as keywords (`max_tokens=64, temperature=0`), not both. temperature 0 is greedy
        decoding of q*; `fixed_alpha` replaces alpha* (0 = base only, 1 = teacher only) for
        ablations; `top_logprobs` records q*'s most likely candidates per token; `record_topk`
        each model's most likely ids and raw logprobs (what distillation losses need);
        `max_alpha` caps alpha* (an alpha schedule that ends on-policy).

        `seed` makes the call reproducible (each sequence gets its own sampler, seeded by
        (seed, index), so results do not depend on what else is in the batch); `seeds` gives
        one seed per prompt instead, so a resumed job samples each prompt as the first run
        would have. `on_tokens(index, token_ids, logprobs_q, top_logprobs)` is called from the
        coordinator's loop with each sequence's tokens as they are decided, their log q* and
        (when `top_logprobs` asks) their top candidates (keep it cheap: hand them to a queue).
        """
        session = self._require_open()
        scheduler = session.scheduler
        params = self.check(_params(params, settings))
        if not prompts:
            return
        encoded = await encode_prompts(prompts, session.theta, session.t)
        if self._self_teacher:
            same = next((i for i, (ids_theta, ids_t) in enumerate(encoded) if ids_theta == ids_t), None)
            if same is not None:
                raise InvalidInputError(
                    f"prompt {same}: the base and the teacher are one model (one server), and this prompt is the "
                    "same for both, so q* would be the model itself. Give a (theta_prompt, t_prompt) pair whose "
                    "teacher prompt adds information (e.g. the answer), or use a separate teacher server"
                )
        if seeds is not None and len(seeds) != len(prompts):
            raise InvalidInputError(f"got {len(seeds)} seeds for {len(prompts)} prompts; give one per prompt")
        base_seed = int(self._seed_source.integers(2**63)) if seed is None else seed
        rng_keys = [[int(s)] for s in seeds] if seeds is not None else [[base_seed, i] for i in range(len(prompts))]
        sink: asyncio.Queue[GenerationOutput] = asyncio.Queue()
        sequences = [
            SequenceState(
                index=i,
                prompt=prompt,
                theta_prompt_ids=tuple(ids_theta),
                t_prompt_ids=tuple(ids_t),
                params=params,
                rng=np.random.default_rng(rng_keys[i]),
                sink=sink,
                listener=on_tokens,
                key=next(self._sequence_keys),
            )
            for i, (prompt, (ids_theta, ids_t)) in enumerate(zip(prompts, encoded))
        ]
        runnable = []
        for seq in sequences:
            longest = max(len(seq.theta_prompt_ids), len(seq.t_prompt_ids))
            if longest >= scheduler.max_len:
                seq.finish_reason, seq.text = "context_limit", ""
                seq.error = (
                    f"the prompt has {longest} tokens and leaves no room in the "
                    f"servers' context limit of {scheduler.max_len} tokens"
                )
                sink.put_nowait(seq.output())
            else:
                runnable.append(seq)
        scheduler.submit(runnable)
        try:
            with tqdm(total=len(sequences), disable=not show_progress, unit="seq", desc="generating") as progress:
                for _ in range(len(sequences)):
                    output = await sink.get()
                    progress.update(1)
                    yield output
        finally:
            for seq in sequences:
                seq.cancelled = True

    async def generate_batch(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        show_progress: bool = False,
        **settings: Any,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; outputs in input order. Arguments as in `stream`."""
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        async for output in self.stream(
            prompts, params, seed=seed, seeds=seeds, show_progress=show_progress, **settings
        ):
            outputs[output.index] = output
        assert all(o is not None for o in outputs)
        return outputs  # type: ignore[return-value]

    def check(self, params: SamplingParams) -> SamplingParams:
        """`params` checked against this coordinator: raises what `stream` would, before
        anything starts (the HTTP service answers with it before a stream begins)."""
        if params.top_k is not None and params.top_k > self.config.top_k:
            raise TopKUnsupportedError(
                f"top_k={params.top_k} is above the coordinator's top_k={self.config.top_k}, the candidates it asks "
                "the servers for (checked against their --max-logprobs at start-up); ask for at most "
                f"{self.config.top_k}, or restart the coordinator with a larger top_k"
            )
        if params.record_topk > self.config.top_k:
            raise InvalidInputError(
                f"record_topk={params.record_topk} is above the coordinator's top_k="
                f"{self.config.top_k}, the candidates the servers send; ask for at most that"
            )
        if self._session is not None:
            self._session.scheduler.check(params)
        return params

    async def encode(self, prompts: Sequence[Prompt]) -> list[tuple[list[int], list[int]]]:
        """(base ids, teacher ids) of each prompt, tokenized as `stream` would: text by each
        model's tokenizer; a (theta_prompt, t_prompt) pair part by part."""
        session = self._require_open()
        return await encode_prompts(prompts, session.theta, session.t)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, by the base model's tokenizer (as outputs' texts are)."""
        return await self._require_open().theta.detokenize(token_ids)

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        role: str = "theta",
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat, rendered with the chat template of the base (role "theta") or
        the teacher ("t"), ending with the prompt for the assistant's turn; `template_kwargs`:
        extra template variables (vLLM's chat_template_kwargs)."""
        session = self._require_open()
        return await (session.theta if role == "theta" else session.t).tokenize_chat(messages, template_kwargs)

    @property
    def is_open(self) -> bool:
        """True between entering and leaving `async with`."""
        return self._state == "open"

    @property
    def session(self) -> Session:
        """What the open coordinator knows: both engines (`theta`, `t`: a client each, or a
        ReplicaPool), the models' names, `max_model_len` (prompt + generated tokens both servers
        accept), `vocab_size` (ids both accept, when their configs tell), the EOS ids, the scheduler."""
        return self._require_open()

    @property
    def base_engine(self) -> Engine:
        """The base role's engine: its server's client, or the ReplicaPool of its replicas'
        clients. A trainer pushes weights through it (dualvllm.training.weight_sync.BasePusher)."""
        return self._require_open().theta

    @property
    def capacity(self) -> int:
        """Sequences generated at once; more wait in the coordinator's queue."""
        return self._require_open().scheduler.capacity

    def observe_server_calls(self, observer: CallObserver) -> None:
        """Call `observer(server, path, seconds, ok)` after every request to either server
        (metrics); the coordinator's own engines only (not engines given to the constructor
        that are not VLLMClients)."""
        session = self._require_open()
        for engine in (session.theta, session.t):
            for client in vllm_members(engine) or []:
                client.transport.observers.append(observer)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold generation while the caller changes a server, e.g. a weight push:

            async with coordinator.paused():
                await push_weights(base_client, model, tokenizer, out_dir, probes)

        In lockstep mode every sequence in flight is taken off both servers at its agreed
        tokens (their server requests end) and starts again from there after the block: the
        push's /pause?mode=wait then waits for no sequence, and the tokens after it come from
        the new weights, as in per-token mode. Other modes send a request per step, which the
        server's /pause already fences: nothing to hold here. Streams stay open throughout.
        """
        async with self._require_open().scheduler.paused():
            yield

    def get_statistics(self) -> dict[str, float]:
        """Tokens, requests, retries, failures, mean alpha, tokens/s, step latency p50/p95;
        in speculative mode also the acceptance rate and tokens per sequence-round; in
        lockstep mode also parks, resubmissions, the share of server steps that ran ahead of the
        other server's, how long the servers waited on the coordinator (a "step" there is
        the time between decisions), and how often new sequences were admitted out of step."""
        session = self._session
        roles = (session.theta, session.t) if session is not None else ()
        summary = self._stats.summary(**request_counts(roles))
        for pool in filter(None, map(as_pool, roles)):
            summary.update(pool.membership.counters.summary(pool.name))
            summary[f"{pool.name}_replicas_up"] = len(pool.membership.healthy)
        if session is not None:
            summary.update(session.scheduler.statistics())
        return summary

    def recent_step_timings(self) -> list[StepTiming]:
        """Where the most recent steps spent their time, phase by phase, oldest first."""
        return list(self._stats.step_timings)

    def _require_open(self) -> Session:
        if self._state != "open" or self._session is None:
            raise LifecycleError("the coordinator is not open; use `async with DualVLLMCoordinator(config) as c:`")
        return self._session


def _params(params: SamplingParams | None, settings: dict[str, Any]) -> SamplingParams:
    """A call's SamplingParams: the one given, or one built from its fields given as keywords."""
    if params is None:
        return SamplingParams(**settings)
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(
            f"params must be a SamplingParams (or give its fields as keywords, e.g. "
            f"max_tokens=...), got {type(params).__name__}"
        )
    if settings:
        raise InvalidInputError(
            f"got a SamplingParams and sampling keywords ({', '.join(sorted(settings))}); "
            "give one of them (dataclasses.replace(params, ...) changes a field)"
        )
    return params
