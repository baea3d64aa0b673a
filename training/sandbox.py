"""Run model-written code in a sandboxed subprocess with limits.

Each run gets:
- a fresh temporary directory as working directory, deleted afterwards;
- `python -I` (isolated: no user site, no PYTHON* variables) with an empty environment;
- resource limits set in the child before exec: CPU seconds, address space, file size,
  open files, number of processes (no fork bombs);
- its own session, and a wall-clock timeout after which the whole group is killed;
- no network where the OS allows it (`unshare --net`, when that works unprivileged or
  as root); `SandboxResult.network_isolated` says whether it did.

A hung or hostile completion therefore costs at most `wall_timeout_s`. This is a
defence in depth for RL on one's own machine, not a security boundary against a
determined attacker: use a container or VM for untrusted code at scale.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

# Each verdict line starts with a per-run random nonce: code that prints fake verdicts
# would have to find it in the harness's memory first.
HARNESS = """
import json, sys
def main():
    nonce, source, tests = json.loads(sys.stdin.read())
    namespace = {"__name__": "__sandbox__"}
    try:
        exec(compile(source, "<completion>", "exec"), namespace)
        loaded = True
    except BaseException:
        loaded = False
    for test in tests:
        ok = False
        if loaded:
            try:
                exec(compile(test, "<test>", "exec"), namespace)
                ok = True
            except BaseException:
                pass
        print(nonce, json.dumps(ok), flush=True)
main()
"""


class SandboxLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_timeout_s: float = Field(
        10.0, gt=0, description="Wall-clock limit of one run; the process group is killed after it."
    )
    cpu_s: int = Field(5, ge=1, description="CPU-seconds limit (RLIMIT_CPU).")
    memory_mb: int = Field(512, ge=64, description="Address-space limit (RLIMIT_AS).")
    max_file_mb: int = Field(16, ge=1, description="Largest file the code may write (RLIMIT_FSIZE).")
    max_processes: int = Field(
        32, ge=1, description="Processes the sandbox user may have (RLIMIT_NPROC); stops fork bombs."
    )
    isolate_network: bool = Field(True, description="Run in a new network namespace when the OS allows it.")


@dataclass(frozen=True)
class SandboxResult:
    passed: int  # tests that ran without raising
    total: int
    timed_out: bool
    network_isolated: bool


def run_tests(source: str, tests: list[str], limits: SandboxLimits) -> SandboxResult:
    """Exec `source`, then each test statement, in one sandboxed interpreter."""
    workdir = Path(tempfile.mkdtemp(prefix="dualvllm-sandbox-"))
    nonce = secrets.token_hex(16)
    isolated = limits.isolate_network and _can_unshare_network()
    command = [sys.executable, "-I", "-c", HARNESS]
    if isolated:
        command = ["unshare", "--net", "--", *command]
    try:
        process = subprocess.Popen(
            command,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": str(workdir)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=functools.partial(_apply_limits, limits),
            text=True,
        )
        timed_out = False
        try:
            stdout, _ = process.communicate(json.dumps([nonce, source, tests]), timeout=limits.wall_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process.pid)
            stdout, _ = process.communicate()
        finally:
            _kill_group(process.pid)  # children it left behind
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    verdicts = [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith(nonce + " ")]
    passed = sum(v.strip() == "true" for v in verdicts[: len(tests)])
    return SandboxResult(passed=passed, total=len(tests), timed_out=timed_out, network_isolated=isolated)


def _apply_limits(limits: SandboxLimits) -> None:
    """In the child, before exec."""
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_mb * mb, limits.max_file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # As root RLIMIT_NPROC is not enforced by the kernel; it still binds ordinary users.
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@functools.cache
def _can_unshare_network() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--net", "--", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
