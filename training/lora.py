"""Optional LoRA for the learner (peft), and saving what the server needs: full weights.

vLLM's `reload_weights` reads an ordinary Hugging Face checkpoint, so a LoRA learner is
pushed as merged weights W + (alpha / r) B A, written under the base model's own names.
They are computed next to the learner's tensors, never merged into them in place (a
merge/unmerge round trip would leave float round-off in the base weights every push). Checkpoints hold both the merged
weights (a restarted server starts on them) and the adapter (the learner resumes on it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, cast
from collections.abc import Iterator

import torch

# The projections of Qwen2/Llama-style blocks; peft's own default picks only q/v.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_DIR = "adapter"


class _Weighted(Protocol):
    weight: torch.Tensor


class _AdaptedLayer(Protocol):
    """What `merged_items` uses of a peft LoRA layer. Each concrete layer class (Linear, Embedding, the
    convolutions) defines get_delta_weight; peft's LoraLayer, the class they share, does not declare it,
    and its base layer is typed as any nn.Module."""

    active_adapters: list[str]

    def get_delta_weight(self, adapter: str) -> torch.Tensor: ...

    def get_base_layer(self) -> _Weighted: ...


def wrap(model: Any, *, rank: int, alpha: int) -> Any:
    """`model` with trainable rank-`rank` adapters on every projection; the rest frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def resume(base_dir: str, checkpoint: Path, dtype: Any) -> Any:
    """The base model from `base_dir` with the trainable adapter saved in `checkpoint`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    return PeftModel.from_pretrained(base, checkpoint / ADAPTER_DIR, is_trainable=True)


def is_lora(model: Any) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "get_base_model")


def save_full(model: Any, out_dir: Path, *, dtype: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
    """Save `model` as an ordinary HF checkpoint (merged weights if it carries LoRA adapters),
    its tensors cast to `dtype` (None: as they are) and its config saying so.

    `state_dict` is the whole model's weights when the live one holds only a shard (FSDP,
    ZeRO-3). Tensors that share storage (tied embeddings) are cast once and stay shared, so
    the checkpoint ties them as the model does.
    """
    if state_dict is None and is_lora(model):
        model, state_dict = model.get_base_model(), _merged_state(model)
    elif state_dict is None:
        state_dict = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    if dtype is not None:
        target, cast = getattr(torch, dtype), {}
        for tensor in state_dict.values():
            if _storage(tensor) not in cast:
                cast[_storage(tensor)] = tensor.to(target)
        state_dict = {name: cast[_storage(tensor)] for name, tensor in state_dict.items()}
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    if dtype is not None:
        _set_config_dtype(out_dir / "config.json", dtype)


def _merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The LoRA model's weights with W + (alpha / r) B A in place of each adapted W, under the base's names."""
    return dict(merged_items(model))


def merged_items(model: Any, *, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The LoRA model's weights under the base's names, in state-dict order, one at a time:
    each adapted W as W + (alpha / r) B A, computed when it is reached (`merge` False: W
    itself, for names and shapes without the arithmetic)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {
        f"{name}.weight": cast(_AdaptedLayer, module)  # see _AdaptedLayer: what peft's types leave out
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
    }
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        module = adapted.get(name)
        if module is None or not merge:
            yield name, tensor.detach()
            continue
        with torch.no_grad():
            delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
            yield name, module.get_base_layer().weight.detach() + delta


def adapted_names(model: Any) -> set[str]:
    """The checkpoint names of the weights a LoRA model adapts (what a push must carry)."""
    from peft.tuners.lora import LoraLayer

    return {
        f"{name}.weight" for name, module in model.get_base_model().named_modules() if isinstance(module, LoraLayer)
    }


def _storage(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return tensor.data_ptr(), tuple(tensor.shape)


def _set_config_dtype(config_path: Path, dtype: str) -> None:
    """The checkpoint's config names the dtype its tensors are in (a server started on it
    with --dtype auto then computes in that dtype)."""
    config = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config or key == "dtype":
            config[key] = dtype
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_adapter(model: Any, out_dir: Path) -> None:
    """The trainable adapter alone (for resuming), if `model` has one."""
    if is_lora(model):
        model.save_pretrained(out_dir / ADAPTER_DIR)
