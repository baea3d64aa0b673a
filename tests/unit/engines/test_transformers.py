"""The in-process transformers engine: exact against a plain forward pass, KV cache
across steps, and q* sampling through the whole coordinator path checked by chi-square."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.common.errors import InvalidInputError, LifecycleError
from tests.exact_q import chi_square_pvalue, exact_q_star

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from dualvllm.engines.transformers_engine import TransformersEngine, topk_logprobs  # noqa: E402


def reference_logprobs(model, context: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([context])).logits[0, -1].double(), -1).numpy()


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv-cache", "recompute"])
async def test_logprobs_equal_a_plain_forward_pass_across_steps(kv_cache):
    reference = transformers.AutoModelForCausalLM.from_pretrained(tinymodels.TEACHER_DIR).eval()
    rng = np.random.default_rng(0)
    async with TransformersEngine(tinymodels.TEACHER_DIR, kv_cache=kv_cache) as engine:
        contexts = [await engine.tokenize(p) for p in ["12+34=", "5", "99+1"]]
        for step in range(4):
            got = await engine.next_token_logprobs(contexts)
            for row, context in enumerate(contexts):
                np.testing.assert_allclose(got[row], reference_logprobs(reference, context), atol=1e-4)
            contexts = [c + [int(rng.integers(2, 90))] for c in contexts]
            if step == 1:
                contexts = contexts[1:] + [await engine.tokenize("7+")]  # one leaves, one joins
        hits = engine.scorer.cache_hits
    # Steps 2-4 run 3, 2 (+ the joiner's prefill) and 3 rows on cached keys/values.
    assert hits == (3 + 2 + 3 if kv_cache else 0)


async def test_top_k_is_sorted_and_k_above_the_vocabulary_returns_everything():
    async with TransformersEngine(tinymodels.BASE_DIR) as engine:
        context = [await engine.tokenize("12+34=")]
        full = (await engine.next_token_logprobs(context))[0]
        top = await engine.next_token_topk(context, 5)
        everything = await engine.next_token_topk(context, 10_000)
    np.testing.assert_array_equal(top.token_ids[0], np.argsort(-full)[:5])
    # The top-k's normalizer is a float32 sum over the row, the full distribution's a float64 one.
    np.testing.assert_allclose(top.logprobs[0], np.sort(full)[::-1][:5], rtol=0, atol=1e-6)
    assert everything.token_ids.shape == (1, full.shape[0])
    assert sorted(everything.token_ids[0]) == list(range(full.shape[0]))


@pytest.mark.parametrize("vocab", [98, 4096, 19_029, 151_936], ids=["no-blocks", "whole-blocks", "tail", "qwen"])
def test_top_k_from_logits_equals_a_full_sort(vocab):
    # Rows built so the top 20 sit in one block of 64, past the last whole block, one per
    # block, or anywhere.
    rng = np.random.default_rng(vocab)
    logits = rng.normal(0.0, 3.0, (4, vocab))
    logits[0, 64:84] += 50.0
    logits[1, -(vocab % 64 or 20):] += 50.0
    logits[2, ::64][:20] += 50.0
    ids, logprobs = topk_logprobs(torch.tensor(logits, dtype=torch.float32), 20)
    full = torch.log_softmax(torch.tensor(logits, dtype=torch.float32).double(), dim=-1).numpy()
    np.testing.assert_array_equal(ids, np.argsort(-full, axis=1)[:, :20])
    np.testing.assert_allclose(logprobs, np.take_along_axis(full, ids, axis=1), rtol=0, atol=1e-6)


async def test_misuse_gets_clear_errors(tmp_path):
    engine = TransformersEngine(tinymodels.BASE_DIR)
    with pytest.raises(LifecycleError, match="async with"):
        await engine.tokenize("1")
    with pytest.raises(InvalidInputError, match="does not exist"):
        async with TransformersEngine(tmp_path / "nothing"):
            pass
    async with engine:
        with pytest.raises(InvalidInputError, match="non-empty context"):
            await engine.next_token_logprobs([[]])
        assert await engine.eos_token_ids() == frozenset({1})
        assert await engine.detokenize(await engine.tokenize("12+34= 64")) == "12+34= 64"


async def first_token_matches_q_star(theta_dir, t_dir, prompt: str, temperature: float, draws: int, seed: int):
    async with TransformersEngine(theta_dir, name="theta") as theta, TransformersEngine(t_dir, name="t") as t:
        context = [await theta.tokenize(prompt)]
        lp, lr = (await theta.next_token_logprobs(context))[0], (await t.next_token_logprobs(context))[0]
        q, alpha = exact_q_star(lp, lr, temperature)
        # In-process engines take any batch; vLLM's limit on prompts per request does not apply.
        config = CoordinatorConfig(top_k=lp.shape[0], max_batch_size=draws, max_prompts_per_request=draws)
        async with DualVLLMCoordinator(config, theta_engine=theta, t_engine=t) as c:
            outputs = await c.generate_batch([prompt] * draws, max_tokens=1, temperature=temperature, seed=seed)
    np.testing.assert_allclose([o.alpha_history[0] for o in outputs], alpha, atol=1e-5)
    return chi_square_pvalue(np.array([o.generated_tokens[0] for o in outputs]), q), q


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
async def test_sampled_tokens_follow_exact_q_star(temperature):
    pvalue, _ = await first_token_matches_q_star(tinymodels.BASE_DIR, tinymodels.TEACHER_DIR, "4",
                                                 temperature, draws=2000, seed=int(temperature * 10))
    assert pvalue > 1e-3


async def test_sampling_is_exact_for_models_that_barely_overlap(tmp_path):
    # Two random tiny models with a large initializer: each puts most of its mass on a
    # different token, so q* has to split between two near-disjoint distributions.
    dirs = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        config = transformers.AutoConfig.from_pretrained(tinymodels.BASE_DIR)
        config.initializer_range = 1.0
        model = transformers.Qwen2ForCausalLM(config)
        out = tmp_path / f"m{seed}"
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(tinymodels.BASE_DIR / name, out / name)
        dirs.append(out)
    pvalue, q = await first_token_matches_q_star(dirs[0], dirs[1], "12", 1.0, draws=2000, seed=7)
    async with TransformersEngine(dirs[0]) as a, TransformersEngine(dirs[1]) as b:
        context = [await a.tokenize("12")]
        p, r = np.exp((await a.next_token_logprobs(context))[0]), np.exp((await b.next_token_logprobs(context))[0])
    assert np.sum(np.sqrt(p * r)) < 0.3, "precondition: the two models barely overlap"
    assert pvalue > 1e-3


async def test_a_live_engine_samples_the_weights_as_updated_and_drops_its_cache():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tinymodels.BASE_DIR, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    context = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    async with TransformersEngine.live(model, tokenizer, name="theta") as engine:
        before = await engine.next_token_logprobs([context])
        await engine.next_token_logprobs([context + [5]])  # cached: context's keys and values
        async with engine.updating():
            with torch.no_grad():
                model.lm_head.weight.mul_(2.0)  # an "update"
        after = await engine.next_token_logprobs([context + [5]])
    with torch.no_grad():
        fresh = torch.log_softmax(model(torch.tensor([context + [5]])).logits[0, -1].double(), -1).numpy()
    np.testing.assert_allclose(after[0], fresh, atol=1e-5)  # the new weights, not a stale cache
    assert not np.allclose(before[0], after[0])


async def test_top_k_path_equals_the_full_distribution_across_cached_steps():
    # A vocabulary of 4,096, so the top-k is a real selection. Three engines over one model
    # see the same calls: the top-k path with a KV cache, the full-distribution path with a KV
    # cache (the same forward passes, so only the reduction differs), and the full path
    # recomputing every context (so the batched cache is checked too).
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(tinymodels.BASE_DIR)
    config.vocab_size, config.initializer_range = 4096, 0.1
    model = transformers.Qwen2ForCausalLM(config).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    rng = np.random.default_rng(1)
    contexts = [[int(t) for t in rng.integers(0, 4096, n)] for n in (5, 9, 2)]
    async with TransformersEngine.live(model, tokenizer) as top_path, \
            TransformersEngine.live(model, tokenizer) as full_path, \
            TransformersEngine.live(model, tokenizer, kv_cache=False) as recomputed:
        for step in range(6):
            top = await top_path.next_token_topk(contexts, 20)
            for engine, atol in ((full_path, 1e-6), (recomputed, 1e-5)):
                full = await engine.next_token_logprobs(contexts)
                np.testing.assert_array_equal(top.token_ids, np.argsort(-full, axis=1)[:, :20])
                np.testing.assert_allclose(top.logprobs, np.take_along_axis(full, top.token_ids, axis=1), atol=atol)
            grown = [c + [int(t[0])] for c, t in zip(contexts, top.token_ids)]
            if step == 1:  # row 0 diverges into two, row 2 leaves, a new context joins
                grown = [grown[0], contexts[0] + [int(top.token_ids[0, 1])], grown[1], [7, 8, 9]]
            if step == 3:  # the same rows in another order
                grown = grown[::-1]
            contexts = grown
        hits = top_path.scorer.cache_hits
    # Steps 1-5 extend 3, 3 (both halves of row 0, and row 1), 4, 4 and 4 cached rows.
    assert hits == 3 + 3 + 4 + 4 + 4
