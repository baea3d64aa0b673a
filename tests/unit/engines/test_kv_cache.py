"""The KV cache a CPU server reserves (engines/kv_cache.py)."""

from __future__ import annotations

import json

import pytest

from dualvllm import tinymodels
from dualvllm.engines import kv_cache
from dualvllm.engines.launcher import ServerConfig, VLLMServer


def model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


QWEN3_06B = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 hidden_size=1024, max_position_embeddings=40960, torch_dtype="bfloat16")


def test_a_tiny_model_gets_what_a_full_batch_of_its_longest_sequences_needs_at_least_the_floor(tmp_path):
    # The bundled models: 2 layers x 2 KV heads x 32 dims x 4 bytes x 2 (K, V) = 1 KiB a token, 64 tokens.
    tiny = kv_cache.cache_bytes(str(tinymodels.BASE_DIR), dtype="float32", max_model_len=None, given_gib=None)
    assert tiny == kv_cache.FLOOR_BYTES
    wider = model_dir(tmp_path, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, hidden_size=512,
                      max_position_embeddings=512)
    per_token = 2 * 4 * 4 * 64 * 2  # bf16 when the config names no dtype
    assert kv_cache.cache_bytes(wider, dtype="auto", max_model_len=None, given_gib=None) == 2 * 256 * 512 * per_token


def test_a_real_model_keeps_the_1_gib_cap_and_a_shorter_context_needs_less(tmp_path):
    real = model_dir(tmp_path, **QWEN3_06B)
    assert kv_cache.cache_bytes(real, dtype="auto", max_model_len=None, given_gib=None) == kv_cache.GIB
    per_token = 2 * 28 * 8 * 128 * 2  # 112 KiB: 2 x 256 sequences of 8 tokens take 448 MiB
    assert kv_cache.cache_bytes(real, dtype="auto", max_model_len=8, given_gib=None) == 2 * 256 * 8 * per_token


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "/no/such/model"])
def test_a_model_not_on_this_machine_gets_the_cap(model):
    assert kv_cache.cache_bytes(model, dtype="auto", max_model_len=None, given_gib=None) == kv_cache.GIB


def test_the_users_size_wins_in_fractions_of_a_gib(tmp_path):
    real = model_dir(tmp_path, **QWEN3_06B)
    assert kv_cache.cache_bytes(real, dtype="auto", max_model_len=None, given_gib=4) == 4 * kv_cache.GIB
    server = VLLMServer(ServerConfig(model=str(tinymodels.BASE_DIR), port=1, device="cpu", kv_cache_space_gib=0.25))
    assert server.kv_cache_bytes == kv_cache.GIB // 4
