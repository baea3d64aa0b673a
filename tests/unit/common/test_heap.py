"""The start-up heap is frozen while a coordinator runs and thawed when the last one closes."""

from __future__ import annotations

import gc
import weakref

from dualvllm.common import heap


def tracked(x: object) -> bool:
    """Whether the collector walks `x` (frozen objects are not in any generation)."""
    return any(y is x for y in gc.get_objects())


def test_the_last_thaw_returns_the_frozen_objects_to_the_collector():
    assert gc.get_freeze_count() == 0, "another test left the heap frozen"
    kept = [[1]]  # a list is always tracked (a dict of atoms is not)
    heap.freeze()
    try:
        assert gc.get_freeze_count() > 0 and not tracked(kept)
        heap.freeze()  # a second coordinator
        heap.thaw()
        assert gc.get_freeze_count() > 0 and not tracked(kept), "one coordinator still runs"
    finally:
        heap.thaw()
    assert gc.get_freeze_count() == 0 and tracked(kept)
    heap.thaw()  # one too many (a close after a failed start): no error, nothing to thaw
    assert gc.get_freeze_count() == 0


def test_garbage_made_before_the_freeze_is_collected_not_frozen():
    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the collector frees it
    alive = weakref.ref(node)
    del node
    heap.freeze()
    try:
        assert alive() is None, "the cycle was frozen instead of freed"
    finally:
        heap.thaw()
