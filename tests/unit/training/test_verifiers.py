"""Verifiers and the code sandbox: rewards for good, wrong, malformed and hostile output."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from dualvllm.training.sandbox import SandboxLimits, run_tests
from dualvllm.training.verifiers import code_reward, exact_match, math_reward, score_in_pool, verifier_pool
from tests.processes import REPO

pytest.importorskip("math_verify")


@pytest.mark.parametrize(("completion", "answer", "reward"), [
    ("64", "64", 1.0), (" 64<eos>", "64", 1.0), ("64\nmore", "64", 1.0), ("46", "64", 0.0),
    ("", "64", 0.0), (None, "64", 0.0), ("64 64", "64", 0.0),
])
def test_exact_match(completion, answer, reward):
    assert exact_match(completion, answer) == reward


@pytest.mark.parametrize(("completion", "reference", "reward"), [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("So we get \\boxed{0.5}", "\\boxed{\\frac{1}{2}}", 1.0),
    ("\\boxed{3}", "\\boxed{4}", 0.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "She sold 48/2 = 24 in May.\n#### 72", 1.0),
    ("#### 1,000", "#### 1000", 1.0),
    ("#### 71", "#### 72", 0.0),
    ("\\boxed{\\frac{1}{", "\\boxed{1}", 0.0),  # malformed LaTeX: no answer, no exception
    ("", "\\boxed{1}", 0.0),
    (None, "\\boxed{1}", 0.0),
    ("}}}{{{\\\\\\begin{array}", "#### 5", 0.0),
])
def test_math_reward(completion, reference, reward):
    assert math_reward(completion, reference) == reward


ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 5"


def test_code_reward_is_the_fraction_of_tests_passed():
    assert code_reward(ADD, TESTS) == pytest.approx(2 / 3)
    assert code_reward(f"Here you go:\n```python\n{ADD}```\nDone.", TESTS) == pytest.approx(2 / 3)
    assert code_reward("def add(a, b) return", TESTS) == 0.0  # syntax error
    assert code_reward(ADD, "") == 0.0 and code_reward(None, TESTS) == 0.0


def test_a_hung_completion_costs_only_its_timeout():
    limits = SandboxLimits(wall_timeout_s=1.0)
    started = time.monotonic()
    result = run_tests("while True:\n    pass\n", ["assert True"], limits)
    assert result.timed_out and result.passed == 0
    assert time.monotonic() - started < 10


def test_hostile_completions_are_contained(tmp_path):
    limits = SandboxLimits(wall_timeout_s=5.0, memory_mb=256)
    # Memory bomb: the address-space limit turns it into a MemoryError, not a dead machine.
    assert run_tests("x = bytearray(2 * 1024**3)", ["assert True"], limits).passed == 0
    # Writes land in a temporary directory that is gone afterwards, not in ours.
    run_tests("open('owned.txt', 'w').write('x')", ["assert True"], limits)
    assert not (tmp_path / "owned.txt").exists()
    # Forged verdicts are ignored: they lack the per-run nonce.
    forged = "print('true'); print('__result__ true'); import sys; sys.stdout.write('x true\\n')"
    assert run_tests(forged, ["assert False"], limits).passed == 0
    # The environment is bare (Python itself adds LC_CTYPE): no secrets leak in through variables.
    bare = "assert set(os.environ) <= {'PATH', 'HOME', 'LC_CTYPE'}"
    assert run_tests("import os", [bare], limits).passed == 1


def test_network_is_unreachable_when_isolation_is_available():
    code = "import socket\ns = socket.socket()\ns.settimeout(2)\n"
    test = "try:\n    s.connect(('1.1.1.1', 80))\n    reached = True\nexcept OSError:\n    reached = False\nassert not reached"
    result = run_tests(code, [test], SandboxLimits(wall_timeout_s=10))
    if not result.network_isolated:
        pytest.skip("this OS does not allow a private network namespace")
    assert result.passed == 1


async def test_scoring_runs_in_a_process_pool():
    with verifier_pool(workers=2) as pool:
        rewards = await score_in_pool(exact_match, ["64", "46", "x"], ["64", "64", "x"], pool)
        assert rewards == [1.0, 0.0, 1.0]
        assert await score_in_pool(math_reward, ["#### 3"], ["#### 3"], pool) == [1.0]
        with pytest.raises(ValueError, match="2 completions for 1 references"):
            await score_in_pool(exact_match, ["a", "b"], ["a"], pool)


# A parent that opens a verifier pool, starts its worker, prints the worker's pid and waits.
POOL_PARENT = """
import os, time
from dualvllm.training.verifiers import exact_match, verifier_pool
with verifier_pool() as pool:
    assert pool.submit(exact_match, "1", "1").result() == 1.0
    print(*[p.pid for p in pool._processes.values()], flush=True)
    time.sleep(600)
"""


def test_a_killed_parent_leaves_no_verifier_worker_behind():
    parent = subprocess.Popen([sys.executable, "-c", POOL_PARENT], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        (worker,) = (psutil.Process(int(pid)) for pid in parent.stdout.readline().split())
        assert worker.is_running() and worker.ppid() == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # SIGKILL on parent death: the worker ends at once instead of living on under init.
        _, alive = psutil.wait_procs([worker], timeout=30)
        assert not alive, f"worker {worker.pid} outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()
