"""The placement plan (engines/placement.py): pure, so every rule is checked here without GPUs."""

from __future__ import annotations

import pytest

from dualvllm.common.errors import InvalidInputError
from dualvllm.engines.placement import PlacementOptions, ServerOptions, host_gpu, plan, start_chains


def layout(p) -> list[tuple[str, tuple[int, ...], float | None]]:
    return [(s.name, s.gpus, s.gpu_memory_utilization) for s in p.servers]


# The default plan on 1, 2, 4 and 8 GPUs: each server its own GPU when there are enough, else
# each replica's base and teacher share one; never the learner's GPU.
@pytest.mark.parametrize(("gpus", "replicas", "learner", "expected", "idle"), [
    (1, 1, None, [("theta-0", (0,), 0.45), ("t-0", (0,), 0.45)], ()),
    (2, 1, None, [("theta-0", (0,), 0.9), ("t-0", (1,), 0.9)], ()),
    (2, 1, 0, [("theta-0", (1,), 0.45), ("t-0", (1,), 0.45)], ()),
    (4, 1, 0, [("theta-0", (1,), 0.9), ("t-0", (2,), 0.9)], (3,)),
    (4, 2, None, [("theta-0", (0,), 0.9), ("t-0", (1,), 0.9), ("theta-1", (2,), 0.9), ("t-1", (3,), 0.9)], ()),
    (4, 2, 0, [("theta-0", (1,), 0.45), ("t-0", (1,), 0.45), ("theta-1", (2,), 0.45), ("t-1", (2,), 0.45)], (3,)),
    (8, 3, 0, [("theta-0", (1,), 0.9), ("t-0", (2,), 0.9), ("theta-1", (3,), 0.9), ("t-1", (4,), 0.9),
               ("theta-2", (5,), 0.9), ("t-2", (6,), 0.9)], (7,)),
    (8, 4, None, [(f"{r}-{i}", (2 * i + j,), 0.9) for i in range(4) for j, r in enumerate(("theta", "t"))], ()),
])
def test_default_plan(gpus, replicas, learner, expected, idle):
    p = plan(ServerOptions(), replicas=replicas, visible=range(gpus), learner_gpus=() if learner is None else (learner,))
    assert layout(p) == expected
    assert p.idle == idle


def test_default_plan_with_tensor_parallelism_on_eight_gpus():
    options = ServerOptions(base_tensor_parallel_size=2, teacher_tensor_parallel_size=2)
    own = plan(options, replicas=2, visible=range(8))
    assert [s.gpus for s in own.servers] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert {s.tensor_parallel_size for s in own.servers} == {2}
    # The learner takes GPU 0: 7 left, 8 needed apart, so each replica's pair shares a block.
    shared = plan(options, replicas=2, visible=range(8), learner_gpus=(0,))
    assert layout(shared) == [("theta-0", (1, 2), 0.45), ("t-0", (1, 2), 0.45),
                              ("theta-1", (3, 4), 0.45), ("t-1", (3, 4), 0.45)]
    mixed = plan(ServerOptions(base_tensor_parallel_size=2), replicas=1, visible=range(4), learner_gpus=(0,))
    assert layout(mixed) == [("theta-0", (1, 2), 0.9), ("t-0", (3,), 0.9)]


def test_default_plan_that_does_not_fit_is_refused_with_the_flags_to_set():
    with pytest.raises(InvalidInputError, match=r"learner's.*--learner-device cpu.*--engine transformers"):
        plan(ServerOptions(), replicas=1, visible=range(1), learner_gpus=(0,))
    with pytest.raises(InvalidInputError, match=r"--replicas 3 .*needs 6 GPUs .* or 3 .* 2 of the 2 visible.*--base-gpus"):
        plan(ServerOptions(), replicas=3, visible=range(2))


def test_given_lists_are_cut_into_one_block_per_replica():
    options = ServerOptions(base_gpus="0,1,2,3", teacher_gpus=[4, 5], base_tensor_parallel_size=2)
    p = plan(options, replicas=2, visible=range(8))
    assert [(s.name, s.gpus, s.tensor_parallel_size) for s in p.servers] == [
        ("theta-0", (0, 1), 2), ("t-0", (4,), 1), ("theta-1", (2, 3), 2), ("t-1", (5,), 1)]
    assert p.idle == (6, 7)


def test_one_role_given_the_other_takes_what_is_left_or_shares():
    left = plan(ServerOptions(base_gpus="2"), replicas=1, visible=range(4), learner_gpus=(0,))
    assert layout(left) == [("theta-0", (2,), 0.9), ("t-0", (1,), 0.9)]
    shares = plan(ServerOptions(base_gpus="1"), replicas=1, visible=range(2), learner_gpus=(0,))
    assert layout(shares) == [("theta-0", (1,), 0.45), ("t-0", (1,), 0.45)]


@pytest.mark.parametrize(("options", "replicas", "message"), [
    (dict(base_gpus="0,1,2"), 2, r"--base-gpus lists 3 GPU\(s\), and --replicas 2 x --base-tensor-parallel-size 1 needs 2"),
    (dict(teacher_gpus="0,1", teacher_tensor_parallel_size=2), 2,
     r"--teacher-gpus lists 2 .* --replicas 2 x --teacher-tensor-parallel-size 2 needs 4"),
])
def test_a_list_that_does_not_match_replicas_times_tensor_parallelism_is_refused(options, replicas, message):
    with pytest.raises(InvalidInputError, match=message):
        plan(ServerOptions(**options), replicas=replicas, visible=range(8))


def test_a_gpu_twice_in_one_role_is_refused_naming_the_flag():
    with pytest.raises(InvalidInputError, match=r"GPU 1 is twice in --base-gpus"):
        PlacementOptions(base_gpus="0,1,1")
    with pytest.raises(InvalidInputError, match=r"--teacher-gpus takes GPU numbers"):
        PlacementOptions(teacher_gpus="0,a")


def test_the_learners_gpu_is_never_given_to_a_server():
    with pytest.raises(InvalidInputError, match=r"GPU 0 in --teacher-gpus is the learner's \(--learner-device\)"):
        plan(ServerOptions(base_gpus="1", teacher_gpus="0"), replicas=1, visible=range(2), learner_gpus=(0,))


def test_several_learner_processes_keep_all_their_gpus():
    # accelerate launch --num_processes 2: the learner holds GPUs 0 and 1 (training/data_parallel.py).
    p = plan(ServerOptions(), replicas=1, visible=range(4), learner_gpus=(0, 1))
    assert layout(p) == [("theta-0", (2,), 0.9), ("t-0", (3,), 0.9)] and p.idle == ()
    shared = plan(ServerOptions(), replicas=1, visible=range(3), learner_gpus=(0, 1))
    assert layout(shared) == [("theta-0", (2,), 0.45), ("t-0", (2,), 0.45)]
    with pytest.raises(InvalidInputError, match=r"GPU 1 in --base-gpus is one of the learner processes' \(GPUs 0,1: "
                       r"accelerate launch --num_processes\)"):
        plan(ServerOptions(base_gpus="1", teacher_gpus="2"), replicas=1, visible=range(4), learner_gpus=(0, 1))
    with pytest.raises(InvalidInputError, match=r"0 of the 2 visible are free \(GPUs 0,1 are the learner processes'\): .*fewer learner processes"):
        plan(ServerOptions(), replicas=1, visible=range(2), learner_gpus=(0, 1))


def test_a_gpu_the_machine_lacks_is_refused():
    with pytest.raises(InvalidInputError, match=r"GPU 4 in --base-gpus is not on this machine \(visible: 0,1,2,3\)"):
        plan(ServerOptions(base_gpus="4"), replicas=1, visible=range(4))


def test_shares_of_one_gpu_must_sum_to_at_most_one():
    shared = dict(base_gpus="0", teacher_gpus="0")
    with pytest.raises(InvalidInputError, match=r"sum to 1.05 .*--base-gpu-memory-utilization.*--teacher-gpu-memory-utilization"):
        plan(ServerOptions(**shared, base_gpu_memory_utilization=0.6), replicas=1, visible=range(1))
    fits = plan(ServerOptions(**shared, base_gpu_memory_utilization=0.3, teacher_gpu_memory_utilization=0.7),
                replicas=1, visible=range(1))
    assert [s.gpu_memory_utilization for s in fits.servers] == [0.3, 0.7]
    apart = plan(ServerOptions(base_gpus="0", teacher_gpus="1", base_gpu_memory_utilization=0.95),
                 replicas=1, visible=range(2))
    assert [s.gpu_memory_utilization for s in apart.servers] == [0.95, 0.9]


def test_cpu_build_has_no_gpu_plan_and_refuses_gpu_options():
    cpu = plan(ServerOptions(base_vllm_arg=("--seed 3",)), replicas=2, visible=None)
    assert [(s.name, s.gpus, s.gpu_memory_utilization) for s in cpu.servers] == [
        ("theta-0", (), None), ("t-0", (), None), ("theta-1", (), None), ("t-1", (), None)]
    assert cpu.servers[0].vllm_args == ("--seed", "3") and not cpu.on_gpus
    with pytest.raises(InvalidInputError, match=r"--base-gpus place servers on GPUs.*--dry-run --plan-gpus N"):
        plan(ServerOptions(base_gpus="0"), replicas=1, visible=None)


def test_vllm_args_are_split_as_a_shell_would_and_may_not_set_what_the_launcher_sets():
    options = ServerOptions(base_vllm_arg=("--enable-prefix-caching", "--quantization fp8"),
                            teacher_vllm_arg="--max-num-seqs 8")
    p = plan(options, replicas=1, visible=range(2))
    assert p.servers[0].vllm_args == ("--enable-prefix-caching", "--quantization", "fp8")
    assert p.servers[1].vllm_args == ("--max-num-seqs", "8")
    with pytest.raises(InvalidInputError, match=r"--base-vllm-arg .*--tensor-parallel-size itself; use --base-tensor-parallel-size"):
        PlacementOptions(base_vllm_arg=("--tensor-parallel-size=2",))
    with pytest.raises(InvalidInputError, match=r"--teacher-vllm-arg .*fix its quotes"):
        PlacementOptions(teacher_vllm_arg=("--chat-template 'x",))


def test_a_run_without_a_teacher_server_takes_no_teacher_option():
    assert [s.name for s in plan(ServerOptions(), replicas=1, visible=range(2), teacher=False).servers] == ["theta-0"]
    with pytest.raises(InvalidInputError, match=r"--teacher self .*drop --teacher-gpus"):
        plan(ServerOptions(teacher_gpus="1"), replicas=1, visible=range(2), teacher=False)


def test_servers_sharing_a_gpu_start_one_after_another():
    assert start_chains([(0,), (0,), (1,), (2,)]) == [[0, 1], [2], [3]]
    assert start_chains([(0, 1), (2,), (1, 2), (3,)]) == [[0, 1, 2], [3]]  # through a third server
    assert start_chains([None, (), None]) == [[0], [1], [2]]  # the CPU build: all at once


def test_the_learners_cuda_index_is_its_entry_of_cuda_visible_devices():
    assert host_gpu(1, None) == 1
    assert host_gpu(1, "4,6") == 6
    assert host_gpu(0, "GPU-5d1f") is None
    with pytest.raises(InvalidInputError, match="shows 2 GPU"):
        host_gpu(2, "4,6")
