"""What the lockstep scheduler's tests share (test_lockstep*.py): two fake lockstep servers, the
per-token replay every output is checked against, and the Rig that closes both at a test's end."""

from __future__ import annotations

import asyncio

import numpy as np

from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.lockstep import LockstepScheduler
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.coordinator.sequence import SamplingParams, SequenceState
from dualvllm.coordinator.stats import Statistics
from dualvllm.coordinator.step import mix_and_sample
from dualvllm.engines.lockstep_channel import LockstepChannel
from dualvllm.engines.protocol import TopKBatch
from dualvllm.engines.vllm_plugin import wire
from tests.fake_lockstep import EOS_ID, VOCAB_SIZE, FakeLockstepServer, FakeModel, FakeRequest
from tests.waiting import eventually


TOP_K = 8


MAX_LEN = 4096


SEED = 7


OUTPUT_TIMEOUT_S = 20.0  # only a hung scheduler gets near it


def theta_prompt(i: int) -> list[int]:
    return [key(i), 3, 5]


def t_prompt(i: int) -> list[int]:
    return [key(i), 4, 4, 6]  # each server gets its own prompt; the continuation is shared


def key(i: int) -> int:
    """The first prompt token of sequence i, which tells the fakes whose request it is."""
    return 10 + i


def config(**kw) -> CoordinatorConfig:
    kw.setdefault("top_k", TOP_K)
    # Only the stall tests want the watchdog; elsewhere it must never park anything.
    kw.setdefault("lockstep_stall_timeout", 60.0)
    return CoordinatorConfig(**kw)


def make_sequences(n: int, max_tokens: int, **params) -> list[SequenceState]:
    sink: asyncio.Queue[GenerationOutput] = asyncio.Queue()
    p = SamplingParams(max_tokens, **params)
    return [SequenceState(index=i, prompt=f"prompt {i}", theta_prompt_ids=theta_prompt(i), t_prompt_ids=t_prompt(i),
                          params=p, rng=np.random.default_rng([SEED, i]), sink=sink) for i in range(n)]


def replay(theta: FakeModel, t: FakeModel, i: int, params: SamplingParams, cfg: CoordinatorConfig,
           theta_from: tuple[int, FakeModel] | None = None) -> tuple[list[int], list[float]]:
    """(tokens, log q* of each) of sequence i by the per-token step, one token at a time;
    `theta_from` = (position, model): the base serves that model from that position on."""
    rng = np.random.default_rng([SEED, i])
    tokens: list[int] = []
    logprobs_q: list[float] = []
    while True:
        batches = []
        base = theta_from[1] if theta_from is not None and len(tokens) >= theta_from[0] else theta
        for model, prompt in ((base, theta_prompt(i)), (t, t_prompt(i))):
            ids, logprobs = model.topk(prompt + tokens, cfg.top_k)
            batches.append(TopKBatch(token_ids=ids[None].astype(np.int64), logprobs=logprobs[None].astype(np.float64)))
        step = mix_and_sample(
            *batches, temperature=np.array([params.temperature]),
            fixed_alpha=np.array([np.nan if params.fixed_alpha is None else params.fixed_alpha]),
            uniforms=np.array([rng.random()]), fill=cfg.fill_rule, vocab_size=VOCAB_SIZE,
            alpha_tol=cfg.alpha_tol, alpha_max_iter=cfg.alpha_max_iter)
        tokens.append(int(step.token_ids[0]))
        logprobs_q.append(float(step.logprob_q[0]))
        if (tokens[-1] == EOS_ID and not params.ignore_eos) or len(tokens) >= params.max_tokens:
            return tokens, logprobs_q


def assert_per_token_tokens(out: GenerationOutput, theta: FakeModel, t: FakeModel, params: SamplingParams,
                            cfg: CoordinatorConfig) -> None:
    tokens, logprobs_q = replay(theta, t, out.index, params, cfg)
    assert out.generated_tokens == tokens, f"sequence {out.index}"
    np.testing.assert_allclose(out.logprobs_q, logprobs_q, rtol=1e-9, atol=1e-12)


def assert_servers_followed(fake: FakeLockstepServer, outputs: list[GenerationOutput], prompt) -> None:
    """Every request was sent from the agreed tokens (prompt + the output's first `offset`
    tokens), every token a server was told is the agreed token at that position, and every
    request has ended (none left running or waiting on the coordinator)."""
    for out in outputs:
        for request in fake.requests_of(key(out.index)):
            assert request.prompt == prompt(out.index) + out.generated_tokens[:request.offset]
            for position, token in request.answers:
                if token != wire.END:
                    assert token == out.generated_tokens[position], (fake.name, out.index, position)
    assert fake.idle, f"{fake.name}: requests left: {[(r.key, r.finish) for r in fake.requests if r.finish is None]}"


class Rig:
    """Fakes and schedulers of one test, closed at its end whatever happened."""

    def __init__(self) -> None:
        self.fakes: list[FakeLockstepServer] = []
        self.schedulers: list[LockstepScheduler] = []

    def servers(self, theta_model: FakeModel | None = None, t_model: FakeModel | None = None, *,
                theta: dict | None = None, t: dict | None = None) -> tuple[FakeLockstepServer, FakeLockstepServer]:
        fakes = (FakeLockstepServer("theta", theta_model or FakeModel(1), **(theta or {})),
                 FakeLockstepServer("t", t_model or FakeModel(2), **(t or {})))
        self.fakes.extend(fakes)
        return fakes

    def scheduler(self, theta: FakeLockstepServer, t: FakeLockstepServer, cfg: CoordinatorConfig,
                  capacity: int | None = None) -> LockstepScheduler:
        scheduler = LockstepScheduler(theta, t, config=cfg, eos_ids=frozenset({EOS_ID}), max_len=MAX_LEN,  # type: ignore[arg-type]
                                      stats=Statistics(), channel=LockstepChannel(), stop_token=EOS_ID,
                                      capacity=capacity, vocab_size=VOCAB_SIZE)
        self.schedulers.append(scheduler)
        return scheduler

    async def aclose(self) -> None:
        for scheduler in self.schedulers:
            if not scheduler._table.closing:
                await scheduler.close()
        for fake in self.fakes:
            await fake.close()


async def collect(sequences: list[SequenceState]) -> list[GenerationOutput]:
    """Every sequence's output, exactly once, in index order."""
    got: dict[int, GenerationOutput] = {}
    for _ in sequences:
        out = await asyncio.wait_for(sequences[0].sink.get(), OUTPUT_TIMEOUT_S)
        assert out.index not in got, f"sequence {out.index} delivered twice"
        got[out.index] = out
    return [got[i] for i in range(len(sequences))]


async def generate(scheduler: LockstepScheduler, sequences: list[SequenceState]) -> list[GenerationOutput]:
    scheduler.submit(sequences)
    try:
        return await collect(sequences)
    finally:
        await asyncio.wait_for(scheduler.close(), OUTPUT_TIMEOUT_S)


def admit_second_step_only(k: int):
    """An admission policy: the second step (the first after the pilot's) admits only sequence
    k's request, other steps all."""
    def admit(server: FakeLockstepServer, queued: list[FakeRequest]) -> list[FakeRequest]:
        return [r for r in queued if r.key == key(k)] if server.steps == 1 else queued
    return admit


async def crash_during(server: FakeLockstepServer, *, after_steps: int, down_s: float | None) -> None:
    """Crash `server` right after its step `after_steps`; restart it `down_s` later (None: never)."""
    server.hold_after = after_steps
    await eventually(server.holding.is_set, f"{server.name} ran {after_steps} steps")
    await server.crash()
    if down_s is not None:
        await asyncio.sleep(down_s)
        server.down = False
