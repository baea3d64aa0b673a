"""Optional LoRA for the learner (peft), and saving what the server needs: full weights.

vLLM's `reload_weights` reads an ordinary Hugging Face checkpoint, so a LoRA learner is
pushed as merged weights W + (alpha / r) B A, written under the base model's own names.
They are computed next to the learner's tensors, never merged into them in place (a
merge/unmerge round trip would leave float round-off in the base weights every push). Checkpoints hold both the merged
weights (a restarted server starts on them) and the adapter (the learner resumes on it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The projections of Qwen2/Llama-style blocks; peft's own default picks only q/v.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_DIR = "adapter"


def wrap(model: Any, *, rank: int, alpha: int) -> Any:
    """`model` with trainable rank-`rank` adapters on every projection; the rest frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(TARGET_MODULES),
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def resume(base_dir: str, checkpoint: Path, dtype: Any) -> Any:
    """The base model from `base_dir` with the trainable adapter saved in `checkpoint`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    return PeftModel.from_pretrained(base, checkpoint / ADAPTER_DIR, is_trainable=True)


def is_lora(model: Any) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "get_base_model")


def save_full(model: Any, out_dir: Path) -> None:
    """Save `model` as an ordinary HF checkpoint (merged weights if it carries LoRA adapters)."""
    if not is_lora(model):
        model.save_pretrained(out_dir, safe_serialization=True)
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = {name.replace(".base_layer.", "."): tensor.detach()
             for name, tensor in base.state_dict().items() if "lora_" not in name}
    with torch.no_grad():
        for module_name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
                state[f"{module_name}.weight"] = module.get_base_layer().weight.detach() + delta
    base.save_pretrained(out_dir, state_dict=state, safe_serialization=True)


def save_adapter(model: Any, out_dir: Path) -> None:
    """The trainable adapter alone (for resuming), if `model` has one."""
    if is_lora(model):
        model.save_pretrained(out_dir / ADAPTER_DIR)
