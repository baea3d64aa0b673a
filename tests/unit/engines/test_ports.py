"""Ports reserved across processes until their server listens (engines/ports.py)."""

from __future__ import annotations

import subprocess
import sys

from dualvllm.engines import ports

# In a second process: whether it could take the given port's lock now (and then lets it go).
OTHER_PROCESS_LOCKS = "import sys; from dualvllm.engines import ports; print(ports._lock(int(sys.argv[1])))"


def other_process_can_take(port: int) -> bool:
    answer = subprocess.run([sys.executable, "-c", OTHER_PROCESS_LOCKS, str(port)], capture_output=True, text=True,
                            timeout=60, check=True)
    return answer.stdout.strip() == "True"


def test_a_reserved_port_is_refused_to_another_process_until_released():
    port = ports.reserve_port()
    try:
        assert not other_process_can_take(port)
    finally:
        ports.release(port)
    assert other_process_can_take(port)


def test_one_process_never_hands_out_a_port_twice_while_it_is_reserved():
    reserved = [ports.reserve_port() for _ in range(40)]
    try:
        assert len(set(reserved)) == len(reserved)
    finally:
        for port in reserved:
            ports.release(port)


def test_a_dead_process_holds_no_port():
    holder = subprocess.Popen([sys.executable, "-c", "from dualvllm.engines import ports; "
                               "print(ports.reserve_port(), flush=True); input()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        assert not other_process_can_take(port)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert other_process_can_take(port)
