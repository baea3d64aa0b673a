"""Speculative q* sampling through the coordinator, against two fake vLLM servers over HTTP."""

from __future__ import annotations

import numpy as np
import pytest

from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator, SamplingParams
from dualvllm.common.errors import InvalidInputError
from tests.exact_q import chi_square_pvalue, exact_q_star, two_sample_pvalue
from tests.fake_vllm import VOCAB_SIZE, Failure, tokenize


def config(theta, t, **kw) -> CoordinatorConfig:
    kw.setdefault("retry_delay", 0.0)
    kw.setdefault("top_k", 8)
    kw.setdefault("speculative_gamma", 4)
    return CoordinatorConfig(theta_url=theta.url, t_url=t.url, **kw)


def pairs(outputs) -> np.ndarray:
    """The first two generated tokens of each output as one category id."""
    return np.array([o.generated_tokens[0] * VOCAB_SIZE + o.generated_tokens[1] for o in outputs])


@pytest.mark.parametrize("drafter, temperature, proposal",
                         [("theta", 1.0, "sample"), ("t", 0.7, "sample"), ("theta", 1.0, "argmax")])
async def test_two_token_sequences_follow_exact_q_star(fake_theta, fake_t, drafter, temperature, proposal):
    """top_k = vocabulary makes per-position q* exact; the joint law of two tokens is then known."""
    context = tokenize("ab")
    first, _ = exact_q_star(fake_theta.model.logprobs(context), fake_t.model.logprobs(context), temperature)
    joint = np.concatenate([
        first[x] * exact_q_star(fake_theta.model.logprobs(context + [x]), fake_t.model.logprobs(context + [x]),
                                temperature)[0]
        for x in range(VOCAB_SIZE)])  # [V * V], index x1 * V + x2
    cfg = config(fake_theta, fake_t, top_k=VOCAB_SIZE, max_batch_size=500, speculative_drafter=drafter,
                 speculative_proposal=proposal)
    async with DualVLLMCoordinator(cfg) as c:
        outputs = await c.generate_batch(["ab"] * 2000, max_tokens=2, temperature=temperature, seed=3,
                                         ignore_eos=True)
        statistics = c.get_statistics()
    assert all(o.ok for o in outputs)
    assert chi_square_pvalue(pairs(outputs), joint, min_bins=5) > 1e-3
    # Records are what per-token mode writes: exact alpha* and log q* of each token.
    for out in outputs[:20]:
        for step, token in enumerate(out.generated_tokens):
            ctx = context + out.generated_tokens[:step]
            q, alpha = exact_q_star(fake_theta.model.logprobs(ctx), fake_t.model.logprobs(ctx), temperature)
            assert out.alpha_history[step] == pytest.approx(alpha, abs=1e-5)
            assert out.logprobs_q[step] == pytest.approx(np.log(q[token]), abs=1e-5)
            assert out.logprobs_theta[step] == pytest.approx(fake_theta.model.logprobs(ctx)[token])
            assert out.logprobs_t[step] == pytest.approx(fake_t.model.logprobs(ctx)[token])
    if proposal == "sample":
        assert 0.3 < statistics["speculative_acceptance_rate"] < 1.0
    else:  # argmax: the first drafted token is kept w.p. a1 = q*(x1), the second then w.p. a2 = q*(x2 | x1)
        x1 = int(np.argmax(fake_theta.model.logprobs(context)))
        a1 = first[x1]
        second, _ = exact_q_star(fake_theta.model.logprobs(context + [x1]), fake_t.model.logprobs(context + [x1]),
                                 temperature)
        a2 = second[int(np.argmax(fake_theta.model.logprobs(context + [x1])))]
        expected = a1 * (1 + a2) / (1 + a1)  # kept / judged
        assert statistics["speculative_acceptance_rate"] == pytest.approx(expected, abs=0.03)
    assert 1.0 < statistics["speculative_tokens_per_round"] <= 2.0


@pytest.mark.parametrize("proposal", ["sample", "argmax"])
async def test_with_a_small_top_k_it_samples_what_per_token_mode_samples(fake_theta, fake_t, proposal):
    """top_k 4 of 16: q* is the top-k approximation; both modes must draw from that same one."""
    prompts, kw = ["ab"] * 2000, dict(max_tokens=2, temperature=1.0, ignore_eos=True)
    async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=4, max_batch_size=500,
                                          speculative_proposal=proposal)) as c:
        speculative = await c.generate_batch(prompts, seed=1, **kw)
    async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=4, max_batch_size=500,
                                          speculative_gamma=0)) as c:
        per_token = await c.generate_batch(prompts, seed=2, **kw)
        fixed_alpha = await c.generate_batch(prompts, seed=2, fixed_alpha=1.0, **kw)
    assert two_sample_pvalue(pairs(speculative), pairs(per_token)) > 1e-3
    # The test can fail: a different distribution (the teacher alone) is told apart.
    assert two_sample_pvalue(pairs(speculative), pairs(fixed_alpha)) < 1e-6


@pytest.mark.parametrize("gamma, proposal", [(1, "sample"), (3, "sample"), (8, "sample"), (3, "argmax"),
                                             (8, "argmax")])
async def test_greedy_decoding_and_every_stop_rule_match_per_token_mode(fake_theta, fake_t, gamma, proposal):
    fake_theta.model.max_model_len = fake_t.model.max_model_len = 12
    prompts = ["ab", "cde", "fgh", "ijklmno", "abcdefghij"]
    reasons = set()
    for eos_after in (5, 100):  # EOS likely from context length 5, or never (context limits then)
        fake_theta.model.eos_after = fake_t.model.eos_after = eos_after
        runs = []
        for g in (0, gamma):
            async with DualVLLMCoordinator(config(fake_theta, fake_t, speculative_gamma=g,
                                                  speculative_proposal=proposal)) as c:
                free = await c.generate_batch(prompts, max_tokens=7, temperature=0)
                stops = await c.generate_batch(prompts, max_tokens=7, temperature=0, stop=["d", "kh"],
                                               stop_token_ids=[5])
            runs.append([(o.generated_tokens, o.generated_text, o.finish_reason, o.alpha_history,
                          o.logprobs_q, o.logprobs_theta, o.logprobs_t) for o in free + stops])
        assert runs[0] == runs[1]
        reasons |= {run[2] for run in runs[1]}
    assert reasons == {"eos", "max_tokens", "context_limit", "stop_string", "stop_token"}


async def test_a_base_only_mixture_accepts_every_drafted_token(fake_theta, fake_t):
    """fixed_alpha 0 with the whole vocabulary makes q* the base itself, what the base drafts from.

    (With a smaller top_k, q* at alpha 0 also gives the teacher-only candidates their fill
    value, which the drafter never samples, so some drafts are rejected.)"""
    async with DualVLLMCoordinator(config(fake_theta, fake_t, speculative_gamma=3, top_k=VOCAB_SIZE)) as c:
        outputs = await c.generate_batch(["ab"] * 4, max_tokens=9, fixed_alpha=0.0, seed=0, ignore_eos=True)
        statistics = c.get_statistics()
    assert all(len(o.generated_tokens) == 9 for o in outputs)
    assert statistics["speculative_acceptance_rate"] == 1.0
    assert statistics["speculative_tokens_per_round"] == 3.0 and statistics["steps"] == 3


async def test_each_round_sends_one_draft_per_sequence_and_one_scoring_request(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, max_batch_size=3)) as c:
        await c.generate_batch(["ab", "cd", "ef"], max_tokens=4, seed=0, ignore_eos=True)
        statistics = c.get_statistics()
    drafts = fake_theta.calls["/v1/completions"][1:]
    scoring = fake_t.calls["/v1/completions"][1:]
    assert len(drafts) == statistics["speculative_rounds"]
    first = drafts[0]
    assert first["max_tokens"] == 4 and first["top_k"] == 8 and first["top_p"] == 1.0
    assert first["repetition_penalty"] == 1.0 and first["ignore_eos"] is True
    assert len({call["seed"] for call in drafts}) == len(drafts)  # every draft its own seed
    # One scoring request per round: a next-token prompt per drafted token, every prefix of the draft.
    assert len(scoring) == statistics["steps"] and len(scoring[0]["prompt"]) == 3 * 4
    assert scoring[0]["prompt"][:2] == [tokenize("ab"), tokenize("ab") + scoring[0]["prompt"][1][2:]]
    assert [len(p) for p in scoring[0]["prompt"][:4]] == [2, 3, 4, 5]
    assert scoring[0]["max_tokens"] == 1 and scoring[0]["temperature"] == 0.0
    assert "prompt_logprobs" not in scoring[0]  # it covers the whole context and bypasses the prefix cache


async def test_requests_are_split_at_max_prompts_per_request_and_a_failed_one_fails_only_its_sequences(
        fake_theta, fake_t):
    cfg = config(fake_theta, fake_t, max_batch_size=3, max_retries=0, max_prompts_per_request=5,
                 speculative_proposal="argmax")
    async with DualVLLMCoordinator(cfg) as c:
        fake_t.fail_next("/v1/completions", Failure(400, "scoring refused"))
        outputs = await c.generate_batch(["ab", "cd", "ef"], max_tokens=8, seed=0, ignore_eos=True)
    scoring = fake_t.calls["/v1/completions"][1:]
    assert all(len(call["prompt"]) <= 5 for call in scoring)
    assert len(scoring[0]["prompt"]) == 4  # gamma 4: one sequence's draft per request (4 + 4 > 5)
    assert [o.ok for o in outputs].count(False) == 1
    assert all(len(o.generated_tokens) == 8 for o in outputs if o.ok)
    assert "scoring refused" in next(o.error for o in outputs if not o.ok)


def test_a_batch_larger_than_a_request_may_carry_is_refused_with_the_fix():
    with pytest.raises(InvalidInputError, match="max_batch_size=2000 is above max_prompts_per_request=1024.*"
                                                "VLLM_MAX_COMPLETION_PROMPTS"):
        CoordinatorConfig(max_batch_size=2000)
    assert CoordinatorConfig(max_batch_size=2000, max_prompts_per_request=2000).max_batch_size == 2000


async def test_argmax_rounds_send_one_batched_greedy_draft_per_draft_length(fake_theta, fake_t):
    fake_theta.model.max_model_len = fake_t.model.max_model_len = 8  # "efghij" has room for 2 tokens
    async with DualVLLMCoordinator(config(fake_theta, fake_t, max_batch_size=3, speculative_proposal="argmax")) as c:
        outputs = await c.generate_batch(["ab", "cd", "efghij"], max_tokens=4, seed=0, ignore_eos=True)
        statistics = c.get_statistics()
    assert [len(o.generated_tokens) for o in outputs] == [4, 4, 2]
    drafts = fake_theta.calls["/v1/completions"][1:]
    first_round = drafts[:2]  # the two sequences that may take 4 tokens, and the one that may take 2
    assert sorted((call["max_tokens"], len(call["prompt"])) for call in first_round) == [(2, 1), (4, 2)]
    assert all(call["temperature"] == 0.0 and "seed" not in call and call["ignore_eos"] for call in drafts)
    assert len(fake_t.calls["/v1/completions"][1:]) == statistics["steps"]  # one scoring request per round


async def test_a_failed_argmax_draft_fails_only_the_sequences_it_carried(fake_theta, fake_t):
    fake_theta.model.max_model_len = fake_t.model.max_model_len = 8
    cfg = config(fake_theta, fake_t, max_batch_size=3, max_retries=0, speculative_proposal="argmax")
    async with DualVLLMCoordinator(cfg) as c:
        fake_theta.fail_next("/v1/completions", Failure(400, "bad draft"))
        outputs = await c.generate_batch(["ab", "cd", "efghij"], max_tokens=4, seed=0, ignore_eos=True)
    failed = {o.index for o in outputs if not o.ok}
    assert failed in ({0, 1}, {2})  # whichever length group's request was refused
    assert all("bad draft" in o.error for o in outputs if not o.ok)
    assert all(len(o.generated_tokens) == [4, 4, 2][o.index] for o in outputs if o.ok)


async def test_seeded_speculative_sampling_is_reproducible(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, max_batch_size=2)) as c:
        alone = await c.generate_batch(["abc"], max_tokens=10, seeds=[42])
        crowded = await c.generate_batch(["de", "abc", "fg"], max_tokens=10, seeds=[1, 42, 2])
        other = await c.generate_batch(["abc"] * 8, max_tokens=10, seed=5)
    assert crowded[1].generated_tokens == alone[0].generated_tokens
    assert crowded[1].alpha_history == alone[0].alpha_history
    assert len({tuple(o.generated_tokens) for o in other}) > 1


async def test_a_failed_draft_fails_its_sequence_and_a_failed_scoring_the_round(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, max_batch_size=2, max_retries=1)) as c:
        fake_theta.fail_next("/v1/completions", Failure(400, "bad draft"))
        one = await c.generate_batch(["ab", "cd", "ef"], max_tokens=4, seed=0)
        crash = Failure(500, "scorer crashed")
        fake_t.fail_next("/v1/completions", crash, crash)
        round_ = await c.generate_batch(["ab", "cd", "ef"], max_tokens=4, seed=0)
    assert sum(not o.ok for o in one) == 1
    assert "bad draft" in next(o.error for o in one if not o.ok)
    failed = [o for o in round_ if not o.ok]
    assert [o.index for o in failed] == [0, 1]
    assert all("t server" in o.error and "scorer crashed" in o.error and not o.generated_tokens for o in failed)
    assert round_[2].ok


async def test_speculative_mode_needs_engines_that_draft(fake_theta, fake_t):
    from dualvllm.coordinator.speculative import speculative_scheduler

    with pytest.raises(InvalidInputError, match="speculative_gamma"):
        speculative_scheduler(object(), object())


@pytest.mark.parametrize("setting", [{"top_k": 4}, {"top_logprobs": 2}, {"record_topk": 2}, {"max_alpha": 0.5}])
async def test_per_call_settings_speculative_rounds_cannot_honour_are_refused_before_a_request(
        fake_theta, fake_t, setting):
    """The scheduler answers `check`: the coordinator raises before any token is asked for,
    and the same settings pass a per-token coordinator's check."""
    params = SamplingParams(max_tokens=3, **setting)
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        before = len(fake_theta.calls["/v1/completions"])
        with pytest.raises(InvalidInputError, match="not available in speculative mode"):
            await c.generate_batch(["ab"], params)
        assert len(fake_theta.calls["/v1/completions"]) == before
    async with DualVLLMCoordinator(config(fake_theta, fake_t, speculative_gamma=0)) as c:
        assert c.check(params) is params
