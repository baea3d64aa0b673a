"""dualvllm.tinymodels.shapes: random Qwen3 pairs at a real shape, built into a temporary cache.

The small pair is built once for the module (~10 s on 2 cores) and once more to check that a
rebuild writes the same bytes; the other tests read those two builds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer, Qwen3ForCausalLM, TokenizersBackend

from dualvllm.common.errors import InvalidInputError
from dualvllm.tinymodels import shapes
from dualvllm.tinymodels.shapes import (ENTROPY_RANGE_NATS, QWEN3_VOCAB_SIZE, SHAPES, build_tokenizer, cache_root, ensure_pair,
                               model_config, pair_dir)

MULTIBYTE = ("é", "数学", "🙂", "naïve café, 数学は楽しい 🚀\n\tdone")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """As the build runs: on a loaded machine a thread team stalls at every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    """The pair in the user's cache, as every other user of it finds it (the integration tests at
    this shape build it there too: one build per CI run; test_a_rebuild_writes_identical_bytes
    builds a second one from scratch)."""
    return ensure_pair("small")


@pytest.fixture(scope="module")
def tokenizer(pair):
    return AutoTokenizer.from_pretrained(pair[0])


def report(pair) -> dict:
    return json.loads((pair[0].parent / "shape_report.json").read_text())


def test_an_unknown_shape_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(InvalidInputError, match="unknown model shape 'tiny'; known shapes: small, qwen3-0.6b"):
        ensure_pair("tiny", root=tmp_path)


def test_the_pair_is_one_cache_directory_named_for_shape_tiedness_and_recipe(pair):
    base, teacher = pair
    root = base.parent.parent
    assert base.parent == teacher.parent == pair_dir("small", root=root)
    assert base.name == "base" and teacher.name == "teacher"
    assert base.parent.name == f"small-untied-{report(pair)['key']}"
    assert pair_dir("small", tied=True, root=root).name.startswith("small-tied-")
    assert base.parent.is_dir() and not list(root.glob(f".tmp-{base.parent.name}*"))  # no temporary left


def test_the_models_have_qwen3s_vocabulary_positions_and_dtype(pair):
    config = json.loads((pair[0] / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == QWEN3_VOCAB_SIZE == 151_936
    assert config["max_position_embeddings"] >= 4096 and config["head_dim"] == 64
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    with safe_open(pair[0] / "model.safetensors", "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [151_936, 128]
        assert f.get_slice("lm_head.weight").get_shape() == [151_936, 128]
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
    assert 35e6 < report(pair)["parameters"] < 45e6
    assert report(pair)["embedding_parameters"] == 2 * 151_936 * 128


def test_the_tokenizer_fills_the_vocabulary_and_speaks_chatml(pair, tokenizer):
    assert len(tokenizer) == 151_936 and type(tokenizer).__name__ == "Qwen2Tokenizer"
    trained = report(pair)["tokenizer"]["trained_tokens"]
    assert 6_000 <= trained <= 16_384  # what a quarter-megabyte of prose yields below the 16k asked
    assert tokenizer.convert_ids_to_tokens([trained, trained + 1, trained + 2, 151_935]) == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", f"<|reserved_{151_935 - trained - 3}|>"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None  # Qwen3 has none: nothing is prepended to a prompt
    generation = json.loads((pair[0] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [trained + 2, trained] and generation["pad_token_id"] == trained
    assert json.loads((pair[0] / "config.json").read_text())["eos_token_id"] == trained + 2
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == rendered.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == trained + 1 and ids.count(trained + 2) == 2  # the special tokens are one id each


def test_multibyte_text_round_trips_and_every_loader_splits_text_alike(pair, tokenizer):
    """AutoTokenizer rebuilds a Qwen2Tokenizer from the vocabulary and merges; tokenizer.json
    as written (what a generic loader reads) must encode every text to the same ids."""
    as_written = Tokenizer.from_file(str(pair[0] / "tokenizer.json"))
    generic = TokenizersBackend.from_pretrained(pair[0])
    for text in MULTIBYTE:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert as_written.encode(text, add_special_tokens=False).ids == ids == generic(text)["input_ids"]
    # No BPE merge builds a reserved token: its name in text is ordinary text.
    assert len(tokenizer("<|reserved_7|>", add_special_tokens=False)["input_ids"]) > 1


def test_base_and_teacher_share_the_tokenizer_and_correlated_but_different_weights(pair):
    base, teacher = pair
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (base / name).read_bytes() == (teacher / name).read_bytes()
    b, t = load_file(base / "model.safetensors"), load_file(teacher / "model.safetensors")
    assert b.keys() == t.keys()
    assert torch.equal(b["model.norm.weight"], t["model.norm.weight"])  # constants are shared
    for name in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight"):
        x, y = b[name].float().flatten(), t[name].float().flatten()
        assert not torch.equal(x, y)
        assert torch.corrcoef(torch.stack([x, y]))[0, 1].item() == pytest.approx(SHAPES["small"].teacher_correlation,
                                                                                abs=0.005)


def test_next_token_distributions_are_peaked_and_the_models_disagree(pair):
    measured = report(pair)["measured"]
    for model in ("base", "teacher"):
        assert ENTROPY_RANGE_NATS[0] <= measured[model]["entropy_nats"] <= ENTROPY_RANGE_NATS[1]
        assert measured[model]["top20_mass"] > 0.5  # a top-20 holds most of the mass
        assert measured[model]["reserved_mass"] < 0.05  # padding rows are rarely sampled
        assert measured[model]["repeat_mass"] < 0.1  # no degenerate echo of the current token
    assert 0.2 < measured["kl_nats"]["base_teacher"] < 5.0
    assert 0.2 < measured["top20_overlap"] < 0.9


def test_the_report_matches_the_models_own_logits(pair, tokenizer):
    """The measured entropy and KL, recomputed apart (torch.distributions, F.kl_div) on the
    recorded contexts: the measured texts, each continued by the base's own tokens."""
    measured = report(pair)["measured"]
    contexts = measured["contexts"]
    assert len(contexts) == len(shapes.MEASURE_TEXTS) + 1 and measured["positions"] == sum(map(len, contexts))
    chat = tokenizer.apply_chat_template(list(shapes.MEASURE_CHAT), add_generation_prompt=True, return_dict=False)
    assert contexts[-1][:len(chat)] == chat and len(contexts[-1]) == len(chat) + shapes.SAMPLED_TOKENS
    logits = []
    for path in pair:
        model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            logits.append(torch.cat([model(torch.tensor([ids])).logits[0] for ids in contexts]))  # [positions, vocab]
    base, teacher = (torch.distributions.Categorical(logits=x) for x in logits)
    assert base.entropy().mean().item() == pytest.approx(measured["base"]["entropy_nats"], abs=2e-3)
    assert teacher.entropy().mean().item() == pytest.approx(measured["teacher"]["entropy_nats"], abs=2e-3)
    kl = torch.nn.functional.kl_div(teacher.logits, base.logits, log_target=True, reduction="none").sum(-1)
    assert kl.mean().item() == pytest.approx(measured["kl_nats"]["base_teacher"], abs=2e-3)


def test_a_rerun_reuses_the_pair(pair, monkeypatch):
    monkeypatch.setattr(shapes, "build_pair", lambda *a: pytest.fail("rebuilt a cached pair"))
    assert ensure_pair("small", root=pair[0].parent.parent) == pair


def test_a_rebuild_writes_identical_bytes(pair, tmp_path):
    again = ensure_pair("small", root=tmp_path)
    assert again[0].parent.name == pair[0].parent.name
    for first, second in zip(pair, again):
        for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
            assert (first / name).read_bytes() == (second / name).read_bytes(), f"{first.name}/{name} differs"


def fake_build(shape, tied, out):
    """Writes the files a complete pair has, in a moment."""
    for path in ("base/model.safetensors", "teacher/model.safetensors", "teacher/tokenizer.json", "shape_report.json"):
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text("{}")


def test_a_killed_build_leaves_no_pair_and_the_next_build_sweeps_its_remains(tmp_path, monkeypatch):
    def killed(shape, tied, out):
        (out / "base").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(shapes, "build_pair", killed)
    with pytest.raises(KeyboardInterrupt):
        ensure_pair("small", root=tmp_path)
    final = pair_dir("small", root=tmp_path)
    assert not final.exists() and not list(tmp_path.glob(".tmp-*"))
    (tmp_path / f".tmp-{final.name}-sigkilled").mkdir()  # what a SIGKILL leaves
    monkeypatch.setattr(shapes, "build_pair", fake_build)
    assert ensure_pair("small", root=tmp_path) == (final / "base", final / "teacher")
    assert not list(tmp_path.glob(".tmp-*"))


def test_an_incomplete_pair_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(shapes, "build_pair", fake_build)
    base, _ = ensure_pair("small", root=tmp_path)
    (base / "model.safetensors").unlink()
    ensure_pair("small", root=tmp_path)
    assert (base / "model.safetensors").is_file()


def test_the_key_follows_every_input_of_the_build(monkeypatch):
    small = SHAPES["small"]
    key = shapes.pair_key(small, False)
    assert key == shapes.pair_key(small, False) != shapes.pair_key(small, True)
    assert key != shapes.pair_key(dataclasses.replace(small, logit_std=3.0), False)
    monkeypatch.setattr(shapes, "RECIPE", dataclasses.replace(shapes.RECIPE, teacher_seed=7))
    assert shapes.pair_key(small, False) != key
    monkeypatch.undo()
    monkeypatch.setattr(shapes, "BUILDER_VERSION", shapes.BUILDER_VERSION + 1)
    assert shapes.pair_key(small, False) != key
    monkeypatch.undo()
    edited = dataclasses.replace(shapes.corpus(), sha256="0" * 64)
    monkeypatch.setattr(shapes, "corpus", lambda: edited)
    assert shapes.pair_key(small, False) != key


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DUALVLLM_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path / "shapes"
    monkeypatch.delenv("DUALVLLM_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "dualvllm" / "shapes"
    assert cache_root(tmp_path) == tmp_path


def test_qwen3_0_6b_is_the_published_config(pair):
    """Qwen/Qwen3-0.6B's config.json: 0.6B parameters, 0.44B of them outside the embedding."""
    shape = SHAPES["qwen3-0.6b"]
    assert (shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads, shape.num_key_value_heads,
            shape.head_dim, shape.intermediate_size, shape.vocab_size, shape.max_position_embeddings,
            shape.rope_theta, shape.rms_norm_eps) == (1024, 28, 16, 8, 128, 3072, 151_936, 40_960, 1e6, 1e-6)
    trained = report(pair)["tokenizer"]["trained_tokens"]
    with torch.device("meta"):
        model = Qwen3ForCausalLM(model_config(shape, True, trained))
    per_layer = 1024 * 2048 * 2 + 1024 * 1024 * 2 + 3 * 1024 * 3072 + 2 * 128 + 2 * 1024
    assert sum(p.numel() for p in model.parameters()) == 151_936 * 1024 + 28 * per_layer + 1024 == 596_049_920
    assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_theta"] == 1e6


def test_the_tokenizer_build_fills_any_vocabulary_size():
    shape = dataclasses.replace(SHAPES["small"], vocab_size=20_000)
    tokenizer, trained = build_tokenizer(("some text, encore du texte, 数学",) * 50, shape)
    assert len(tokenizer) == 20_000 and trained < 1_000
    assert tokenizer.convert_ids_to_tokens(trained + 2) == "<|im_end|>"


def test_the_build_command_prints_the_pair_it_ensures(pair, capsys):
    from dualvllm.tinymodels.build import main

    assert main(["--shape", "small", "--cache-dir", str(pair[0].parent.parent)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(pair[0]), str(pair[1])]
    with pytest.raises(SystemExit):
        main(["--tied"])  # only with --shape
    assert "--tied and --cache-dir go with --shape" in capsys.readouterr().err
