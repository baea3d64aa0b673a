"""The launcher's command line, environment, safety rules and process handling (no vLLM needed)."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap

import pytest

from dualvllm.common.errors import InvalidInputError, LifecycleError, ServerStartupError
from dualvllm.engines import placement
from dualvllm.engines.launcher import (
    VLLM_WEIGHT_TRANSFER_BACKENDS,
    WEIGHT_TRANSFER_BACKEND,
    ServerConfig,
    VLLMServer,
    pair_configs,
    replica_configs,
    split_cores,
    start_servers,
    with_ports,
)
from tests.waiting import eventually


def test_command_has_the_flags_vllm_needs(tmp_path):
    server = VLLMServer(ServerConfig(model="m", port=8123, max_logprobs=50, device="cpu",
                                     api_key="k", log_path=tmp_path / "l"))
    cmd = server.command()
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    value = lambda flag: cmd[cmd.index(flag) + 1]
    assert value("--model") == "m" and value("--host") == "127.0.0.1" and value("--port") == "8123"
    assert value("--max-logprobs") == "50" and "k" not in cmd  # the key travels in the environment
    assert server.environment()["VLLM_API_KEY"] == "k"
    assert "--enforce-eager" in cmd and "--enable-tokenizer-info-endpoint" in cmd
    assert server.url == "http://127.0.0.1:8123"


def test_the_scoring_route_is_on_unless_turned_off():
    """--enable-scale-out opens /inference/v1/generate, where scoring skips detokenizing (engines/vllm_scoring.py)."""
    assert "--enable-scale-out" in VLLMServer(ServerConfig(model="m", port=1, device="cpu")).command()
    off = VLLMServer(ServerConfig(model="m", port=1, device="cpu", scoring_route=False)).command()
    assert "--enable-scale-out" not in off


def test_gpu_servers_share_the_gpu_and_skip_eager_mode():
    cmd = VLLMServer(ServerConfig(model="m", port=1, device="gpu")).command()
    assert "--enforce-eager" not in cmd
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.45"


def test_lockstep_is_the_default_and_picks_the_plugin_of_the_model_runner(monkeypatch):
    cpu = VLLMServer(ServerConfig(model="m", port=1, device="cpu"))
    assert "dualvllm.engines.vllm_plugin.processor:LockstepProcessor" in cpu.command()
    assert "--no-enable-chunked-prefill" in cpu.command()
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    gpu = VLLMServer(ServerConfig(model="m", port=1, device="gpu"))
    assert "dualvllm.engines.vllm_plugin.processor:LockstepProcessor" in gpu.command()
    assert gpu.environment()["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the tested plugin, unless asked
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert "dualvllm.engines.vllm_plugin.processor_v2:LockstepProcessorV2" in gpu.command()
    assert gpu.environment()["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    plain = VLLMServer(ServerConfig(model="m", port=1, device="cpu", lockstep=False)).command()
    assert "--logits-processors" not in plain and "--no-enable-chunked-prefill" not in plain


def test_cpu_environment_binds_cores_and_sizes_the_kv_cache(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")  # vLLM's legacy setting would override ours
    server = VLLMServer(ServerConfig(model="m", port=1, device="cpu", cpu_cores="1", kv_cache_space_gib=0.5,
                                     dev_mode=True))
    env = server.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    command = server.command()
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(512 << 20)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    plain = VLLMServer(ServerConfig(model="m", port=1, device="cpu")).environment()
    assert plain["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and "VLLM_SERVER_DEV_MODE" not in plain


def test_a_server_started_by_a_learner_rank_inherits_none_of_the_rank_variables(monkeypatch):
    """Under `accelerate launch`, rank 0 starts the servers: torchrun's variables are its, not theirs."""
    launched = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_HOME", "/models")
    env = VLLMServer(ServerConfig(model="m", port=1, device="gpu", gpus=(1,))).environment()
    assert not set(launched) & set(env)
    assert env["HF_HOME"] == "/models" and env["CUDA_VISIBLE_DEVICES"] == "1"


def test_uni_executor_keeps_the_model_in_the_engine_core_and_binds_it_there(monkeypatch):
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    bound = VLLMServer(ServerConfig(model="m", port=1, device="cpu", cpu_cores="0-2,5", cpu_executor="uni"))
    cmd, env = bound.command(), bound.environment()
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else vLLM's CPU platform turns uni back into mp
    assert env["GOMP_CPU_AFFINITY"] == "0-2,5" and env["OMP_NUM_THREADS"] == "4"
    unbound = VLLMServer(ServerConfig(model="m", port=1, device="cpu", cpu_executor="uni")).environment()
    assert unbound["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and "GOMP_CPU_AFFINITY" not in unbound
    assert ServerConfig(model="m").cpu_executor == "uni"  # the default: faster, and cheaper per token
    mp = VLLMServer(ServerConfig(model="m", port=1, device="cpu", cpu_cores="1", cpu_executor="mp"))
    assert "--distributed-executor-backend" not in mp.command()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in mp.environment() and "GOMP_CPU_AFFINITY" not in mp.environment()


def test_pair_configs_bind_each_server_to_its_own_cores_unless_told(monkeypatch):
    monkeypatch.setattr("dualvllm.engines.launcher.is_cpu_build", lambda: True)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    theta, t = pair_configs()
    assert (theta.cpu_cores, t.cpu_cores) == ("0", "1")
    theta, t = pair_configs(cpu_cores=None)
    assert (theta.cpu_cores, t.cpu_cores) == (None, None)  # nobind: both on every core


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5", "example.org", "::"])
def test_dev_mode_is_refused_off_loopback(host):
    with pytest.raises(InvalidInputError, match="collective_rpc.*not loopback"):
        ServerConfig(model="m", host=host, dev_mode=True)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_dev_mode_is_allowed_on_loopback(host):
    assert ServerConfig(model="m", host=host, dev_mode=True).dev_mode


def test_split_cores_gives_each_server_its_own_block():
    assert split_cores(2, 2) == ["0", "1"]
    assert split_cores(2, 8) == ["0-3", "4-7"]
    assert split_cores(2, 1) == ["0", "0"]
    assert split_cores(4, 2) == ["0", "1", "0", "1"]  # replicas share cores, a pair's two servers never do


FAKE_SERVER = textwrap.dedent("""
    import http.server, os, subprocess, sys, time
    # A grandchild, like vLLM's engine core: it must die with the group.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    time.sleep(float(sys.argv[3]))
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def fake_server(tmp_path, delay_s: float, **config) -> tuple[VLLMServer, object]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pid_file = tmp_path / "child.pid"
    server = VLLMServer(ServerConfig(model="m", log_path=tmp_path / "log", **config))
    server.command = lambda: [sys.executable, str(script), str(server.port), str(pid_file), str(delay_s)]
    return server, pid_file


async def gone(pid: int) -> None:
    """Once `pid` has exited (SIGKILL lands asynchronously); fails if it never does."""
    await eventually(lambda: not alive(pid), f"process {pid} gone")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split()[2] != "Z"


async def test_start_waits_for_health_and_stop_kills_the_whole_group(tmp_path):
    server, pid_file = fake_server(tmp_path, delay_s=1.0)
    async with server:
        assert server.running
        child = int(pid_file.read_text())
        assert alive(child)
    assert not server.running
    await gone(child)
    with pytest.raises(LifecycleError, match="already started"):
        await server.start()


async def test_start_up_timeout_reports_the_log_and_cleans_up(tmp_path):
    server, pid_file = fake_server(tmp_path, delay_s=60.0, startup_timeout_s=1.5)
    with pytest.raises(ServerStartupError, match="not healthy after 2 s"):
        await server.start()
    assert not server.running
    # On a loaded machine the timeout can fire before the child wrote its pid: then it was
    # stopped before it started anything, and there is no grandchild to look for.
    if pid_file.exists():
        await gone(int(pid_file.read_text()))


async def test_a_server_that_exits_at_start_reports_its_log_tail(tmp_path):
    """What vLLM printed before it died (an unknown architecture, say) is in the error, at once:
    no wait for the start-up timeout. (With real vLLM: tests/integration/test_coordinator_vllm.py,
    slow.)"""
    script = tmp_path / "dies.py"
    script.write_text("import sys\nprint('ValueError: Model architectures [NoSuchModel] are not supported', "
                      "file=sys.stderr)\nsys.exit(1)\n")
    server = VLLMServer(ServerConfig(model="m", log_path=tmp_path / "log", startup_timeout_s=300), name="broken")
    server.command = lambda: [sys.executable, str(script)]
    with pytest.raises(ServerStartupError, match="broken vLLM server .* exited") as info:
        await server.start()
    assert "NoSuchModel" in str(info.value)
    assert not server.running


def test_a_gpu_server_sees_only_its_gpus_and_splits_its_model_over_them():
    server = VLLMServer(ServerConfig(model="m", port=1, device="gpu", gpus=(2, 3), tensor_parallel_size=2,
                                     gpu_memory_utilization=0.9))
    cmd, env = server.command(), server.launcher_environment()
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.9"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert server.environment()["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(InvalidInputError, match="tensor_parallel_size 1 must be 2"):
        ServerConfig(model="m", gpus=(0, 1))


def test_cpu_servers_get_no_gpu_environment():
    env = VLLMServer(ServerConfig(model="m", port=1, device="cpu", gpus=(0,))).launcher_environment()
    assert "CUDA_VISIBLE_DEVICES" not in env and "--tensor-parallel-size" not in VLLMServer(
        ServerConfig(model="m", port=1, device="cpu")).command()


def test_replica_configs_follow_the_plan(monkeypatch):
    options = placement.ServerOptions(base_gpus="0,1,2,3", teacher_gpus="4,5", base_tensor_parallel_size=2,
                                      base_vllm_arg=("--enable-prefix-caching",))
    plan = placement.plan(options, replicas=2, visible=range(8))
    pairs = replica_configs(replicas=2, plan=plan, dev_mode=True, weight_transfer="nccl", extra_args=("--seed", "1"))
    (theta0, t0), (theta1, t1) = pairs
    assert (theta0.gpus, theta0.tensor_parallel_size, theta0.device) == ((0, 1), 2, "gpu")
    assert (theta1.gpus, t0.gpus, t1.gpus) == ((2, 3), (4,), (5,))
    assert theta0.extra_args == ("--seed", "1", "--enable-prefix-caching") and t0.extra_args == ("--seed", "1")
    # The weight-transfer engine and dev mode are the base's only.
    assert (theta0.dev_mode, theta0.weight_transfer) == (True, "nccl")
    assert (t0.dev_mode, t0.weight_transfer == WEIGHT_TRANSFER_BACKEND) == (False, True)
    ports = [c.port for pair in with_ports(pairs) for c in pair]
    assert None not in ports and len(set(ports)) == 4


def test_cpu_replica_configs_are_as_before_without_gpu_options(monkeypatch):
    monkeypatch.setattr("dualvllm.engines.launcher.is_cpu_build", lambda: True)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    plan = placement.plan(placement.ServerOptions(), replicas=1, visible=None)
    assert replica_configs(replicas=1, plan=plan) == replica_configs(replicas=1)


@pytest.mark.parametrize("value", ["none", "None", "NONE"])
def test_weight_transfer_none_means_no_engine(value):
    config = ServerConfig(model="m", port=1, device="cpu", dev_mode=True, weight_transfer=value)
    assert config.weight_transfer is None
    assert "--weight-transfer-config" not in VLLMServer(config).command()


def test_weight_transfer_without_dev_mode_or_of_an_unknown_engine_is_refused():
    with pytest.raises(InvalidInputError, match=r"--weight-transfer nccl .*add --dev-mode"):
        ServerConfig(model="m", weight_transfer="nccl")
    with pytest.raises(InvalidInputError, match=r"--weight-transfer 'nccll' is no weight-transfer engine; give one of dualvllm_shm, nccl, ipc"):
        ServerConfig(model="m", dev_mode=True, weight_transfer="nccll")
    assert ServerConfig(model="m", dev_mode=True, weight_transfer="nccl").weight_transfer == "nccl"
    assert ServerConfig(model="m").weight_transfer == WEIGHT_TRANSFER_BACKEND  # the default needs no flag


def test_the_known_engines_are_vllms_own():
    factory = pytest.importorskip("vllm.distributed.weight_transfer.factory")
    assert set(VLLM_WEIGHT_TRANSFER_BACKENDS) == set(factory.WeightTransferEngineFactory._registry)


async def test_servers_sharing_a_gpu_start_one_after_another(monkeypatch):
    events: list[tuple[str, str]] = []
    others_started = asyncio.Event()  # theta-1 and t-1, on GPUs of their own, started

    async def start(self):
        events.append((self.name, "start"))
        if {("theta-1", "start"), ("t-1", "start")} <= set(events):
            others_started.set()
        if self.name == "theta-0":  # healthy only once the servers on other GPUs have started beside it
            await asyncio.wait_for(others_started.wait(), timeout=10)
        events.append((self.name, "healthy"))

    monkeypatch.setattr(VLLMServer, "start", start)
    named = [(ServerConfig(model="m", port=p, device="gpu", gpus=gpus), name)
             for p, (gpus, name) in enumerate([((0,), "theta-0"), ((0,), "t-0"), ((1,), "theta-1"), ((2,), "t-1")], 1)]
    servers = await start_servers(named)
    assert [s.name for s in servers] == ["theta-0", "t-0", "theta-1", "t-1"]
    order = events
    assert order.index(("theta-0", "healthy")) < order.index(("t-0", "start"))  # one after another
    assert order.index(("t-1", "start")) < order.index(("theta-0", "healthy"))  # the others at once
    assert order.index(("theta-1", "start")) < order.index(("theta-0", "healthy"))


async def test_a_failed_start_stops_the_chain_and_every_server(monkeypatch):
    started: list[str] = []
    stopped: list[str] = []

    async def start(self):
        started.append(self.name)
        if self.name == "theta":
            raise ServerStartupError("theta died")

    monkeypatch.setattr(VLLMServer, "start", start)
    monkeypatch.setattr(VLLMServer, "stop", lambda self: stopped.append(self.name))
    named = [(ServerConfig(model="m", port=1, device="gpu", gpus=(0,)), "theta"),
             (ServerConfig(model="m", port=2, device="gpu", gpus=(0,)), "t")]
    with pytest.raises(ServerStartupError, match="theta died"):
        await start_servers(named)
    assert started == ["theta"] and sorted(stopped) == ["t", "theta"]


def test_visible_gpus_are_cuda_visible_devices_else_nvidia_smis(monkeypatch):
    import subprocess as sp

    from dualvllm.engines import launcher

    monkeypatch.setattr(launcher, "is_cpu_build", lambda: True)
    assert launcher.visible_gpus() is None  # the CPU build: no GPU plan
    monkeypatch.setattr(launcher, "is_cpu_build", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert launcher.visible_gpus() == (2, 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5d1f")
    with pytest.raises(InvalidInputError, match="UUID.*--base-gpus and --teacher-gpus"):
        launcher.visible_gpus()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    listing = "GPU 0: NVIDIA H100 (UUID: GPU-a)\nGPU 1: NVIDIA H100 (UUID: GPU-b)\n"
    monkeypatch.setattr(launcher.subprocess, "run", lambda *a, **k: sp.CompletedProcess(a, 0, stdout=listing))
    assert launcher.visible_gpus() == (0, 1)


def test_a_server_with_a_weight_transfer_engine_reports_its_digest_unless_given_an_extension_of_its_own():
    from dualvllm.engines.vllm_plugin.worker_extension import WORKER_EXTENSION

    def command(**options) -> list[str]:
        return VLLMServer(ServerConfig(model="m", port=1, device="cpu", **options)).command()

    with_engine = command(dev_mode=True)
    assert with_engine[with_engine.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert "--worker-extension-cls" not in command(dev_mode=True, weight_transfer="none")
    assert "--worker-extension-cls" not in command()  # no dev mode: no /collective_rpc to ask
    own = command(dev_mode=True, extra_args=("--worker-extension-cls", "mine.Extension"))
    assert own.count("--worker-extension-cls") == 1 and "mine.Extension" in own
