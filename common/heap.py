"""The start-up heap, frozen while a coordinator runs, so that full garbage collections skip it.

Python's cyclic collector runs a full (oldest-generation) collection every few hundred young
ones, and each walks every tracked object in the process: after start-up ~140,000 objects
(numba, scipy, aiohttp, pydantic...), none of them garbage. Measured on commit b1e3ad0 with
`python benchmarks/coordinator_capacity.py --batch 256 1024` (with and without `--no-freeze`,
alternated twice, 64-token sequences; a full collection every 37,000-66,000 tokens then),
garbage collection took 9.5-10.7% of the coordinator's CPU at batch 256 and 18.3-19.6% at
batch 1,024 with the heap left alone, and 1.5-1.6% and 6.2-6.4% with it frozen
(benchmarks/README.md, "Garbage collection").

`gc.freeze()` moves every object alive now into a permanent generation that collections
skip, as vLLM does in its own servers once they are up (vllm/utils/gc_utils.py). Frozen
objects are still freed by reference counting; only a cycle among them would wait for
`thaw`. So the young generations are collected first (start-up's own garbage: a full
collection would walk the whole heap again, 0.1 s in a process that imported torch), and the
last coordinator to close thaws the heap.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0  # coordinators running with the heap frozen


def freeze() -> None:
    """Collect the young generations, then freeze every object alive now; pair with `thaw`."""
    global _holders
    with _lock:
        gc.collect(1)
        gc.freeze()
        _holders += 1


def thaw() -> None:
    """Undo one `freeze`; the last one returns the frozen objects to the collector."""
    global _holders
    with _lock:
        _holders = max(_holders - 1, 0)
        if _holders == 0:
            gc.unfreeze()
