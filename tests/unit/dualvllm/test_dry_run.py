"""`--dry-run` of serve, train and eval: the placement a GPU machine would get, printed on this
one (`--plan-gpus N`), and the bad plans refused with the flags to change. Nothing starts: a
started server or an opened coordinator fails the test."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from dualvllm import cli
from dualvllm.engines.launcher import VLLMServer
from tests.recipes import TINY_ARITH


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    async def start(self):
        raise AssertionError(f"a dry run started {self.name}")

    monkeypatch.setattr(VLLMServer, "start", start)
    monkeypatch.setattr(cli, "DualVLLMCoordinator", None)  # opening one fails


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def servers(out: str) -> dict[str, dict[str, str]]:
    """Each server's printed fields: environment as a dict, and its command's flags that take a value."""
    found: dict[str, dict] = {}
    name = None
    for line in out.splitlines():
        if m := re.match(r"^(theta|t)(-\d+)?: ", line):
            name = m.group(0)[:-2]
            found[name] = {}
        elif name and (m := re.match(r"^  (\w+):\s+(.*)$", line)):
            found[name][m.group(1)] = m.group(2)
    for fields in found.values():
        fields["env"] = dict(word.split("=", 1) for word in shlex.split(fields["environment"]))
        fields["argv"] = shlex.split(fields["command"])
    return found


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_serve_dry_run_places_each_replica_on_its_own_gpus(capsys, monkeypatch):
    monkeypatch.setenv("DUALVLLM_API_KEY", "sekrit")
    code, out, _ = run(
        capsys, "serve", "--dry-run", "--plan-gpus", "8", "--replicas", "2",
        "--base-gpus", "0,1,2,3", "--base-tensor-parallel-size", "2", "--teacher-gpus", "4,5",
        "--base-vllm-arg", "--enable-prefix-caching", "--teacher-vllm-arg", "--quantization fp8",
    )
    assert code == 0
    found = servers(out)
    assert list(found) == ["theta-0", "t-0", "theta-1", "t-1"]
    gpus = {name: fields["env"]["CUDA_VISIBLE_DEVICES"] for name, fields in found.items()}
    assert gpus == {"theta-0": "0,1", "t-0": "4", "theta-1": "2,3", "t-1": "5"}
    for name, fields in found.items():
        size = len(gpus[name].split(","))
        assert value(fields["argv"], "--tensor-parallel-size") == str(size)
        assert value(fields["argv"], "--gpu-memory-utilization") == "0.9"  # a GPU of its own
        assert fields["env"]["VLLM_API_KEY"] == "<redacted>" and "sekrit" not in out
        assert fields["url"].endswith(value(fields["argv"], "--port"))
    assert "--enable-prefix-caching" in found["theta-1"]["argv"] and "--enable-prefix-caching" not in found["t-0"]["argv"]
    assert value(found["t-1"]["argv"], "--quantization") == "fp8"
    assert len({fields["url"] for fields in found.values()}) == 4
    assert "start order: all 4 at once" in out


def test_serve_dry_run_on_one_gpu_shares_it_and_starts_one_server_after_the_other(capsys):
    code, out, _ = run(capsys, "serve", "--dry-run", "--plan-gpus", "1")
    assert code == 0
    found = servers(out)
    assert [found[n]["env"]["CUDA_VISIBLE_DEVICES"] for n in ("theta", "t")] == ["0", "0"]
    assert [value(found[n]["argv"], "--gpu-memory-utilization") for n in ("theta", "t")] == ["0.45", "0.45"]
    assert "start order: theta then t (they share a GPU)" in out


def test_serve_dry_run_on_the_cpu_build_is_todays_launch(capsys, monkeypatch):
    monkeypatch.setattr(cli, "visible_gpus", lambda: None)
    code, out, _ = run(capsys, "serve", "--dry-run")
    assert code == 0
    for fields in servers(out).values():
        assert "CUDA_VISIBLE_DEVICES" not in fields["env"] and "VLLM_CPU_KVCACHE_SPACE" not in fields["env"]
        assert value(fields["argv"], "--kv-cache-memory-bytes") == str(64 << 20)  # the bundled models' floor
        assert "--enforce-eager" in fields["argv"] and "--tensor-parallel-size" not in fields["argv"]


def test_train_dry_run_keeps_the_learners_gpu(capsys, tmp_path):
    out_dir = tmp_path / "run"
    code, out, _ = run(
        capsys, "train", "--config", str(TINY_ARITH), "--output-dir", str(out_dir), "--dry-run", "--plan-gpus", "8",
        "--replicas", "2", "--learner-device", "cuda:0", "--base-gpus", "1,2,3,4", "--base-tensor-parallel-size", "2",
        "--teacher-gpus", "5,6",
    )
    assert code == 0
    found = servers(out)
    assert {n: f["env"]["CUDA_VISIBLE_DEVICES"] for n, f in found.items()} == {
        "theta-0": "1,2", "t-0": "5", "theta-1": "3,4", "t-1": "6"}
    assert [value(found[n]["argv"], "--tensor-parallel-size") for n in found] == ["2", "1", "2", "1"]
    assert found["theta-0"]["env"]["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_SERVER_DEV_MODE" not in found["t-0"]["env"]
    assert found["theta-1"]["log"] == str(out_dir / "theta-1.log")
    assert "learner: cuda:0 (GPU 0 of the host), mixed precision auto" in out
    assert not out_dir.exists()  # nothing written


def test_train_dry_run_default_plan_on_two_gpus_shares_the_one_the_learner_leaves(capsys, tmp_path):
    code, out, _ = run(capsys, "train", "--config", str(TINY_ARITH), "--output-dir", str(tmp_path), "--dry-run",
                       "--plan-gpus", "2")
    assert code == 0
    found = servers(out)
    assert [found[n]["env"]["CUDA_VISIBLE_DEVICES"] for n in ("theta", "t")] == ["1", "1"]
    assert "start order: theta then t (they share a GPU)" in out and "learner: cuda:0" in out


@pytest.mark.parametrize(
    ("extra", "backend"),
    [((), "nccl"), (("--learner-device", "cpu"), "dualvllm_shm"), (("--weights-via", "disk"), "dualvllm_shm")],
)
def test_train_dry_run_base_servers_take_nccl_pushes_from_a_gpu_learner(capsys, tmp_path, extra, backend):
    """A learner on a GPU pushes over NCCL, so the base servers load vLLM's engine; the teacher loads none."""
    code, out, _ = run(capsys, "train", "--config", str(TINY_ARITH), "--output-dir", str(tmp_path), "--dry-run",
                       "--plan-gpus", "2", *extra)
    assert code == 0
    found = servers(out)
    assert json.loads(value(found["theta"]["argv"], "--weight-transfer-config")) == {"backend": backend}
    assert "--weight-transfer-config" not in found["t"]["argv"]


def test_train_dry_run_reads_placement_from_the_recipe(capsys, tmp_path):
    recipe = tmp_path / "gpus.yaml"
    recipe.write_text(TINY_ARITH.read_text() + "\nbase_gpus: [2, 3]\nteacher_gpus: '2,3'\nreplicas: 2\n"
                      "base_gpu_memory_utilization: 0.5\nteacher_gpu_memory_utilization: 0.4\n"
                      "learner_device: cpu\n")
    code, out, _ = run(capsys, "train", "--config", str(recipe), "--output-dir", str(tmp_path / "r"), "--dry-run",
                       "--plan-gpus", "4")
    assert code == 0
    found = servers(out)
    assert {n: (f["env"]["CUDA_VISIBLE_DEVICES"], value(f["argv"], "--gpu-memory-utilization"))
            for n, f in found.items()} == {"theta-0": ("2", "0.5"), "t-0": ("2", "0.4"),
                                           "theta-1": ("3", "0.5"), "t-1": ("3", "0.4")}
    assert "theta-0 then t-0 (they share a GPU); theta-1 then t-1 (they share a GPU)" in out
    assert "learner: cpu," in out


def test_train_dry_run_in_process_starts_no_server(capsys, tmp_path):
    code, out, _ = run(capsys, "train", "--config", str(TINY_ARITH), "--output-dir", str(tmp_path), "--dry-run",
                       "--engine", "transformers", "--learner-device", "cpu")
    assert code == 0
    assert "no server is started" in out and "learner: cpu" in out and "CUDA_VISIBLE_DEVICES" not in out


def test_eval_dry_run(capsys):
    code, out, _ = run(capsys, "eval", "--config", str(TINY_ARITH), "--dry-run", "--plan-gpus", "2",
                       "--teacher-tensor-parallel-size", "1", "--dtype", "bfloat16")
    assert code == 0
    found = servers(out)
    assert [found[n]["env"]["CUDA_VISIBLE_DEVICES"] for n in ("theta", "t")] == ["0", "1"]
    assert value(found["t"]["argv"], "--dtype") == "bfloat16" and "learner" not in out


BAD = [
    ("gpu-twice", ["serve", "--dry-run", "--plan-gpus", "4", "--base-gpus", "0,0"], r"GPU 0 is twice in --base-gpus"),
    ("tp-not-matching-list", ["serve", "--dry-run", "--plan-gpus", "4", "--replicas", "2", "--base-gpus", "0,1",
                              "--base-tensor-parallel-size", "2"],
     r"--base-gpus lists 2 GPU\(s\), and --replicas 2 x --base-tensor-parallel-size 2 needs 4"),
    ("shares-over-one", ["serve", "--dry-run", "--plan-gpus", "1", "--base-gpu-memory-utilization", "0.7"],
     r"sum to 1.15 .*--base-gpu-memory-utilization and/or --teacher-gpu-memory-utilization"),
    ("learner-gpu-to-a-server", ["train", "--config", str(TINY_ARITH), "--output-dir", "{tmp}", "--dry-run",
                                 "--plan-gpus", "2", "--learner-device", "cuda:1", "--base-gpus", "0",
                                 "--teacher-gpus", "1"],
     r"GPU 1 in --teacher-gpus is the learner's \(--learner-device\)"),
    ("no-gpu-left-for-servers", ["train", "--config", str(TINY_ARITH), "--output-dir", "{tmp}", "--dry-run",
                                 "--plan-gpus", "1"], r"--learner-device cpu"),
    ("nccl-without-dev-mode", ["serve", "--dry-run", "--weight-transfer", "nccl"], r"--weight-transfer nccl .*add --dev-mode"),
    ("unknown-engine", ["serve", "--dry-run", "--dev-mode", "--weight-transfer", "ncl"],
     r"--weight-transfer 'ncl' is no weight-transfer engine; give one of dualvllm_shm, nccl"),
    ("plan-gpus-without-dry-run", ["serve", "--plan-gpus", "2"], r"--plan-gpus 2 .*add --dry-run"),
    ("gpu-options-on-the-cpu-build", ["serve", "--dry-run", "--teacher-gpus", "0"],
     r"--teacher-gpus place servers on GPUs, and this machine's vLLM runs on the CPU"),
    ("train-gpus-in-process", ["train", "--config", str(TINY_ARITH), "--output-dir", "{tmp}", "--dry-run",
                               "--engine", "transformers", "--teacher-gpus", "0"],
     r"--engine transformers .*--teacher-gpus set the servers"),
    ("train-gpus-with-running-servers", ["train", "--config", str(TINY_ARITH), "--output-dir", "{tmp}", "--dry-run",
                                         "--theta-urls", "http://127.0.0.1:1", "--t-urls", "http://127.0.0.1:2",
                                         "--base-gpus", "0"], r"--base-gpus set the servers this run starts"),
]


@pytest.mark.parametrize(("argv", "message"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_plans_are_refused_naming_the_flags(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.setattr(cli, "visible_gpus", lambda: None)  # this machine: the CPU build
    code, out, err = run(capsys, *[arg.format(tmp=tmp_path) for arg in argv])
    assert code == 2 and out == ""
    assert re.search(message, err), err
    assert err.startswith("dualvllm: error: ") and err.count("\n") == 1


def test_the_weight_transfer_engine_none_is_no_engine(capsys):
    code, out, _ = run(capsys, "serve", "--dry-run", "--dev-mode", "--weight-transfer", "None")
    assert code == 0
    assert "--weight-transfer-config" not in out and "VLLM_SERVER_DEV_MODE=1" in out


def test_the_learners_gpu_is_its_host_number_under_cuda_visible_devices(monkeypatch, tmp_path):
    import torch

    from dualvllm.training import device, serving
    from dualvllm.training.config import TrainConfig

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setattr(serving, "visible_gpus", lambda: (4, 6))
    monkeypatch.setattr(device, "learner_device", lambda spec: torch.device("cuda", 1))  # torch's cuda:1 is GPU 6
    config = TrainConfig.parse(config_file=TINY_ARITH, output_dir=tmp_path, learner_device="cuda:1")
    plan = serving.run_plan(config)
    assert [(s.name, s.gpus) for s in plan.servers] == [("theta-0", (4,)), ("t-0", (4,))]


def test_a_self_taught_run_starts_its_base_alone(capsys, tmp_path, monkeypatch):
    """--teacher self: one server plays both roles, so no teacher server is planned."""
    monkeypatch.setattr(cli, "visible_gpus", lambda: None)
    code, out, _ = run(capsys, "train", "--config", str(TINY_ARITH), "--output-dir", str(tmp_path), "--dry-run",
                       "--teacher", "self")
    assert code == 0
    assert list(servers(out)) == ["theta"]
