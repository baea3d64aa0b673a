"""Two coordinators in lockstep on one pair of servers (`serve --workers`, data-parallel ranks):
each server's step waits on both, so one coordinator's rows can wait on a step that waits on the
other's, a deadlock neither sees whole (coordinator/lockstep/waits.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.coordinator.sequence import SamplingParams, SequenceState
from dualvllm.engines.vllm_plugin import wire
from tests.fake_lockstep import FakeLockstepServer, FakeRequest
from tests.unit.coordinator.lockstep_rig import (
    OUTPUT_TIMEOUT_S,
    SEED,
    assert_per_token_tokens,
    config,
    t_prompt,
    theta_prompt,
)


def sequences(indices: range, max_tokens: int) -> list[SequenceState]:
    sink: asyncio.Queue[GenerationOutput] = asyncio.Queue()
    params = SamplingParams(max_tokens)
    return [SequenceState(index=i, prompt=f"prompt {i}", theta_prompt_ids=theta_prompt(i), t_prompt_ids=t_prompt(i),
                          params=params, rng=np.random.default_rng([SEED, i]), sink=sink) for i in indices]


async def outputs_of(batch: list[SequenceState]) -> list[GenerationOutput]:
    got = [await asyncio.wait_for(batch[0].sink.get(), OUTPUT_TIMEOUT_S) for _ in batch]
    return sorted(got, key=lambda out: out.index)


def late_for(late: dict[str, str]):
    """An admission policy: once `late` names a coordinator address ("address"), its requests
    enter the batch one step after they reach the engine (a front end slower for them), the
    others' at once; before that, everything at once."""
    queued_at: dict[int, int] = {}

    def admit(server: FakeLockstepServer, queued: list[FakeRequest]) -> list[FakeRequest]:
        admitted = []
        for request in queued:
            arrived = queued_at.setdefault(id(request), server.steps)
            if request.address != late.get("address") or server.steps > arrived:
                admitted.append(request)
        return admitted

    return admit


async def test_a_deadlock_across_two_coordinators_is_broken_by_the_one_that_holds_the_base(rig):
    """Coordinator A's sequences enter the teacher a step after the base, B's the base a step
    after the teacher: the base waits on A for the teacher's next step, while the teacher waits
    on B for the base's next step. Neither sees both servers wait on it, and the stall limit
    (60 s) is far off: A, which holds the shared base, parks its rows within a few steps; B,
    which holds the teacher, never parks. Every token is still q*'s."""
    late_on_theta: dict[str, str] = {}
    late_on_t: dict[str, str] = {}
    theta, t = rig.servers(theta={"admit": late_for(late_on_theta)}, t={"admit": late_for(late_on_t)})
    cfg = config(lockstep_aligned_admission=False)
    a, b = rig.scheduler(theta, t, cfg), rig.scheduler(theta, t, cfg)
    # Each coordinator's first sequence (as its start-up check does): both servers now know
    # they are shared.
    warm_a, warm_b = sequences(range(8, 9), max_tokens=2), sequences(range(9, 10), max_tokens=2)
    a.submit(warm_a)
    b.submit(warm_b)
    await asyncio.gather(outputs_of(warm_a), outputs_of(warm_b))
    late_on_theta["address"], late_on_t["address"] = b._channel.address, a._channel.address

    batch_a, batch_b = sequences(range(0, 4), max_tokens=12), sequences(range(4, 8), max_tokens=12)
    a.submit(batch_a)
    b.submit(batch_b)
    outputs = await asyncio.gather(outputs_of(batch_a), outputs_of(batch_b))
    await asyncio.wait_for(asyncio.gather(a.close(), b.close()), OUTPUT_TIMEOUT_S)

    for batch, outs in zip((batch_a, batch_b), outputs):
        for out in outs:
            assert out.ok and out.finish_reason in ("max_tokens", "eos"), out
            assert_per_token_tokens(out, theta.model, t.model, batch[0].params, cfg)
    assert a.counters.parks >= 1 and b.counters.parks == 0
    assert theta.idle and t.idle


def test_a_report_says_whether_its_server_is_shared():
    """The plugin's flag (engines/vllm_plugin/link.py `shared`): a step that asks two
    coordinators, or one while another was asked within the window, is shared."""
    from dualvllm.engines.vllm_plugin.link import CoordinatorLink, shared

    links = {address: CoordinatorLink(address) for address in ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")}
    assert not shared(links, ["tcp://127.0.0.1:1"], now=100.0)  # neither was ever asked
    assert shared(links, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], now=100.0)
    links["tcp://127.0.0.1:2"].last_report = 100.0 - wire.SHARED_WINDOW_S / 2
    assert shared(links, ["tcp://127.0.0.1:1"], now=100.0)
    assert not shared(links, ["tcp://127.0.0.1:1"], now=100.0 + wire.SHARED_WINDOW_S)
    assert not shared(links, ["tcp://127.0.0.1:2"], now=100.0)  # only the one it asks
