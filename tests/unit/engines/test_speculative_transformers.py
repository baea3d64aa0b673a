"""Speculative q* sampling on the in-process engine: its draft and scoring calls, and the
joint law of generated pairs against exact full-vocabulary q* on the bundled models."""

from __future__ import annotations

import numpy as np
import pytest

from dualvllm import tinymodels
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from tests.exact_q import chi_square_pvalue, exact_q_star

pytest.importorskip("torch")
pytest.importorskip("transformers")
from dualvllm.engines.transformers_engine import TransformersEngine  # noqa: E402


async def test_draft_and_scoring_give_the_top_k_before_every_token():
    async with TransformersEngine(tinymodels.BASE_DIR, name="theta") as engine:
        context = await engine.tokenize("12+34=")
        draft = await engine.draft(context, max_tokens=3, k=5, temperature=1.0, seed=0)
        again = await engine.draft(context, max_tokens=3, k=5, temperature=1.0, seed=0)
        (scored,) = await engine.score_continuations([context], [draft.token_ids.tolist()], 5)
        for j in range(3):
            expected = await engine.next_token_topk([context + draft.token_ids[:j].tolist()], 5)
            np.testing.assert_array_equal(draft.topk.token_ids[j], expected.token_ids[0])
            np.testing.assert_array_equal(scored.token_ids[j], expected.token_ids[0])
            np.testing.assert_allclose(scored.logprobs[j], expected.logprobs[0], atol=1e-5)  # float32 padding
            assert draft.token_ids[j] in expected.token_ids[0]  # drafts come from the top-k only
        greedy = await engine.draft(context, max_tokens=3, k=5, temperature=0.0, seed=1)
        other = await engine.tokenize("57+68=")
        batched = await engine.draft_argmax([other, context], max_tokens=3, k=5)
    np.testing.assert_array_equal(batched[1].token_ids, greedy.token_ids)
    np.testing.assert_array_equal(batched[1].topk.token_ids, greedy.topk.token_ids)
    assert batched[0].token_ids.shape == (3,)
    np.testing.assert_array_equal(draft.token_ids, again.token_ids)
    np.testing.assert_array_equal(greedy.token_ids, greedy.topk.token_ids[:, 0])


async def test_generated_pairs_follow_exact_q_star_on_the_bundled_models():
    """top_k 98 is the whole vocabulary, so per-position q* is exact."""
    prompt, draws, temperature = "4", 1500, 1.0
    async with TransformersEngine(tinymodels.BASE_DIR, name="theta") as theta, \
            TransformersEngine(tinymodels.TEACHER_DIR, name="t") as t:
        context = await theta.tokenize(prompt)
        vocab = (await theta.model_info()).vocab_size
        first, _ = exact_q_star((await theta.next_token_logprobs([context]))[0],
                                (await t.next_token_logprobs([context]))[0], temperature)
        nexts = [context + [x] for x in range(vocab)]
        lp_theta, lp_t = await theta.next_token_logprobs(nexts), await t.next_token_logprobs(nexts)
        joint = np.concatenate([first[x] * exact_q_star(lp_theta[x], lp_t[x], temperature)[0]
                                for x in range(vocab)])  # [V * V]
        config = CoordinatorConfig(top_k=98, speculative_gamma=4, max_batch_size=draws,
                                   max_prompts_per_request=4 * draws)  # in-process: no request limit
        async with DualVLLMCoordinator(config, theta_engine=theta, t_engine=t) as c:
            outputs = await c.generate_batch([prompt] * draws, max_tokens=2, temperature=temperature, seed=4,
                                             ignore_eos=True)
            acceptance = c.get_statistics()["speculative_acceptance_rate"]
    assert all(o.ok for o in outputs)
    pairs = np.array([o.generated_tokens[0] * vocab + o.generated_tokens[1] for o in outputs])
    assert chi_square_pvalue(pairs, joint, min_bins=5) > 1e-3
    assert 0.2 < acceptance < 1.0
