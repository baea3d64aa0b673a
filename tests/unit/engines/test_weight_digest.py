"""The digest of a weight push (dualvllm.engines.weight_digest): what changes it and what does not."""

from __future__ import annotations

import itertools

import pytest

from dualvllm.engines.weight_digest import PushDigest, short, tensor_digest

TENSORS = [
    ("model.embed_tokens.weight", "bfloat16", [4, 2], bytes(range(16))),
    ("model.layers.0.mlp.up_proj.weight", "bfloat16", [2, 2], bytes([7, 0, 1, 2, 3, 4, 5, 6])),
    ("lm_head.weight", "bfloat16", [2, 4], bytes(range(100, 116))),
]


def digest(tensors=TENSORS) -> str:
    push = PushDigest()
    for name, dtype, shape, data in tensors:
        push.add(name, dtype, shape, data)
    return push.hexdigest()


def test_the_order_of_arrival_does_not_matter():
    assert len({digest(list(order)) for order in itertools.permutations(TENSORS)}) == 1


def test_a_memoryview_and_bytes_of_the_same_data_digest_alike():
    name, dtype, shape, data = TENSORS[0]
    assert tensor_digest(name, dtype, shape, memoryview(bytearray(data))) == tensor_digest(name, dtype, shape, data)


def changed(index: int, field: int, value) -> list:
    tensors = [list(t) for t in TENSORS]
    tensors[index][field] = value
    return [tuple(t) for t in tensors]


@pytest.mark.parametrize("byte", range(16))
def test_any_byte_changed_changes_the_digest(byte):
    data = bytearray(TENSORS[0][3])
    data[byte] ^= 1
    assert digest(changed(0, 3, bytes(data))) != digest()


@pytest.mark.parametrize("tensors", [
    changed(0, 0, "model.embed_tokens.weight2"),  # another name
    changed(0, 1, "float16"),  # the same bytes read as another dtype
    changed(0, 2, [2, 4]),  # the same bytes in another shape
    changed(0, 2, [8]),
    TENSORS[:2],  # a tensor fewer
    TENSORS + [TENSORS[0]],  # a tensor sent twice
], ids=["name", "dtype", "shape", "rank", "fewer", "twice"])
def test_a_name_dtype_shape_or_tensor_set_changed_changes_the_digest(tensors):
    assert digest(tensors) != digest()


def test_two_tensors_swapping_their_bytes_change_the_digest():
    a, b = TENSORS[0], TENSORS[2]
    swapped = [(a[0], a[1], a[2], b[3]), TENSORS[1], (b[0], b[1], b[2], a[3])]
    assert digest(swapped) != digest()


def test_fields_cannot_run_into_each_other():
    # Moving a character between the name and the dtype name must not give the same header.
    assert tensor_digest("ab", "c", [1], b"x") != tensor_digest("a", "bc", [1], b"x")
    assert tensor_digest("a", "b", [1, 11], b"") != tensor_digest("a", "b", [11, 1], b"")


def test_an_empty_push_has_a_digest_of_its_own_and_short_shows_twelve_digits():
    assert PushDigest().hexdigest() != digest() and len(digest()) == 32
    assert short(digest()) == digest()[:12] and short(None) == "none"


def test_the_worker_extension_reports_its_engine_s_last_digest_or_none():
    from types import SimpleNamespace

    from dualvllm.engines.vllm_plugin.worker_extension import WeightDigestExtension

    class Worker(WeightDigestExtension):  # as vLLM mixes it into its worker
        def __init__(self, engine) -> None:
            self.weight_transfer_engine = engine

    assert Worker(SimpleNamespace(last_digest=digest())).dualvllm_weight_digest() == digest()
    assert Worker(SimpleNamespace(last_digest=None)).dualvllm_weight_digest() is None  # no update finished
    assert Worker(SimpleNamespace()).dualvllm_weight_digest() is None  # an engine that does not digest (nccl)
    assert Worker(None).dualvllm_weight_digest() is None  # no weight-transfer engine
