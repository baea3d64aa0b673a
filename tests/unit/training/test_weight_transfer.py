"""The trainer side of the in-memory weight push (dualvllm.training.weight_transfer), against a receiver
that reads the shared-memory segments as the server's engine does.

The server side (engines/vllm_plugin/weight_transfer.py) runs inside real vLLM servers in
tests/integration/test_weight_transfer.py.
"""

from __future__ import annotations

import mmap
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.base import layerwise_groups  # noqa: E402

from dualvllm.engines.weight_digest import PushDigest  # noqa: E402
from dualvllm.engines.weight_transfer import ShmInitInfo, ShmUpdateInfo, segment_path  # noqa: E402
from dualvllm.training import lora  # noqa: E402
from tests.segments import left_behind, record_segments  # noqa: E402
from dualvllm.training.weight_transfer import (  # noqa: E402
    LearnerSource,
    SharedMemoryTrainerEngine,
    ShmTrainerInitInfo,
    WeightTransferTrainerFactory,
)


def small_model(tied: bool = False):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    return transformers.Qwen3ForCausalLM(config)


class Receiver:
    """What the server's engine does with each phase, minus vLLM: reads every chunk's tensors
    out of its segment (a copy, as load_weights makes) and records the calls."""

    def __init__(self, fail_on_chunk: int | None = None) -> None:
        self.calls: list[str] = []
        self.received: dict[str, torch.Tensor] = {}
        self.chunks: list[list[str]] = []
        self.version: str | None = None
        self.digest = PushDigest()
        self._fail_on_chunk = fail_on_chunk

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        info = ShmInitInfo(**init_info)
        self.calls.append("init")
        assert segment_path(info.segment).read_bytes()[:len(info.token)].decode() == info.token

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:
        info = ShmUpdateInfo(**update_info)
        self.calls.append("update")
        if self._fail_on_chunk == len(self.chunks):
            raise RuntimeError("the server died")
        fd = os.open(segment_path(info.segment), os.O_RDWR)
        with mmap.mmap(fd, 0) as buffer:
            for name, dtype, shape, offset in zip(info.names, info.dtype_names, info.shapes, info.offsets):
                count = int(torch.Size(shape).numel())
                view = torch.frombuffer(buffer, dtype=getattr(torch, dtype), count=count, offset=offset)
                self.received[name] = view.view(shape).clone()
                del view
                # As the server's engine digests each tensor it hands to load_weights.
                self.digest.add(name, dtype, shape, memoryview(buffer)[offset:offset + count * getattr(torch, dtype).itemsize])
        os.close(fd)
        self.chunks.append(info.names)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        self.version = weight_version


def push(model, receiver: Receiver, *, dtype=torch.bfloat16, chunk_bytes: int = 1 << 20, only=None):
    source = LearnerSource(model, dtype, only=only)
    init = ShmTrainerInitInfo(rank=0, chunk_bytes=chunk_bytes, weight_version="step-3")
    engine = WeightTransferTrainerFactory.trainer_init(init, client=receiver, source=source)
    assert isinstance(engine, SharedMemoryTrainerEngine)
    engine.send_weights()
    return engine.stats


@pytest.fixture
def segments_made(monkeypatch) -> list[str]:
    return record_segments(monkeypatch)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_weight_arrives_in_the_servers_dtype_in_chunks_of_whole_layers(tied, segments_made):
    model = small_model(tied)
    receiver = Receiver()
    stats = push(model, receiver, chunk_bytes=150_000)
    state = model.state_dict()
    expected = {n for n in state if not (tied and n == "lm_head.weight")}  # tied: stored once, as on disk
    assert set(receiver.received) == expected
    for name in expected:
        assert receiver.received[name].dtype == torch.bfloat16
        assert torch.equal(receiver.received[name], state[name].to(torch.bfloat16)), name
    assert receiver.calls[:2] == ["init", "start"] and receiver.calls[-1] == "finish"
    assert receiver.version == "step-3"
    assert stats.chunks == len(receiver.chunks) > 1 and stats.tensors == len(expected)
    assert stats.bytes >= sum(t.numel() * 2 for n, t in state.items() if n in expected)
    groups = layerwise_groups([m.name for m in LearnerSource(model, torch.bfloat16).metadata()])
    for group in groups:  # no decoder layer is split between two chunks
        assert sum(any(name in chunk for name in group) for chunk in receiver.chunks) == 1, group
    assert not left_behind(segments_made)  # every segment unlinked
    assert model.lm_head.weight.dtype == torch.float32  # the learner's weights are untouched


def test_a_float32_push_is_bit_exact():
    model = small_model()
    receiver = Receiver()
    push(model, receiver, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(receiver.received[name], tensor), name


def independent_digest(model, dtype, only=None) -> str:
    """The push digest of `model`'s weights in `dtype`, by the definition, from the tensors themselves."""
    digest = PushDigest()
    for name, tensor in LearnerSource(model, dtype, only=only):
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        digest.add(name, str(dtype).removeprefix("torch."), list(tensor.shape), raw)
    return digest.hexdigest()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_trainer_digests_what_it_sends_as_the_server_digests_what_it_loads(dtype):
    model = small_model()
    receiver = Receiver()
    stats = push(model, receiver, dtype=dtype, chunk_bytes=150_000)
    assert stats.digest == receiver.digest.hexdigest() == independent_digest(model, dtype)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0  # one weight of one tensor
    changed = push(model, Receiver(), dtype=dtype, chunk_bytes=1 << 20)  # other chunks: the same digest rules
    assert changed.digest != stats.digest and changed.digest == independent_digest(model, dtype)


def test_a_chunk_the_server_fails_still_finishes_the_update_and_leaves_no_segment(segments_made):
    model = small_model()
    receiver = Receiver(fail_on_chunk=1)
    with pytest.raises(RuntimeError, match="the server died"):
        push(model, receiver, chunk_bytes=150_000)
    # finish puts back the old tensors of the layers that got nothing; the server keeps serving
    assert receiver.calls == ["init", "start", "update", "update", "finish"]
    assert receiver.version is None  # the failed update is not tagged as a version
    assert not left_behind(segments_made)


def test_a_lora_push_sends_merged_weights_and_can_be_limited_to_adapted_layers():
    peft = pytest.importorskip("peft")
    model = small_model()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():  # a trained adapter: B is zero at initialization
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_()
    merged = lora._merged_state(adapted)
    receiver = Receiver()
    push(adapted, receiver, dtype=torch.float32)
    assert set(receiver.received) == set(merged)
    for name, tensor in merged.items():
        assert torch.equal(receiver.received[name], tensor), name
    moved = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(merged[moved], adapted.get_base_model().state_dict()[moved.replace(
        "q_proj.weight", "q_proj.base_layer.weight")])  # the adapter changed it

    only = Receiver()
    stats = push(adapted, only, dtype=torch.float32, only=lora.adapted_names(adapted))
    # Whole decoder layers only (vLLM loads a layer whole or keeps the old one): layer 1, all of it.
    assert set(only.received) == {n for n in merged if n.startswith("model.layers.1.")}
    assert stats.bytes < sum(t.numel() * 4 for t in merged.values()) / 3
