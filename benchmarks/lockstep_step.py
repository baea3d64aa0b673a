"""The coordinator's work for one lockstep step, driven synchronously: no sockets, no event loop.

    python benchmarks/lockstep_step.py                   # batch 1, 64, 256; top-20 rows
    python benchmarks/lockstep_step.py --batch 256 --steps 200 --repeats 7
    python benchmarks/lockstep_step.py --paths --batch 64 256   # the table's compiled pass against row by row

Per step, as the lockstep scheduler does it: both servers' reports into the table
(`LockstepTable.report`), the ready rows gathered (`gather`), merged, alpha* solved and sampled
(`sample_rows`, the compiled kernel), the records (`record_rows`), the answers (`decided`) and
the replies (`replies`). The rows are the synthetic top-20 rows of coordinator_capacity.py.
What this leaves out, and coordinator_capacity.py includes: zmq, the event loop, starting
and finishing sequences. Reported: thread CPU per step and per token, the best of
`--repeats` runs (the machines are shared: the best run is the least disturbed one).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from dualvllm.coordinator.config import CoordinatorConfig
from dualvllm.coordinator.lockstep.rows import Rows
from dualvllm.coordinator.lockstep.table import THETA, T, Live, LockstepTable, gather
from dualvllm.coordinator.scheduler import record_rows, sample_rows
from dualvllm.coordinator.sequence import SamplingParams, SequenceState
from dualvllm.engines.vllm_plugin import wire

VOCAB = 4096
ROWS = 997  # distinct synthetic top-k rows per role


@dataclass(frozen=True)
class Server:
    name: str
    url: str


def synthetic_rows(seed: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """ROWS top-k rows (int32 ids, float32 logprobs, best first) of distributions over VOCAB ids."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(np.arange(1, VOCAB), size=top_k, replace=False) for _ in range(ROWS)])
    logits = np.sort(rng.normal(scale=2.0, size=(ROWS, top_k)), axis=1)[:, ::-1]
    logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True) - 0.05
    return ids.astype(np.int32), logprobs.astype(np.float32)


PHASES = ("reports", "gather", "kernel", "records", "answers")


def measure(batch: int, steps: int, top_k: int) -> dict[str, float]:
    """Thread CPU seconds per step over `steps` steps of `batch` sequences, by phase: the reports
    into the table, the rows gathered, the compiled step, the records, the answers and replies."""
    config = CoordinatorConfig(top_k=top_k, max_batch_size=batch)
    table = LockstepTable()
    servers = [Server("theta", "http://base"), Server("t", "http://teacher")]
    params = SamplingParams(steps + 1, ignore_eos=True)
    for i in range(batch):
        seq = SequenceState(index=i, prompt="", theta_prompt_ids=[1] * 16, t_prompt_ids=[1] * 16, params=params,
                            rng=np.random.default_rng(i), sink=None)  # type: ignore[arg-type]
        live = Live(seq, engines=list(servers))
        table.add(live)
        for role in (THETA, T):
            table.open_stream(live, role, 2 * i + role, offset=0)
    rows = [synthetic_rows(1, top_k), synthetic_rows(2, top_k)]
    ids = [2 * np.arange(batch) + role for role in (THETA, T)]
    phases = dict.fromkeys(PHASES, 0.0)
    for step in range(steps):
        pick = (np.arange(batch) + step) % ROWS
        reports = [wire.Report(step=step, flags=0, capacity=batch, ids=ids[role],
                               positions=np.full(batch, step, np.int64), token_ids=rows[role][0][pick],
                               logprobs=rows[role][1][pick]) for role in (THETA, T)]
        clock = [time.thread_time()]

        def lap(phase: str) -> None:
            clock.append(time.thread_time())
            phases[phase] += clock[-1] - clock[-2]

        ready = [live for role in (THETA, T) for live in table.report(b"%d" % role, reports[role], 0.0)[1]]
        lap("reports")
        theta, t = gather(ready, THETA), gather(ready, T)
        sequences = [live.seq for live in ready]
        lap("gather")
        result = sample_rows(sequences, theta, t, config, VOCAB)
        lap("kernel")
        record_rows(sequences, result, frozenset({0}), 10**6, theta, t)
        lap("records")
        table.decided(ready, result.token_ids.tolist())
        replies = table.replies(0.0)
        lap("answers")
        assert len(ready) == batch and len(replies) == 2, "every row is decided and both reports answered"
    return {phase: seconds / steps for phase, seconds in phases.items()}


def compare_paths(batches: list[int], steps: int, repeats: int, top_k: int) -> None:
    """The `reports` phase with the compiled pass and with the rules row by row, alternated run by
    run in one process (the machines are shared: runs side by side compare, runs apart do not)."""
    compiled = Rows.take_regular
    for batch in batches:
        measure(batch, 5, top_k)  # warm-up
        best: dict[str, dict[str, float]] = {}
        for _ in range(repeats):
            for path, regular in (("compiled pass", compiled), ("row by row", lambda self, blocked: None)):
                Rows.take_regular = regular  # type: ignore[method-assign]
                try:
                    phases = measure(batch, steps, top_k)
                finally:
                    Rows.take_regular = compiled  # type: ignore[method-assign]
                kept = best.setdefault(path, phases)
                best[path] = {phase: min(kept[phase], phases[phase]) for phase in PHASES}
        for path, phases in best.items():
            print(f"batch {batch:>5}, {path:>13}: " + ", ".join(f"{phase} {1e6 * seconds / batch:.2f}"
                                                              for phase, seconds in phases.items())
                  + " µs per token (best of each phase)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5, help="runs per batch size; the best is reported")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--paths", action="store_true",
                        help="compare, in this one process, the table's compiled pass over a regular report with "
                             "its rules row by row (LockstepTable._report_rows, forced), runs alternated")
    args = parser.parse_args()
    if args.paths:
        compare_paths(args.batch, args.steps, args.repeats, args.top_k)
        return
    for batch in args.batch:
        measure(batch, 5, args.top_k)  # warm-up: the compiled kernel's load, caches
        best = min((measure(batch, args.steps, args.top_k) for _ in range(args.repeats)),
                   key=lambda phases: sum(phases.values()))
        total = sum(best.values())
        print(f"batch {batch:>5}: {1e6 * total:9.1f} µs per step, {1e6 * total / batch:7.2f} µs per token ("
              + ", ".join(f"{phase} {1e6 * seconds / batch:.2f}" for phase, seconds in best.items()) + ")", flush=True)


if __name__ == "__main__":
    main()
