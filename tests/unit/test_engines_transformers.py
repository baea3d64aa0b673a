"""The in-process transformers engine: exact against a plain forward pass, KV cache
across steps, and q* sampling through the whole coordinator path checked by chi-square."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tinymodels
from coordinator import CoordinatorConfig, DualVLLMCoordinator
from common.errors import InvalidInputError, LifecycleError
from tests.exact_q import chi_square_pvalue, exact_q_star

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from engines.transformers_engine import TransformersEngine  # noqa: E402


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
        hits = engine.cache_hits
    # Steps 2-4 run 3, 2 (+ the joiner's prefill) and 3 rows on cached keys/values.
    assert hits == (3 + 2 + 3 if kv_cache else 0)


async def test_top_k_is_sorted_and_k_above_the_vocabulary_returns_everything():
    async with TransformersEngine(tinymodels.BASE_DIR) as engine:
        context = [await engine.tokenize("12+34=")]
        full = (await engine.next_token_logprobs(context))[0]
        top = await engine.next_token_topk(context, 5)
        everything = await engine.next_token_topk(context, 10_000)
    np.testing.assert_array_equal(top.token_ids[0], np.argsort(-full)[:5])
    np.testing.assert_allclose(top.logprobs[0], np.sort(full)[::-1][:5])
    assert everything.token_ids.shape == (1, full.shape[0])
    assert sorted(everything.token_ids[0]) == list(range(full.shape[0]))


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
