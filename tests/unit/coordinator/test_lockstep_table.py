"""The lockstep table (coordinator/lockstep/table.py), driven synchronously: no zmq, no servers,
no clock, no event loop. Each test feeds reports in and reads what the table decided."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.coordinator.lockstep import waits
from dualvllm.coordinator.lockstep.rows import Rows
from dualvllm.coordinator.lockstep.table import THETA, T, UNSET, Live, LockstepTable, gather
from dualvllm.coordinator.sequence import SequenceState
from dualvllm.engines.protocol import PAD_TOKEN_ID
from dualvllm.engines.vllm_plugin import wire

K = 2  # top-k width of the synthetic rows


@dataclass(frozen=True)
class Server:
    name: str
    url: str


BASE, TEACHER = Server("theta", "http://base"), Server("t", "http://teacher")


def sequence(i: int, max_tokens: int = 8) -> SequenceState:
    return SequenceState(index=i, prompt="", theta_prompt_ids=[1], t_prompt_ids=[1],
                         params=SamplingParams(max_tokens), rng=np.random.default_rng(i), sink=None)  # type: ignore[arg-type]


class Rig:
    """A table with `n` sequences started on one server per role, stream ids 100 + 2i (+1 for the teacher)."""

    def __init__(self, n: int, servers: tuple[tuple[Server, Server], ...] = ((BASE, TEACHER),)) -> None:
        self.table = LockstepTable()
        self.lives: list[Live] = []
        for i in range(n):
            live = Live(sequence(i), engines=list(servers[i % len(servers)]))
            self.table.add(live)
            for role in (THETA, T):
                self.table.open_stream(live, role, self.stream_id(i, role), offset=0)
            self.lives.append(live)

    @staticmethod
    def stream_id(i: int, role: int) -> int:
        return 100 + 2 * i + role

    def report(self, server: bytes, role: int, rows: list[tuple[int, int]], now: float = 0.0, flags: int = 0):
        """`server` reports rows (sequence, position) of `role`'s streams."""
        ids = np.array([self.stream_id(i, role) for i, _ in rows], dtype=np.int64)
        return self.report_ids(server, ids, np.array([p for _, p in rows], dtype=np.int64), now, flags)

    def report_ids(self, server: bytes, ids: np.ndarray, positions: np.ndarray, now: float = 0.0, flags: int = 0):
        n = len(ids)
        report = wire.Report(step=7, flags=flags, capacity=64, ids=ids, positions=positions,
                             token_ids=np.tile(np.arange(K, dtype=np.int32), (n, 1)),
                             logprobs=np.full((n, K), np.log(0.5), dtype=np.float32))
        return self.table.report(server, report, now)

    def decide(self, ready: list[Live], token: int = 5) -> None:
        """Record `token` for each ready sequence, as the shell's step would, and answer it."""
        for live in ready:
            live.seq.append(token, 0.5, -1.0, -1.0, -1.0, {}, frozenset({0}), 4096)
        self.table.decided(ready, [token] * len(ready))


def test_a_row_waits_for_the_other_role_and_both_get_the_token():
    rig = Rig(2)
    blocked, ready = rig.report(b"theta", THETA, [(0, 0), (1, 0)])
    assert ready == [] and list(blocked.answers) == [UNSET, UNSET] and rig.table.replies(1.0) == []
    _, ready = rig.report(b"t", T, [(1, 0), (0, 0)])
    assert ready == [rig.lives[1], rig.lives[0]]  # in the order the second report pairs them
    rig.decide(ready, token=5)
    replies = {identity: answers.tolist() for identity, _, answers in rig.table.replies(1.0)}
    assert replies == {b"theta": [5, 5], b"t": [5, 5]}
    assert rig.table.blocked == {} and rig.table.counters.replies == 2


def test_one_decision_over_two_pairs_of_replicas_answers_each_row_in_its_own_report():
    other_base, other_teacher = Server("theta1", "http://base1"), Server("t1", "http://teacher1")
    rig = Rig(4, servers=((BASE, TEACHER), (other_base, other_teacher)))  # 0, 2 on the first pair; 1, 3 on the second
    rig.report(b"theta", THETA, [(2, 0), (0, 0)])
    rig.report(b"theta1", THETA, [(1, 0), (3, 0)])
    _, first = rig.report(b"t", T, [(0, 0), (2, 0)])
    _, second = rig.report(b"t1", T, [(3, 0), (1, 0)])
    ready = [first[0], second[0], first[1], second[1]]  # the pairs alternate: four runs of one row
    for live, token in zip(ready, (10, 13, 12, 11)):
        live.seq.append(token, 0.5, -1.0, -1.0, -1.0, {}, frozenset({0}), 4096)
    rig.table.decided(ready, [10, 13, 12, 11])  # sequence i gets token 10 + i
    replies = {identity: answers.tolist() for identity, _, answers in rig.table.replies(1.0)}
    assert replies == {b"theta": [12, 10], b"theta1": [11, 13], b"t": [10, 12], b"t1": [13, 11]}
    assert rig.table.counters.split_reports == 0  # each report was paired with one other


def test_a_report_is_answered_only_once_all_its_rows_are_decided():
    rig = Rig(2)
    rig.report(b"theta", THETA, [(0, 0), (1, 0)])
    _, ready = rig.report(b"t", T, [(0, 0)])  # the teacher has not admitted sequence 1 yet
    rig.decide(ready)
    assert [identity for identity, _, _ in rig.table.replies(1.0)] == [b"t"]
    _, ready = rig.report(b"t", T, [(0, 1), (1, 0)])
    assert ready == [rig.lives[1]]  # sequence 0's next row waits for the base's next step
    rig.decide(ready)
    assert [identity for identity, _, _ in rig.table.replies(2.0)] == [b"theta"]
    assert rig.table.counters.split_reports == 1  # the base's report was paired over two teacher steps


def test_a_preempted_request_come_back_gets_the_agreed_tokens_without_waiting():
    rig = Rig(1)
    rig.report(b"theta", THETA, [(0, 0)])
    rig.decide(rig.report(b"t", T, [(0, 0)])[1], token=9)
    rig.table.replies(1.0)
    blocked, ready = rig.report(b"theta", THETA, [(0, 0)])  # position 0 again: recomputed after preemption
    assert ready == [] and blocked.answers.tolist() == [9]


def test_a_row_past_the_agreed_tokens_fails_its_sequence_only():
    rig = Rig(2)
    blocked, ready = rig.report(b"theta", THETA, [(0, 3), (1, 0)])
    assert blocked.answers.tolist() == [wire.END, UNSET]
    assert rig.lives[0].done and "diverged" in (rig.lives[0].seq.error or "")
    assert rig.table.out.finished == [rig.lives[0].seq] and not rig.lives[1].done
    assert len(rig.table) == 1 and rig.table.loads[BASE.url] == 1


def test_a_second_row_of_a_waiting_stream_is_a_divergence():
    rig = Rig(1)
    rig.report(b"theta", THETA, [(0, 0)])
    blocked, _ = rig.report(b"theta-other-socket", THETA, [(0, 0)])
    assert blocked.answers.tolist() == [wire.END] and rig.lives[0].done


def test_a_finishing_token_answers_end_and_hands_the_sequence_over():
    rig = Rig(1)
    rig.report(b"theta", THETA, [(0, 0)])
    _, ready = rig.report(b"t", T, [(0, 0)])
    rig.decide(ready, token=0)  # EOS
    assert {identity: answers.tolist() for identity, _, answers in rig.table.replies(1.0)} == {
        b"theta": [wire.END], b"t": [wire.END]}
    assert rig.table.out.finished == [rig.lives[0].seq] and rig.lives[0].seq.finish_reason == "eos"
    assert len(rig.table) == 0 and rig.table.loads[BASE.url] == 0 and rig.table.loads[TEACHER.url] == 0


def test_rows_of_unknown_ids_get_end_and_are_handed_out_for_the_probes():
    rig = Rig(1)
    blocked, _ = rig.report_ids(b"theta", np.array([424242]), np.array([0]))
    assert blocked.answers.tolist() == [wire.END] and blocked.server is None
    assert [stream_id for stream_id, _ in rig.table.out.unknown] == [424242]
    assert [identity for identity, _, _ in rig.table.replies(0.0)] == [b"theta"]


def test_a_cancelled_sequence_gets_end_at_its_next_row():
    rig = Rig(1)
    rig.lives[0].seq.cancelled = True
    blocked, _ = rig.report(b"theta", THETA, [(0, 0)])
    assert blocked.answers.tolist() == [wire.END] and rig.lives[0].seq.error == "cancelled by the caller"


def test_crossed_admission_is_a_deadlock_and_the_smaller_report_is_parked():
    """The base admitted sequences 0 and 1, the teacher 2 only: neither can be answered."""
    rig = Rig(3)
    rig.report(b"theta", THETA, [(0, 0), (1, 0)])
    rig.report(b"t", T, [(2, 0)])
    assert waits.deadlocked(rig.table) == {BASE.url, TEACHER.url}
    assert waits.break_deadlock(rig.table)
    assert rig.table.out.resubmit == [(rig.lives[2], T)]  # the teacher's one row, not the base's two
    assert rig.lives[2].streams[T] is not None and rig.lives[2].streams[T].retired
    assert rig.table.counters.parks == 1
    assert [identity for identity, _, answers in rig.table.replies(1.0)] == [b"t"]
    assert waits.deadlocked(rig.table) == set()  # the teacher runs again: not stuck


def test_a_server_that_has_not_reported_is_not_deadlocked():
    rig = Rig(2)
    rig.report(b"theta", THETA, [(0, 0), (1, 0)])  # the teacher is still decoding its step
    assert waits.deadlocked(rig.table) == set() and not waits.break_deadlock(rig.table)


def test_only_the_deadlocked_pair_of_replicas_is_stuck():
    other_base, other_teacher = Server("theta1", "http://base1"), Server("t1", "http://teacher1")
    rig = Rig(4, servers=((BASE, TEACHER), (other_base, other_teacher)))  # 0, 2 on the first pair; 1, 3 on the second
    rig.report(b"theta1", THETA, [(1, 0)])
    rig.report(b"t1", T, [(3, 0)])
    rig.report(b"theta", THETA, [(0, 0), (2, 0)])  # the first pair's teacher is still decoding
    assert waits.deadlocked(rig.table) == {other_base.url, other_teacher.url}


def test_a_report_waiting_past_the_stall_limit_is_parked():
    rig = Rig(2)
    rig.report(b"theta", THETA, [(0, 0), (1, 0)], now=10.0)
    _, ready = rig.report(b"t", T, [(0, 0)], now=10.5)
    rig.decide(ready)
    assert waits.park_stalled(rig.table, now=11.0, limit_s=2.0) == []
    assert waits.park_stalled(rig.table, now=12.5, limit_s=2.0) == [2.5]
    assert rig.table.out.resubmit == [(rig.lives[1], THETA)]
    assert rig.table.replies(12.5)[0][2].tolist() == [5, wire.END]


def test_a_stream_that_ended_on_its_own_drops_its_waiting_row():
    rig = Rig(1)
    blocked, _ = rig.report(b"theta", THETA, [(0, 0)])
    stream = rig.lives[0].streams[THETA]
    assert rig.table.stream_ended(stream)  # the sequence must go on
    assert blocked.answers.tolist() == [wire.END] and rig.lives[0].rows[THETA] is None
    assert not rig.table.stream_ended(stream)  # retired now: a second end is expected


def test_a_new_report_on_the_same_socket_replaces_the_stale_one():
    """A plugin that timed out waiting ended its rows itself; its next report must not pair with them."""
    rig = Rig(1)
    rig.report(b"theta", THETA, [(0, 0)])
    _, ready = rig.report(b"theta", THETA, [(0, 0)])
    assert ready == [] and rig.lives[0].rows[THETA] is not None and not rig.lives[0].done
    assert len(rig.table.blocked) == 1


def test_a_sequence_taken_off_ends_its_rows_and_leaves_the_loads():
    rig = Rig(2)
    rig.report(b"theta", THETA, [(0, 0), (1, 0)])
    retired = rig.table.take_off(rig.lives[0])
    assert [s.id for s in retired] == [Rig.stream_id(0, THETA), Rig.stream_id(0, T)] and all(s.retired for s in retired)
    assert rig.table.loads[BASE.url] == 1 and rig.table.live == [rig.lives[1]]
    assert rig.table.blocked[b"theta"].answers.tolist() == [wire.END, UNSET]
    assert rig.table.counters.suspensions == 1


def test_a_sequence_whose_stop_strings_are_checked_waits_and_is_no_deadlock():
    rig = Rig(2)
    rig.table.hold([rig.lives[0]])
    rig.report(b"theta", THETA, [(0, 0), (1, 0)])
    _, ready = rig.report(b"t", T, [(0, 0), (1, 0)])
    assert ready == [rig.lives[1]]  # both rows of sequence 0 are in, but it waits for its check
    rig.decide(ready)
    assert waits.deadlocked(rig.table) == set()  # the check will decide it, not a server
    assert rig.table.release([rig.lives[0]]) == [rig.lives[0]]


def test_a_checked_sequence_that_reached_its_stop_string_finishes_on_release():
    rig = Rig(1)
    rig.table.hold(rig.lives)
    rig.report(b"theta", THETA, [(0, 0)])
    rig.lives[0].seq.finish_reason = "stop_string"
    assert rig.table.release(rig.lives) == []
    assert rig.lives[0].done and rig.table.out.finished == [rig.lives[0].seq]
    assert rig.table.blocked[b"theta"].answers.tolist() == [wire.END]


def test_gather_takes_each_row_from_its_own_report_and_pads_the_narrower_ones():
    rig = Rig(3)
    table = rig.table

    def report(server: bytes, role: int, rows: list[tuple[int, int]], width: int, first_id: int):
        n = len(rows)
        ids = np.array([rig.stream_id(i, role) for i, _ in rows], dtype=np.int64)
        token_ids = (first_id + np.arange(n * width, dtype=np.int32)).reshape(n, width)
        return table.report(server, wire.Report(
            step=1, flags=0, capacity=64, ids=ids, positions=np.array([p for _, p in rows], dtype=np.int64),
            token_ids=token_ids, logprobs=np.log(np.full((n, width), 0.1, dtype=np.float32))), 0.0)

    # The base reports sequences 2 and 0 in one step, then 1 in its next (it ran ahead on them).
    report(b"theta-a", THETA, [(2, 0), (0, 0)], width=3, first_id=100)
    report(b"theta-b", THETA, [(1, 0)], width=2, first_id=200)
    _, ready = report(b"t", T, [(0, 0), (1, 0), (2, 0)], width=3, first_id=300)
    assert ready == rig.lives  # in the teacher's order: 0, 1, 2
    theta = gather(ready, THETA)
    assert theta.token_ids.tolist() == [[103, 104, 105], [200, 201, PAD_TOKEN_ID], [100, 101, 102]]
    assert np.isneginf(theta.logprobs[1, 2]) and np.allclose(theta.logprobs[[0, 2]], np.log(0.1))
    teacher = gather(ready, T)  # one report, every row in order: taken whole
    assert teacher.token_ids.tolist() == [[300, 301, 302], [303, 304, 305], [306, 307, 308]]


def run_steps(rig: Rig, steps: int, t_order: list[int]) -> list[list[int]]:
    """`steps` decode steps of every sequence (the teacher reporting in `t_order`) -> each step's replies."""
    n = len(rig.lives)
    out = []
    for position in range(steps):
        rig.report(b"theta", THETA, [(i, position) for i in range(n)])
        _, ready = rig.report(b"t", T, [(i, position) for i in t_order])
        rig.decide(ready, token=5 + position)
        out.append(sorted((identity, answers.tolist()) for identity, _, answers in rig.table.replies(1.0)))
    return out


def test_a_steady_batch_is_taken_in_whole_with_the_same_outcome_as_row_by_row(monkeypatch):
    whole = Rig(6)
    replies = run_steps(whole, 3, t_order=[5, 3, 1, 0, 2, 4])
    assert whole.table.counters.regular_reports == whole.table.counters.reports == 6
    monkeypatch.setattr(Rows, "take_regular", lambda self, blocked: None)
    by_rows = Rig(6)
    assert run_steps(by_rows, 3, t_order=[5, 3, 1, 0, 2, 4]) == replies
    assert by_rows.table.counters.regular_reports == 0
    for live in whole.lives:  # the arrays' agreed lengths follow the sequences
        assert whole.table.rows._agreed[live.slot] == len(live.seq.tokens) == 3


def test_one_irregular_row_sends_its_report_row_by_row_and_fails_only_its_sequence():
    rig = Rig(3)
    rig.report(b"theta", THETA, [(0, 0), (1, 0), (2, 0)])
    _, ready = rig.report(b"t", T, [(0, 0), (1, 5), (2, 0)])  # sequence 1's teacher is ahead: diverged
    assert rig.table.counters.regular_reports == 1  # only the first report went in whole
    assert ready == [rig.lives[0], rig.lives[2]]
    assert rig.lives[1].done and "diverged" in rig.lives[1].seq.error
    rig.decide(ready)
    replies = {identity: answers.tolist() for identity, _, answers in rig.table.replies(1.0)}
    assert replies == {b"theta": [5, wire.END, 5], b"t": [5, wire.END, 5]}


def test_a_stream_twice_in_one_report_is_not_taken_in_whole():
    rig = Rig(2)
    _, ready = rig.report_ids(b"theta", np.array([100, 100]), np.array([0, 0]))
    assert ready == [] and rig.table.counters.regular_reports == 0
    assert rig.lives[0].done and "diverged" in rig.lives[0].seq.error  # the second row is a divergence


def test_still_ready_drops_sequences_whose_row_a_later_report_of_the_batch_replaced():
    rig = Rig(2)
    rig.report(b"theta", THETA, [(0, 0), (1, 0)])
    _, ready = rig.report(b"t", T, [(0, 0), (1, 0)])
    assert ready == rig.lives
    rig.report(b"theta", THETA, [(0, 0)])  # the plugin gave up and reported again, with sequence 0 only
    assert rig.table.rows.still_ready(ready) == [rig.lives[0]]
    rig.table.fail(rig.lives[0], "gone")
    assert rig.table.rows.still_ready(ready) == []


def test_a_shared_base_waiting_on_a_teacher_that_waits_elsewhere_is_parked_within_a_few_steps():
    """Servers shared with another coordinator (wire.FLAG_SHARED): the base's report is parked
    after the shared limit, the teacher's only after the full one, so the two coordinators of
    a deadlock across them do not both park (waits.py)."""
    rig = Rig(2)
    rig.report(b"theta", THETA, [(0, 0)], now=10.0, flags=wire.FLAG_SHARED)
    rig.report(b"t", T, [(1, 0)], now=10.0, flags=wire.FLAG_SHARED)  # blocked here: the base's row needs it
    assert waits.park_stalled(rig.table, now=10.5, limit_s=5.0, shared_limit_s=0.1) == []
    rig.table.park(rig.table.blocked[b"t"])  # the teacher no longer waits here: it waits elsewhere
    rig.table.replies(10.5)
    assert waits.any_shared(rig.table)
    assert waits.park_stalled(rig.table, now=10.5, limit_s=5.0, shared_limit_s=None) == []
    assert waits.park_stalled(rig.table, now=10.5, limit_s=5.0, shared_limit_s=0.1) == [0.5]
    assert rig.table.out.resubmit[-1] == (rig.lives[0], THETA)


def test_a_shared_teacher_and_an_unshared_base_wait_the_full_limit():
    for server, role, flags in ((b"t", T, wire.FLAG_SHARED), (b"theta", THETA, 0)):
        rig = Rig(1)
        rig.report(server, role, [(0, 0)], now=10.0, flags=flags)
        assert waits.park_stalled(rig.table, now=12.0, limit_s=5.0, shared_limit_s=0.1) == []
        assert waits.park_stalled(rig.table, now=15.5, limit_s=5.0, shared_limit_s=0.1) == [5.5]


def test_the_shared_limit_is_a_few_of_the_servers_recent_steps():
    rig = Rig(1)
    assert waits.shared_stall_limit(rig.table, limit_s=5.0) == 5.0  # no step seen yet: the full limit
    now = 100.0
    for step_s in (0.01, 0.03, 0.02):  # a reply, then the server's next report
        rig.report(b"theta", THETA, [], now=now)
        rig.table.replies(now)
        now += step_s
    rig.report(b"theta", THETA, [], now=now)
    assert list(rig.table.server_steps_s) == pytest.approx([0.02, 0.03, 0.01])
    assert waits.shared_stall_limit(rig.table, limit_s=5.0) == pytest.approx(waits.SHARED_STALL_STEPS * 0.02)
    assert waits.shared_stall_limit(rig.table, limit_s=0.05) == 0.05


def test_the_gate_lets_go_of_a_decided_shared_base_that_its_partner_does_not_reach():
    rig = Rig(1)
    rig.report(b"theta", THETA, [(0, 0)], now=10.0, flags=wire.FLAG_SHARED)
    _, ready = rig.report(b"t", T, [(0, 0)], now=10.0, flags=wire.FLAG_SHARED)
    rig.decide(ready)
    assert waits.held_too_long(rig.table, now=11.0, limit_s=0.1) == []  # the teacher waits here too
    rig.table.replies(11.0, only=[b"t"])
    assert waits.held_too_long(rig.table, now=10.05, limit_s=0.1) == []
    assert waits.held_too_long(rig.table, now=11.0, limit_s=0.1) == [b"theta"]
