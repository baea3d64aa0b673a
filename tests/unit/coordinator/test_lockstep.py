"""The lockstep state machine (coordinator/lockstep/scheduler.py) against fake lockstep servers.

Each test drives a real LockstepScheduler and its real LockstepChannel (TCP) with two
FakeLockstepServer (tests/fake_lockstep.py): in-process fakes of vLLM servers running the
dualvllm plugin, with scripted admission and misbehaviour. The expected tokens come from
replaying dualvllm.coordinator.step.mix_and_sample token by token over the fakes' synthetic top-k
with each sequence's own sampler: lockstep must give exactly the per-token step's tokens
whatever the servers' admission order, parks and resubmissions.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dualvllm.common.errors import LifecycleError
from dualvllm.coordinator import admission
from dualvllm.coordinator.lockstep import recovery
from dualvllm.coordinator.admission import AdmissionGate
from dualvllm.coordinator.lockstep.recovery import MAX_REQUEST_FAILURES
from dualvllm.coordinator.outputs import GenerationOutput
from dualvllm.coordinator.sequence import SamplingParams, SequenceState
from dualvllm.engines.vllm_plugin import wire
from tests.fake_lockstep import EOS_ID, FakeModel, FakeRequest
from tests.waiting import eventually
from tests.unit.coordinator.lockstep_rig import (
    OUTPUT_TIMEOUT_S,
    SEED,
    admit_second_step_only,
    assert_per_token_tokens,
    assert_servers_followed,
    collect,
    config,
    crash_during,
    generate,
    key,
    make_sequences,
    replay,
    t_prompt,
    theta_prompt,
)

# A hang is a failure, not a 900 s wait.
pytestmark = pytest.mark.timeout(60)


async def test_aligned_admission_gives_the_per_token_steps_tokens(rig):
    theta, t = rig.servers()
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(4, max_tokens=6)
    outputs = await generate(scheduler, sequences)

    for out in outputs:
        assert out.ok and out.finish_reason == "max_tokens" and len(out.generated_tokens) == 6
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    assert scheduler.counters.parks == 0 and scheduler.counters.resubmissions == 0
    assert scheduler.counters.split_reports == 0  # neither server ran ahead
    for fake, prompt in ((theta, theta_prompt), (t, t_prompt)):
        assert_servers_followed(fake, outputs, prompt)
        # One request per sequence, told every token of positions 0..4 and END at the last one.
        assert len(fake.requests) == 4
        for request in fake.requests:
            assert request.finish == "stop" and request.offset == 0
            assert [position for position, _ in request.answers] == list(range(6))
            assert request.answers[-1][1] == wire.END
        # The first sequence ran one step alone (the pilot that makes both idle servers block),
        # then both servers admitted the other three in the same step: 6 steps + 1.
        assert fake.steps == 7
    gate = scheduler.gate.counters
    assert gate.rounds == 1 and gate.admitted == 3 and gate.misses == 0 and gate.forced == 0


async def test_an_admission_deadlock_is_parked_and_resubmitted_without_losing_a_token(rig):
    # After the pilot (sequence 0), the base admits sequence 1 alone, the teacher sequence 2
    # alone: each waits on a row the other server has not admitted, and neither can step again.
    theta, t = rig.servers(theta={"admit": admit_second_step_only(1)}, t={"admit": admit_second_step_only(2)})
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(3, max_tokens=5)
    outputs = await generate(scheduler, sequences)

    assert scheduler.counters.parks > 0 and scheduler.counters.resubmissions > 0
    assert scheduler.gate.counters.forced == 0  # the gate opened on both servers' steps
    for out in outputs:
        assert out.ok and out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)
    # The parked request was told END at position 0 and resent from offset 0.
    assert len(theta.requests) + len(t.requests) == 6 + scheduler.counters.resubmissions


async def test_servers_admitting_at_different_rates_still_give_the_per_token_tokens(rig):
    def one_new_request_per_step(server, queued):
        return queued[:1]

    theta, t = rig.servers(theta={"admit": one_new_request_per_step})
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(4, max_tokens=5)
    outputs = await generate(scheduler, sequences)

    # The teacher admitted them all at once, the base one per step: the teacher's first
    # report was completed over several of the base's steps.
    assert scheduler.counters.split_reports > 0
    for out in outputs:
        assert out.ok and out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)


def staggered_sequences(n: int) -> list[SequenceState]:
    """Sequences of 3..7 tokens: they end at different steps, so with a small batch each
    finished one lets the next start while the others run (an admission round per end)."""
    sink: asyncio.Queue[GenerationOutput] = asyncio.Queue()
    return [SequenceState(index=i, prompt=f"prompt {i}", theta_prompt_ids=theta_prompt(i), t_prompt_ids=t_prompt(i),
                          params=SamplingParams(3 + i % 5), rng=np.random.default_rng([SEED, i]), sink=sink)
            for i in range(n)]


async def test_sequences_started_while_both_servers_run_are_admitted_in_the_same_step(rig):
    # The teacher's front end takes requests in 30 ms after they are sent and hands them to
    # its engine 1 ms later, the base's at once: without the gate's hold, the base would
    # admit every new sequence steps before the teacher.
    theta, t = rig.servers(t={"accept_delay_s": 0.03, "arrival_delay_s": 0.001})
    cfg = config(max_batch_size=3)
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = staggered_sequences(9)
    outputs = await generate(scheduler, sequences)

    for out, seq in zip(outputs, sequences):
        assert out.ok and len(out.generated_tokens) == seq.params.max_tokens
        assert_per_token_tokens(out, theta.model, t.model, seq.params, cfg)
    gate = scheduler.gate.counters
    assert gate.rounds >= 3 and gate.admitted == 8  # all but the pilot came through the gate
    assert gate.misses == 0 and gate.forced == 0
    assert scheduler.counters.split_reports == 0 and scheduler.counters.parks == 0


async def test_without_aligned_admission_sequences_start_as_soon_as_there_is_room(rig):
    theta, t = rig.servers(t={"accept_delay_s": 0.03})
    cfg = config(max_batch_size=3, lockstep_aligned_admission=False)
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = staggered_sequences(9)
    outputs = await generate(scheduler, sequences)

    for out, seq in zip(outputs, sequences):  # out of step costs time, never tokens
        assert out.ok and len(out.generated_tokens) == seq.params.max_tokens
        assert_per_token_tokens(out, theta.model, t.model, seq.params, cfg)
    assert scheduler.gate.counters.rounds == 0  # no pilot, no gate
    assert scheduler.counters.split_reports > 0  # the teacher's slow front end put it out of step


async def test_the_gate_holds_longer_after_a_hand_over_slower_than_its_wait(rig):
    slow_s = 3 * admission.INITIAL_DELAY_S  # from taking a request in to the engine
    theta, t = rig.servers(t={"arrival_delay_s": slow_s})
    cfg = config(max_batch_size=2)
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = staggered_sequences(12)
    outputs = await generate(scheduler, sequences)

    for out, seq in zip(outputs, sequences):  # misaligned admissions cost time, never tokens
        assert out.ok and len(out.generated_tokens) == seq.params.max_tokens
        assert_per_token_tokens(out, theta.model, t.model, seq.params, cfg)
    gate = scheduler.gate.counters
    # The first rounds missed and the wait grew. How many rounds align after that depends on
    # how busy the machine is (it failed once under load), so the sans-IO test below checks the
    # rule itself: a miss doubles the wait, an aligned round shrinks it.
    assert gate.misses > 0 and scheduler.gate.delay_s > admission.INITIAL_DELAY_S


def test_the_gate_compares_the_servers_admission_steps_not_the_next_report():
    gate = AdmissionGate()
    pairs = [(("A", 1), ("B", 2)), (("A", 3), ("B", 4))]
    # A server that plans a step ahead (async scheduling) admits in its second report, on both
    # servers alike: aligned, and the wait shrinks.
    gate.arm()
    assert gate.opened(pairs) == admission.INITIAL_DELAY_S
    for server in ("A", "B"):
        gate.observe(server, set())
    gate.observe("A", {1, 3})
    gate.observe("B", {2, 4})
    assert (gate.counters.admitted, gate.counters.misses) == (2, 0)
    assert gate.delay_s == pytest.approx(admission.SHRINK * admission.INITIAL_DELAY_S)
    # B admits sequence (3, 4) a step after A: a miss, and the wait doubles.
    before = gate.delay_s
    gate.arm()
    gate.opened(pairs)
    gate.observe("A", {1, 3})
    gate.observe("B", {2})
    gate.observe("B", {2, 4})
    assert (gate.counters.admitted, gate.counters.misses) == (4, 1)
    assert gate.delay_s == pytest.approx(2 * before)
    # A request that ends before it is seen settles nothing; one never seen on a server is
    # a miss after LOOK_AHEAD_REPORTS of its reports. The wait never passes MAX_DELAY_S.
    for _ in range(10):
        gate.arm()
        gate.opened(pairs)
        gate.forget(("B", 4))
        gate.observe("A", {1, 3})
        for _ in range(admission.LOOK_AHEAD_REPORTS):
            gate.observe("B", set())
    assert gate.delay_s == admission.MAX_DELAY_S
    assert gate.counters.admitted == 4 + 10 and gate.counters.misses == 1 + 10


def once(hits: list[FakeRequest], *, after_tokens: int):
    """A fake-server hook that fires once: for sequence 1's request after `after_tokens` tokens."""

    def hook(request: FakeRequest) -> bool:
        if request.key == key(1) and len(request.generated) == after_tokens and not hits:
            hits.append(request)
            return True
        return False

    return hook


async def run_lossless(rig, theta_options: dict):
    """Three sequences of 6 tokens with a base server set up by `theta_options`; asserts that
    they come out exactly as per-token mode gives them and that both servers followed."""
    theta, t = rig.servers(theta=theta_options)
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(3, max_tokens=6)
    outputs = await generate(scheduler, sequences)
    for out in outputs:
        assert out.ok and out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)
    return theta, t, outputs, scheduler


async def test_a_request_the_server_ends_early_is_resubmitted_from_its_agreed_tokens(rig):
    ended: list[FakeRequest] = []

    theta, t, outputs, scheduler = await run_lossless(rig, {"end_when": once(ended, after_tokens=2)})
    assert scheduler.counters.resubmissions >= 1
    first, second = theta.requests_of(key(1))[:2]
    assert first is ended[0] and first.finish == "length"
    assert second.offset == 2 and second.prompt == theta_prompt(1) + outputs[1].generated_tokens[:2]


@pytest.mark.parametrize("after_tokens", [0, 2], ids=["at-submission", "mid-stream"])
async def test_a_request_that_breaks_once_is_resent_from_the_agreed_tokens(rig, after_tokens):
    """A connection the server closes under a request (ServerUnavailableError) costs a resend
    under a new stream id, not the sequence: same tokens as per-token mode, none twice."""
    broken: list[FakeRequest] = []
    theta, _, _, _ = await run_lossless(rig, {"fail_when": once(broken, after_tokens=after_tokens)})
    first, second = theta.requests_of(key(1))
    assert first is broken[0] and second.offset == after_tokens
    assert second.args[wire.ARG_ID] != first.args[wire.ARG_ID]  # a late first request would get END


async def test_sequences_of_a_server_that_restarts_resume_from_their_agreed_tokens(rig):
    theta, t = rig.servers()
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(4, max_tokens=8)
    crash = asyncio.create_task(crash_during(t, after_steps=4, down_s=0.3))
    outputs = await generate(scheduler, sequences)
    await crash

    assert t.health_checks >= 1
    for out in outputs:  # nothing lost, nothing twice, the per-token tokens
        assert out.ok and out.finish_reason == "max_tokens" and len(out.generated_tokens) == 8
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
        # Both servers took it up again from the tokens agreed before the crash.
        for fake in (theta, t):
            resumed = fake.requests_of(key(out.index))[-1]
            assert 0 < resumed.offset < 8 and resumed.finish == "stop"
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)


async def test_sequences_fail_with_the_reason_when_a_server_does_not_come_back(rig):
    theta, t = rig.servers()
    cfg = config(lockstep_restart_timeout=0.3)
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(4, max_tokens=8)
    crash = asyncio.create_task(crash_during(t, after_steps=3, down_s=None))
    outputs = await generate(scheduler, sequences)
    await crash

    for out in outputs:
        assert out.finish_reason == "error"
        assert "t server" in out.error and "lockstep_restart_timeout=0.3" in out.error
    assert theta.idle  # the base's requests were all ended, none left waiting on the coordinator


async def test_a_pause_takes_every_sequence_off_the_servers_and_resumes_it_on_the_new_weights(rig):
    theta, t = rig.servers()
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(4, max_tokens=10)
    theta.hold_after = 4  # the pause comes mid-sequence, however fast the steps run
    scheduler.submit(sequences)
    pushed = FakeModel(99)
    await eventually(theta.holding.is_set, "four base steps")

    async def release_once_taken_off() -> None:  # the pause's drain needs the base's next step
        await eventually(lambda: scheduler.counters.suspensions > 0, "the pause took the sequences off")
        theta.release()

    releasing = asyncio.create_task(release_once_taken_off())
    late = make_sequences(5, max_tokens=10)[4:]  # submitted during the pause
    async with scheduler.paused():
        await releasing
        assert theta.idle and t.idle  # every request ended: a /pause?mode=wait would not wait
        sent = (len(theta.requests), len(t.requests))
        theta.model = pushed  # a weight push
        # Whatever could start a request is asked to (a submission, a settle); a request starts as a
        # task created on the spot, so no new task means nothing started (no waiting needed).
        tasks = asyncio.all_tasks()
        scheduler.submit(late)
        async with scheduler.lock:
            scheduler.settle()
        assert asyncio.all_tasks() == tasks  # nothing started while paused
        assert (len(theta.requests), len(t.requests)) == sent
    outputs = await collect(sequences)
    late_output = await asyncio.wait_for(late[0].sink.get(), OUTPUT_TIMEOUT_S)
    await scheduler.close()
    assert late_output.ok and len(late_output.generated_tokens) == 10  # it ran once the pause ended

    assert scheduler.counters.suspensions == 4
    for out in outputs:
        resumed = theta.requests_of(key(out.index))[-1]
        assert out.ok and len(out.generated_tokens) == 10 and 0 < resumed.offset < 10
        # Tokens before the pause from the old base, after it from the pushed one.
        tokens, logprobs_q = replay(FakeModel(1), t.model, out.index, sequences[0].params, cfg,
                                    theta_from=(resumed.offset, pushed))
        assert out.generated_tokens == tokens
        np.testing.assert_allclose(out.logprobs_q, logprobs_q, rtol=1e-9, atol=1e-12)
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)


async def test_a_request_that_keeps_failing_fails_only_its_sequence(rig):
    theta, t = rig.servers(theta={"fail_when": lambda r: r.key == key(1)})
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(3, max_tokens=6)
    outputs = await generate(scheduler, sequences)

    failed = outputs[1]
    assert failed.finish_reason == "error"
    assert "theta server" in failed.error and "connection reset (simulated)" in failed.error
    assert failed.generated_tokens == []
    for out in (outputs[0], outputs[2]):
        assert out.ok and out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    assert len(theta.requests_of(key(1))) == 1 + MAX_REQUEST_FAILURES  # resent, then given up
    # The teacher's request of that sequence was ended (END), not left running.
    teacher_request = t.requests_of(key(1))[-1]
    assert teacher_request.finish == "stop" and teacher_request.answers[-1][1] == wire.END
    assert_servers_followed(t, outputs, t_prompt)


async def test_a_server_reporting_a_wrong_position_fails_that_sequence_only(rig):
    theta, t = rig.servers(theta={"position_skew": lambda r: 1 if r.key == key(1) and len(r.generated) == 2 else 0})
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(3, max_tokens=6)
    outputs = await generate(scheduler, sequences)

    failed = outputs[1]
    assert failed.finish_reason == "error" and "diverged" in failed.error
    assert "theta server reported position 3" in failed.error
    expected, _ = replay(theta.model, t.model, 1, sequences[1].params, cfg)
    assert failed.generated_tokens == expected[:2]
    for out in (outputs[0], outputs[2]):
        assert out.ok and out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    for fake in (theta, t):
        (request,) = fake.requests_of(key(1))
        assert request.finish == "stop" and request.answers[-1][1] == wire.END
    # The teacher's row of the failed sequence was answered END at once, not parked later.
    assert scheduler.counters.parks == 0 and scheduler.counters.resubmissions == 0
    assert_servers_followed(t, outputs, t_prompt)
    assert_servers_followed(theta, outputs, theta_prompt)


def eos_after(n: int, i: int, prompt_len: int):
    """EOS dominates sequence i's distribution after n generated tokens."""
    return lambda context: context[0] == key(i) and len(context) == prompt_len + n


async def test_eos_ends_the_sequence_and_both_servers_requests_at_that_position(rig):
    theta_model = FakeModel(1, eos_when=eos_after(3, 1, len(theta_prompt(1))))
    t_model = FakeModel(2, eos_when=eos_after(3, 1, len(t_prompt(1))))
    theta, t = rig.servers(theta_model, t_model)
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(3, max_tokens=8)
    outputs = await generate(scheduler, sequences)

    stopped = outputs[1]
    assert stopped.ok and stopped.finish_reason == "eos"
    assert len(stopped.generated_tokens) == 4 and stopped.generated_tokens[-1] == EOS_ID
    assert_per_token_tokens(stopped, theta_model, t_model, sequences[1].params, cfg)
    for out in (outputs[0], outputs[2]):
        assert out.ok and out.finish_reason == "max_tokens" and len(out.generated_tokens) == 8
        assert_per_token_tokens(out, theta_model, t_model, sequences[0].params, cfg)
    for fake, prompt in ((theta, theta_prompt), (t, t_prompt)):
        assert_servers_followed(fake, outputs, prompt)
        for out in outputs:
            (request,) = fake.requests_of(key(out.index))
            last = len(out.generated_tokens) - 1
            # Told END at the deciding position, so the server emitted its stop token there.
            assert request.answers[-1] == (last, wire.END) and request.finish == "stop"
            assert len(request.answers) == last + 1


async def test_the_stop_token_sampled_with_ignore_eos_ends_both_requests_and_the_sequence_goes_on(rig):
    theta_model = FakeModel(1, eos_when=eos_after(2, 0, len(theta_prompt(0))))
    t_model = FakeModel(2, eos_when=eos_after(2, 0, len(t_prompt(0))))
    theta, t = rig.servers(theta_model, t_model)
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(2, max_tokens=6, ignore_eos=True)
    outputs = await generate(scheduler, sequences)

    for out in outputs:
        assert out.ok and out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta_model, t_model, sequences[0].params, cfg)
    assert outputs[0].generated_tokens[2] == EOS_ID  # the premise: EOS at position 2
    for fake, prompt in ((theta, theta_prompt), (t, t_prompt)):
        assert_servers_followed(fake, outputs, prompt)
        first, second = fake.requests_of(key(0))[:2]
        # The server ended its request at the stop token; it was resent after it.
        assert first.finish == "stop" and first.answers[-1] == (2, EOS_ID)
        assert second.offset == 3 and second.finish == "stop"
    assert scheduler.counters.resubmissions >= 2


async def test_close_fails_sequences_in_flight_and_ends_every_server_request(rig):
    theta, t = rig.servers()
    scheduler = rig.scheduler(theta, t, config())
    sequences = make_sequences(3, max_tokens=1000)
    scheduler.submit(sequences)
    await eventually(lambda: theta.steps >= 3 and t.steps >= 3, "three decode steps on each server")
    await asyncio.wait_for(scheduler.close(), OUTPUT_TIMEOUT_S)

    outputs = await collect(sequences)
    for out in outputs:
        assert out.finish_reason == "error" and "closed" in out.error
        assert 0 < len(out.generated_tokens) < 1000
    for fake, prompt in ((theta, theta_prompt), (t, t_prompt)):
        assert_servers_followed(fake, outputs, prompt)
        # Every request was ended by an END answer (none cancelled after the drain timeout,
        # none left waiting for a reply).
        assert [r.finish for r in fake.requests] == ["stop"] * 3
        assert all(r.answers[-1][1] == wire.END for r in fake.requests)
    with pytest.raises(LifecycleError):
        scheduler.submit(make_sequences(1, max_tokens=2))


async def test_close_delivers_sequences_still_waiting_for_a_batch_slot(rig):
    theta, t = rig.servers()
    scheduler = rig.scheduler(theta, t, config(max_batch_size=1))
    sequences = make_sequences(3, max_tokens=1000)
    scheduler.submit(sequences)
    await eventually(lambda: theta.steps >= 2 and t.steps >= 2, "two decode steps on each server")
    await asyncio.wait_for(scheduler.close(), OUTPUT_TIMEOUT_S)

    outputs = await collect(sequences)
    assert all(out.finish_reason == "error" and "closed" in out.error for out in outputs)
    assert [len(out.generated_tokens) > 0 for out in outputs] == [True, False, False]
    assert theta.idle and t.idle and len(theta.requests) == len(t.requests) == 1


async def test_a_stalled_report_is_parked_by_the_watchdog(rig):
    # The teacher holds the sequence back until the base's row of it was parked. The
    # teacher is not waiting on anything, so this is no deadlock: only the stall watchdog
    # can end the base's wait (a server busy with other work looks like this).
    def hold_back_until_parked(server, queued):
        parked = any(r.answers == [(0, wire.END)] and r.finish == "stop" for r in theta.requests)
        return queued if parked else []

    theta, t = rig.servers(t={"admit": hold_back_until_parked})
    cfg = config(lockstep_stall_timeout=0.2)
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(1, max_tokens=4)
    outputs = await generate(scheduler, sequences)

    assert scheduler.counters.parks >= 1 and scheduler.counters.resubmissions >= 1
    (out,) = outputs
    assert out.ok and out.finish_reason == "max_tokens"
    assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)
    # The base's first request was told END at position 0, and the sequence resent from offset 0.
    assert theta.requests[0].answers == [(0, wire.END)] and theta.requests[1].offset == 0


async def test_parks_do_not_count_as_requests_the_server_ended(rig, monkeypatch):
    """A base with room for one running request (its batch busy with other clients' work,
    so the coordinator's capacity does not say so) keeps the teacher's rows of sequence 1
    waiting: they are parked at every step for as long as sequence 0 runs, a legitimate
    park per step, more than MAX_RESUBMISSIONS in all. A single early end by the server
    afterwards must be resubmitted, not taken for a server that keeps ending requests."""
    limit = 4  # MAX_RESUBMISSIONS, lowered so that the test needs a dozen steps, not 70
    monkeypatch.setattr(recovery, "MAX_RESUBMISSIONS", limit)

    def one_running(server, queued):
        return queued[:1] if not server.running else []

    ended: list[FakeRequest] = []

    def end_once(request: FakeRequest) -> bool:
        if request.key == key(1) and len(request.generated) == 2 and not ended:
            ended.append(request)
            return True
        return False

    theta, t = rig.servers(theta={"admit": one_running, "end_when": end_once})
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    long, short = make_sequences(2, max_tokens=limit + 8)
    short.params = SamplingParams(5)
    outputs = await generate(scheduler, [long, short])

    assert scheduler.counters.parks >= limit  # the premise
    assert ended, "the base never ended sequence 1's request on its own"
    assert outputs[1].error is None, outputs[1].error
    for out, seq in zip(outputs, (long, short)):
        assert out.ok and out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta.model, t.model, seq.params, cfg)
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)


async def test_a_known_capacity_keeps_sequences_out_of_a_full_server_queue(rig):
    """The base runs one request at once and says so (capacity 1): the scheduler starts one
    sequence at a time, so no row waits on a request queued behind a full batch."""
    def one_running(server, queued):
        return queued[:1] if not server.running else []

    theta, t = rig.servers(theta={"admit": one_running, "capacity": 1})
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg, capacity=1)
    sequences = make_sequences(3, max_tokens=4)
    outputs = await generate(scheduler, sequences)

    assert scheduler.counters.parks == 0 and scheduler.counters.resubmissions == 0
    for out in outputs:
        assert out.ok and out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    assert max(len(r.answers) for r in t.requests) == 4 and len(t.requests) == 3
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)


async def test_a_plugin_that_gave_up_waiting_is_resubmitted_not_taken_for_divergence(rig):
    """The plugin's reply timeout (DUALVLLM_LOCKSTEP_TIMEOUT_S) ends its rows and drops its
    connection, so its next report comes from a new peer identity; the rows it gave up on are
    still registered here. The ended requests must be resubmitted and finish normally."""
    def admit_after_theta_resubmitted(server, queued):
        return queued if theta.steps >= 2 else []

    # The base's first report gives up after 0.3 s (it can never be answered: the teacher
    # holds everything back, and this is no deadlock); later ones wait as long as needed.
    def timeout_first_report_only(server):
        return 0.3 if server.timeouts == 0 else 20.0

    theta, t = rig.servers(theta={"reply_timeout_s": timeout_first_report_only},
                           t={"admit": admit_after_theta_resubmitted})
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(2, max_tokens=4)
    outputs = await generate(scheduler, sequences)

    assert theta.timeouts == 1  # the premise
    for out in outputs:
        assert out.error is None, out.error
        assert out.finish_reason == "max_tokens"
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
    assert_servers_followed(theta, outputs, theta_prompt)
    assert_servers_followed(t, outputs, t_prompt)


def cancel(sequences: list[SequenceState]) -> None:
    """What DualVLLMCoordinator.stream does when its caller is cancelled."""
    for seq in sequences:
        seq.cancelled = True


async def cancel_while_waiting_to_start(scheduler, theta, t, sequences):
    cancel(sequences)


async def cancel_mid_step(scheduler, theta, t, sequences):
    await eventually(lambda: theta.steps >= 3 and t.steps >= 3, "three decode steps on each server")
    cancel(sequences)


async def cancel_while_the_gate_holds(scheduler, theta, t, sequences):
    await eventually(lambda: scheduler.gate.counters.rounds >= 1 and scheduler._admission.held_rounds > 0,
                     "a gate waiting for the servers to take its requests in")
    cancel(sequences)


async def cancel_while_paused(scheduler, theta, t, sequences):
    await eventually(lambda: theta.steps >= 2, "two base steps")
    async with scheduler.paused():
        cancel(sequences)


# (interleaving, how long each fake front end takes to take a request in): the gate's
# wait for the servers lasts that long, so that interleaving gets a window polls cannot miss.
INTERLEAVINGS = [(cancel_while_waiting_to_start, 0.002), (cancel_mid_step, 0.002), (cancel_while_the_gate_holds, 0.2),
                 (cancel_while_paused, 0.002)]


@pytest.mark.parametrize("when, accept_delay_s", INTERLEAVINGS,
                         ids=[when.__name__.removeprefix("cancel_") for when, _ in INTERLEAVINGS])
async def test_a_call_cancelled_at_any_point_leaves_the_scheduler_serving_the_next(rig, when, accept_delay_s):
    """Issue 23's suspects, ruled out: sequences cancelled by their caller wherever they are
    (waiting to start, rows in flight, behind the admission gate, taken off by a pause)
    free their slots; a later call completes with the per-token tokens, close returns,
    and every server request was answered (none timed out, none left running)."""
    theta, t = rig.servers(theta={"accept_delay_s": accept_delay_s}, t={"accept_delay_s": accept_delay_s})
    cfg = config(max_batch_size=4)
    scheduler = rig.scheduler(theta, t, cfg, capacity=4)
    cancelled = make_sequences(6, max_tokens=1000)
    scheduler.submit(cancelled)
    await when(scheduler, theta, t, cancelled)

    following = make_sequences(6, max_tokens=5)
    scheduler.submit(following)
    outputs = await collect(following)
    await asyncio.wait_for(scheduler.close(), OUTPUT_TIMEOUT_S)

    for out in outputs:
        assert out.ok and out.finish_reason == "max_tokens", out.error
        assert_per_token_tokens(out, theta.model, t.model, following[0].params, cfg)
    for fake in (theta, t):
        assert fake.idle and fake.timeouts == 0, fake.name
        assert all(r.finish == "stop" for r in fake.requests[:len(fake.requests) - 6]), fake.name


async def test_record_topk_keeps_both_servers_reported_best_entries(rig):
    theta, t = rig.servers()
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(2, max_tokens=5, record_topk=3)
    outputs = await generate(scheduler, sequences)

    for out in outputs:
        assert out.topk_ids.shape == (5, 2, 3)
        for position in range(5):
            for model, (fake, prompt) in enumerate(((theta, theta_prompt), (t, t_prompt))):
                ids, logprobs = fake.model.topk(prompt(out.index) + out.generated_tokens[:position], 3)
                assert out.topk_ids[position, model].tolist() == ids.tolist()
                np.testing.assert_allclose(out.topk_logprobs[position, model], logprobs, rtol=1e-6)


async def test_a_pause_cancelled_during_its_drain_does_not_hold_generation_forever(rig):
    """The teacher holds its requests back, so the pause's drain waits (up to DRAIN_S) when its
    caller is cancelled (Ctrl-C during a weight push): the pause must be undone, not left
    counted, or nothing would start again."""
    holding = {"on": True}
    theta, t = rig.servers(t={"admit": lambda server, queued: [] if holding["on"] else queued})
    cfg = config()
    scheduler = rig.scheduler(theta, t, cfg)
    scheduler.submit(make_sequences(2, max_tokens=5))
    await eventually(lambda: len(t.queue) == 2, "the teacher holding both requests back")

    async def push():
        async with scheduler.paused():
            raise AssertionError("the drain cannot end while the teacher holds its requests")
    pausing = asyncio.create_task(push())
    await eventually(lambda: scheduler._recovery.pauses == 1, "the pause")
    pausing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pausing
    holding["on"] = False
    following = make_sequences(2, max_tokens=5)
    outputs = await generate(scheduler, following)
    assert scheduler._recovery.pauses == 0 and all(out.ok for out in outputs)


async def test_steps_split_among_threads_give_the_per_token_steps_tokens(rig, monkeypatch):
    """CoordinatorConfig.step_threads: every step's rows on numba's threads, the same tokens."""
    from dualvllm.coordinator import kernel

    monkeypatch.setattr(kernel, "THREADED_MIN_ROWS", 1)  # these steps are small: thread them anyway
    # Compiled here, as DualVLLMCoordinator does at start, not inside the outputs' wait: on a
    # fresh clone under load the threaded step's first compile took longer than that wait.
    kernel.warm_up(threads=2)
    theta, t = rig.servers()
    cfg = config(step_threads=2)
    scheduler = rig.scheduler(theta, t, cfg)
    sequences = make_sequences(8, max_tokens=5)
    outputs = await generate(scheduler, sequences)
    for out in outputs:
        assert out.ok and len(out.generated_tokens) == 5
        assert_per_token_tokens(out, theta.model, t.model, sequences[0].params, cfg)
