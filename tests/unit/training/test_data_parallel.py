"""Several learner processes (training/data_parallel.py): the update of two CPU ranks over gloo is
the update of one process, and a rank 0 that fails stops the other rank instead of hanging it.

The ranks are real processes (spawned, rendezvous over TCP on localhost, as `accelerate launch
--num_processes 2` starts them); every one is joined within a bound and killed on every path.
"""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dualvllm.common.errors import InvalidInputError  # noqa: E402
from dualvllm.training.data_parallel import DataParallel, Ranks, RankStoppedError, Stop, Update  # noqa: E402
from dualvllm.training.learner import Learner, Objective  # noqa: E402
from dualvllm.training.rollouts import ScoredBatch  # noqa: E402
from tests.unit.training.test_memory import PAD, rollouts, tiny_model  # noqa: E402

WORLD = 2
# Both ranks' work here takes a few seconds; the bound is for a hang, with room for a loaded CI machine.
JOIN_S = 120.0


def _one_rollout() -> ScoredBatch:
    """One rollout alone: with two ranks, rank 1 has no micro-batch and still joins every collective."""
    batch = rollouts()
    return ScoredBatch(groups=((batch.groups[0][0],),), policy_version=0, data_position=0, sample_seconds=1.0, tokens=0)


# name -> (objective, kl_coef, micro_batch_size, batch): 6 rollouts in micro-batches of 2 are 3 micro-batches,
# 2 on rank 0 and 1 on rank 1; of 4, one of 4 rows and one of 2.
CASES: dict[str, tuple[Objective, float, int | None, Callable[[], ScoredBatch]]] = {
    "grpo-sequence-kl-uneven": (Objective(correction="sequence"), 0.1, 2, rollouts),
    "grpo-sequence-rows-4-2": (Objective(correction="sequence"), 0.0, 4, rollouts),
    "grpo-sequence-whole-batch": (Objective(correction="sequence"), 0.0, None, rollouts),
    "distill-uneven": (Objective(method="distill", distill_coef=1.0), 0.0, 2, rollouts),
    "distill-one-rank-idle": (Objective(method="distill", distill_coef=1.0), 0.0, None, _one_rollout),
}
# Measured against one process on one thread (as each rank runs): the ranks' summed gradient differs
# from one process's by at most 2.7e-7 of a tensor's largest entry, and the weights after one AdamW
# step at lr 1e-3 by at most 1.6e-7 (0 exactly in 3 of the 5 cases: only the order of the float
# additions differs). The bounds leave about 6x. One process on 2 threads differs from itself on
# one thread by more: 2.3e-6 in the gradient, 4.8e-6 in the weights (the sequence correction's
# exp(sum of log ratios) amplifies the matmuls' round-off).
WEIGHT_ATOL = 1e-6
GRAD_RTOL = 2e-6
LEARNING_RATE = 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment(rank: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(WORLD),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(WORLD),
    }


def _opened(rank: int, port: int, spec: str = "cpu") -> DataParallel:
    os.environ.update(_environment(rank, port))
    torch.set_num_threads(1)
    ranks = Ranks.from_environment()
    assert ranks is not None
    dp = DataParallel(ranks, ranks.device(spec))
    dp.open()
    return dp


def _learner(case: str, dp: DataParallel | None, device: str = "cpu") -> Learner:
    _, kl_coef, micro_batch_size, _ = CASES[case]
    return Learner(
        tiny_model().to(dp.device if dp is not None else device),
        learning_rate=LEARNING_RATE,
        kl_coef=kl_coef,
        pad_id=PAD,
        micro_batch_size=micro_batch_size,
        data_parallel=dp,
    )


def _update_worker(rank: int, port: int, out: str, spec: str) -> None:
    """One rank: every case's update, rank 0 sending the batch; its weights and metrics to `out`."""
    dp = _opened(rank, port, spec)
    results = {}
    for case, (objective, _, _, batch) in CASES.items():
        learner = _learner(case, dp)
        if rank == 0:
            metrics = dp.update(batch(), functools.partial(learner.train_step, objective=objective))
        else:
            message = dp.receive()
            assert isinstance(message, Update)
            metrics = learner.train_step(message.batch, objective)
        grads = {k: p.grad.cpu() for k, p in learner.model.named_parameters() if p.grad is not None}
        results[case] = ({k: v.detach().cpu() for k, v in learner.model.state_dict().items()}, metrics, grads)
    if rank == 0:
        dp.close(result="rank 0's result")
    else:
        assert dp.follow(lambda b: None) == "rank 0's result"  # the Stop rank 0's close sends
        dp.close()
    Path(out, f"rank-{rank}.pt").write_bytes(pickle.dumps(results))


def _stop_worker(rank: int, port: int, out: str, how: str) -> None:
    """Rank 0 fails (`how`: before an update, or dying inside one); rank 1 records how it ended."""
    dp = _opened(rank, port)
    objective, _, _, batch = CASES["distill-uneven"]
    learner = _learner("distill-uneven", dp)
    if rank == 0:
        if how == "inside-update":
            dp.send(Update(batch()))
            os._exit(3)  # dies before its share: rank 1 waits in the update's collectives
        dp.close(error="ValueError: the sampler failed")
        return
    started = time.monotonic()
    try:
        dp.follow(lambda b: learner.train_step(b, objective))
        ended = "returned"
    except RankStoppedError as err:
        ended = f"RankStoppedError: {err}"
    except RuntimeError as err:  # gloo: the connection to the dead rank closed
        ended = f"RuntimeError: {err}"
    Path(out, "rank-1.txt").write_text(f"{time.monotonic() - started:.3f}\n{ended}")


@contextmanager
def _ranks(target: Callable[..., None], *args: object) -> Iterator[list[multiprocessing.process.BaseProcess]]:
    """Two spawned ranks running `target(rank, port, *args)`, killed on every path out."""
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    processes = [context.Process(target=target, args=(rank, port, *args), daemon=True) for rank in range(WORLD)]
    try:
        for p in processes:
            p.start()
        deadline = time.monotonic() + JOIN_S
        for p in processes:
            p.join(max(deadline - time.monotonic(), 0.0))
        assert not any(p.is_alive() for p in processes), f"a rank still runs after {JOIN_S:g} s"
        yield processes
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(5.0)


def _alone(case: str, device: str) -> tuple[dict, dict, dict]:
    """One process's step on the case, on one thread as the ranks run: (weights, metrics, gradients)."""
    objective, _, _, batch = CASES[case]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matmuls split over threads add in another order: a round-off of its own
    try:
        alone = _learner(case, None, device)
        metrics = alone.train_step(batch(), objective)
    finally:
        torch.set_num_threads(threads)
    grads = {k: p.grad.cpu() for k, p in alone.model.named_parameters() if p.grad is not None}
    return {k: v.cpu() for k, v in alone.model.state_dict().items()}, metrics, grads


@pytest.mark.parametrize(
    "spec",
    [
        "cpu",
        # Never run here (no machine with two GPUs): NCCL for the step, gloo for rank 0's messages, and
        # the CPU's bounds, which no GPU measurement has confirmed.
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD, reason="needs 2 GPUs"
                ),
            ],
        ),
    ],
)
def test_two_ranks_take_the_single_process_step(tmp_path, spec):
    with _ranks(_update_worker, str(tmp_path), spec) as processes:
        assert [p.exitcode for p in processes] == [0, 0]
    got = [pickle.loads((tmp_path / f"rank-{r}.pt").read_bytes()) for r in range(WORLD)]
    start = tiny_model().state_dict()
    for case in CASES:
        want, want_metrics, want_grads = _alone(case, "cuda:0" if spec == "cuda" else "cpu")
        (weights, metrics, grads), (other, _, _) = got[0][case], got[1][case]
        assert grads.keys() == want_grads.keys(), case
        for name, tensor in want.items():
            assert torch.equal(weights[name], other[name]), (case, name, "the ranks' weights differ")
            assert not torch.equal(tensor, start[name]), (case, name, "the step left a weight unchanged")
            assert torch.allclose(weights[name], tensor, rtol=0.0, atol=WEIGHT_ATOL), (
                case,
                name,
                float((weights[name] - tensor).abs().max()),
            )
        for name, grad in want_grads.items():  # summed over the ranks (and clipped), relative to the largest
            error = float((grads[name] - grad).abs().max() / grad.abs().max())
            assert error <= GRAD_RTOL, (case, name, error)
        assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-6), case
        assert metrics["grad_norm"] == pytest.approx(want_metrics["grad_norm"], rel=1e-6), case


@pytest.mark.parametrize("how", ["before-update", "inside-update"])
def test_a_failing_rank_0_stops_the_other_rank(tmp_path, how):
    with _ranks(_stop_worker, str(tmp_path), how) as processes:
        assert processes[0].exitcode == (3 if how == "inside-update" else 0)
    seconds, ended = (tmp_path / "rank-1.txt").read_text().split("\n", 1)
    if how == "before-update":
        assert ended.startswith("RankStoppedError") and "the sampler failed" in ended
    else:
        assert ended.startswith("RuntimeError"), ended
    assert float(seconds) < 30.0, ended  # a closed connection, not the process group's timeout


def test_one_process_is_no_data_parallel_and_a_numbered_gpu_is_refused():
    assert Ranks.from_environment({}) is None
    assert Ranks.from_environment({"WORLD_SIZE": "1"}) is None
    ranks = Ranks.from_environment(_environment(1, 0))
    assert ranks == Ranks(rank=1, world_size=2, local_rank=1, local_world_size=2) and not ranks.main
    assert ranks.device("cpu") == torch.device("cpu")
    with pytest.raises(InvalidInputError, match="without RANK"):
        Ranks.from_environment({"WORLD_SIZE": "2"})
    if torch.cuda.is_available():
        with pytest.raises(InvalidInputError, match="cuda:LOCAL_RANK"):
            ranks.device("cuda:1")


def test_shares_are_contiguous_blocks_with_the_extra_ones_first():
    dp = DataParallel(Ranks(0, 3, 0, 3), torch.device("cpu"))
    assert dp.shares(7) == [range(0, 3), range(3, 5), range(5, 7)]
    assert dp.shares(2) == [range(0, 1), range(1, 2), range(2, 2)]
    assert Stop().error is None


def test_a_dry_run_under_the_launcher_keeps_every_learner_processs_gpu(monkeypatch, tmp_path):
    from dualvllm.training import serving
    from dualvllm.training.config import TrainConfig
    from tests.recipes import TINY_ARITH

    for name, value in _environment(0, 29500).items():
        monkeypatch.setenv(name, value)
    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path)
    plan = serving.run_plan(config, plan_gpus=4)
    assert [(s.name, s.gpus) for s in plan.servers] == [("theta-0", (2,)), ("t-0", (3,))]
    described = serving.describe_run(config, plan_gpus=4)
    assert "learner: 2 processes on cuda:0, cuda:1 (GPUs 0,1 of the host), mixed precision auto" in described
    with pytest.raises(InvalidInputError, match="--learner-device cuda:1 with 2 learner processes"):
        serving.run_plan(
            TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, learner_device="cuda:1"), plan_gpus=4
        )
    cpu = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, learner_device="cpu", engine="transformers")
    assert "learner: 2 processes on cpu, mixed precision auto" in serving.describe_run(cpu, plan_gpus=4)


def test_dpo_under_the_launcher_is_refused_before_anything_starts(monkeypatch, tmp_path, capsys):
    """DPO is TRL's trainer in one process: each rank would run the whole recipe and start its own servers."""
    from dualvllm import cli
    from tests.recipes import TINY_ARITH

    for name, value in _environment(1, 29500).items():
        monkeypatch.setenv(name, value)
    code = cli.main(["train", "--config", str(TINY_ARITH), "--method", "dpo", "--output-dir", str(tmp_path / "run")])
    assert code == 2
    assert "--method dpo trains with TRL's DPOTrainer in one process" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_accelerate_launch_trains_two_steps_with_two_learner_processes(tmp_path):
    """The command docs/training.md gives, on the bundled models in process (no server): rank 0 runs
    the recipe and prints its report, rank 1 follows its two updates and ends with it."""
    from tests.recipes import TINY_ARITH

    accelerate = Path(sys.executable).with_name("accelerate")
    if not accelerate.exists():
        pytest.skip("accelerate's launcher is not installed beside this Python")
    command = [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--main_process_port", str(_free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "dualvllm", "train", "--config", str(TINY_ARITH), "--steps", "2", "--engine", "transformers",
        "--output-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    # 46 s on 2 cores here (the two ranks share them); the bound is for a hang.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        out, _ = process.communicate(timeout=4 * JOIN_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5.0)
    assert process.returncode == 0, out[-3000:]
    assert "learner process 0 of 2 on cpu" in out and "learner process 1 of 2 on cpu" in out
    reports = [line for line in out.splitlines() if line.startswith("2 steps; held-out greedy accuracy")]
    assert len(reports) == 1, out[-3000:]  # rank 0 prints the run's report; rank 1 ends with it, silent
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 2]  # written once, by rank 0
    assert all(math.isfinite(r["loss"]) for r in records[1:3])
