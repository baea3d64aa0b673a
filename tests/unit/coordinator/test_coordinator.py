"""The coordinator over real HTTP against two fake vLLM servers with known distributions."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.common.errors import (
    IncompatibleModelsError,
    InvalidInputError,
    LifecycleError,
    LockstepUnavailableError,
    TopKUnsupportedError,
    UnknownModelError,
)
from tests.exact_q import chi_square_pvalue
from tests.fake_vllm import EOS_ID, VOCAB_SIZE, Failure, detokenize, rendezvous, tokenize
from dualvllm.theory.alpha import solve_alpha
from dualvllm.theory.mixture import mixture_logprobs


def config(theta, t, **kw) -> CoordinatorConfig:
    kw.setdefault("retry_delay", 0.0)
    kw.setdefault("top_k", 8)
    # The fake servers have no lockstep plugin; per-token mode also skips auto mode's probe
    # request, which would count among the requests some tests count.
    kw.setdefault("mode", "per_token")
    return CoordinatorConfig(theta_url=theta.url, t_url=t.url, **kw)


def completions_batches(server) -> list[int]:
    """Batch size of every /v1/completions request after the start-up probe."""
    return [len(call["prompt"]) for call in server.calls["/v1/completions"][1:]]


async def test_outputs_come_back_in_input_order_with_consistent_records(fake_theta, fake_t):
    prompts = ["abc", "de", [1, 2, 3, 4], "o"]
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        outputs = await c.generate_batch(prompts, max_tokens=20, seed=3)
    assert [o.index for o in outputs] == [0, 1, 2, 3]
    assert [o.prompt for o in outputs] == prompts
    for out in outputs:
        assert out.ok and out.finish_reason in ("eos", "max_tokens")
        n = len(out.generated_tokens)
        assert n >= 1
        assert len(out.alpha_history) == len(out.logprobs_q) == len(out.logprobs_theta) == len(out.logprobs_t) == n
        assert all(0.0 <= a <= 1.0 for a in out.alpha_history)
        assert all(lq <= 0.0 for lq in out.logprobs_q)
        if out.finish_reason == "eos":
            assert out.generated_tokens[-1] == EOS_ID and EOS_ID not in out.generated_tokens[:-1]
            assert out.generated_text == detokenize(out.generated_tokens[:-1])
        else:
            assert n == 20


async def test_each_step_sends_one_request_per_server_for_all_active_sequences(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, max_batch_size=3)) as c:
        outputs = await c.generate_batch(["ab"] * 7, max_tokens=10, seed=0)
        statistics = c.get_statistics()
    theta_batches, t_batches = completions_batches(fake_theta), completions_batches(fake_t)
    assert theta_batches == t_batches  # the two servers always see the same step
    assert max(theta_batches) == 3  # never more than max_batch_size
    assert sum(theta_batches) == sum(len(o.generated_tokens) for o in outputs) == statistics["tokens"]
    assert statistics["steps"] == len(theta_batches)
    # Continuous batching: a finished sequence's slot is refilled at once, so the batch
    # stays full while work is waiting (only the tail may run below 3).
    waiting_steps = len(theta_batches) - max(len(o.generated_tokens) for o in outputs)
    assert all(b == 3 for b in theta_batches[:max(waiting_steps, 1)])


async def test_prompt_pairs_give_each_model_its_own_prompt_and_a_shared_continuation(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        (out,) = await c.generate_batch([("ab", "cdef")], max_tokens=3, seed=1)
    theta_contexts = [call["prompt"][0] for call in fake_theta.calls["/v1/completions"][1:]]
    t_contexts = [call["prompt"][0] for call in fake_t.calls["/v1/completions"][1:]]
    generated = out.generated_tokens
    for step, (ctx_theta, ctx_t) in enumerate(zip(theta_contexts, t_contexts)):
        assert ctx_theta == tokenize("ab") + generated[:step]
        assert ctx_t == tokenize("cdef") + generated[:step]


async def test_each_distinct_prompt_text_is_tokenized_once_per_server(fake_theta, fake_t):
    # An RL call repeats every prompt for its group of samples; one /tokenize per text and server.
    prompts = ["ab", "cde", "ab", ("ab", "fg"), "cde", [5, 6]]
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        before = len(fake_theta.calls["/tokenize"]), len(fake_t.calls["/tokenize"])  # start-up checks
        encoded = await c.encode(prompts)
        outputs = await c.generate_batch(prompts, max_tokens=2, seed=1)
    ab, cde, fg = tokenize("ab"), tokenize("cde"), tokenize("fg")
    assert encoded == [(ab, ab), (cde, cde), (ab, ab), (ab, fg), (cde, cde), ([5, 6], [5, 6])]
    assert sorted(call["prompt"] for call in fake_theta.calls["/tokenize"][before[0]:]) == ["ab", "ab", "cde", "cde"]
    assert sorted(call["prompt"] for call in fake_t.calls["/tokenize"][before[1]:]) == ["ab", "ab", "cde", "cde",
                                                                                        "fg", "fg"]
    assert all(o.ok for o in outputs)
    # Every prompt owns its ids: changing one changes no other.
    encoded[0][0].append(99)
    assert encoded[2][0] == ab and encoded[3][0] == ab


async def test_a_failed_request_fails_only_the_sequences_it_carried(fake_theta, fake_t):
    cfg = config(fake_theta, fake_t, max_batch_size=2, max_retries=1)
    async with DualVLLMCoordinator(cfg) as c:
        # Step 1 passes; step 2's request fails on its try and its one retry.
        crash = Failure(500, "worker crashed")
        fake_theta.fail_next("/v1/completions", Failure(0), crash, crash)
        outputs = await c.generate_batch(["ab", "cd", "ef", "gh"], max_tokens=4, seed=0)
        statistics = c.get_statistics()
    failed = [o for o in outputs if not o.ok]
    assert [o.index for o in failed] == [0, 1]  # the two sequences in flight at step 2
    for out in failed:
        assert out.finish_reason == "error"
        assert "theta" in out.error and "500" in out.error and "worker crashed" in out.error
        assert len(out.generated_tokens) == 1  # what was sampled before the failure is kept
    assert all(o.ok for o in outputs[2:])
    assert statistics["sequences_failed"] == 2 and statistics["retries"] == 1


async def test_one_slow_server_delays_but_does_not_change_the_samples(fake_theta, fake_t):
    prompts = ["ab", "cd", "ef"]
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        fast = await c.generate_batch(prompts, max_tokens=3, seed=5)
        # The teacher answers each of the next 3 steps 0.3 s late (within the timeout).
        fake_t.fail_next("/v1/completions", *[Failure(0, delay_s=0.3)] * 3)
        slow = await c.generate_batch(prompts, max_tokens=3, seed=5)
        statistics = c.get_statistics()
    assert [o.generated_tokens for o in slow] == [o.generated_tokens for o in fast]
    assert [o.alpha_history for o in slow] == [o.alpha_history for o in fast]
    assert all(o.ok for o in slow) and statistics["retries"] == 0
    # The slow steps were waited for, and show in the latency statistics.
    assert statistics["step_latency_p95_ms"] >= 300


async def test_step_timings_attribute_a_slow_server_to_its_own_call(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, max_retries=0)) as c:
        # The first 2 steps: each server holds its answer until the other has the step's request,
        # which only calls in flight together get past (one after the other, the first call is
        # answered 500 after the fake's safety timeout). Then the teacher answers 0.3 s late on
        # step 1, the base on step 2.
        for theta_delay_s, t_delay_s in ((0.0, 0.3), (0.3, 0.0)):
            theta_answer, t_answer = rendezvous(Failure(0, delay_s=theta_delay_s), Failure(0, delay_s=t_delay_s))
            fake_theta.fail_next("/v1/completions", theta_answer)
            fake_t.fail_next("/v1/completions", t_answer)
        outputs = await c.generate_batch(["ab", "cd", "ef"], max_tokens=4, seed=5, ignore_eos=True)
        timings = c.recent_step_timings()
    assert all(o.ok for o in outputs), [o.error for o in outputs]
    assert [t.batch for t in timings] == [3, 3, 3, 3]
    assert timings[0].t_s >= 0.3 and timings[1].theta_s >= 0.3  # each delay in its own server's call
    for timing in timings:
        assert timing.servers_s >= max(timing.theta_s, timing.t_s)
        phases = (timing.servers_s, timing.merge_s, timing.alpha_s, timing.sample_s, timing.bookkeeping_s)
        assert all(p >= 0 for p in phases)
        assert sum(phases) == pytest.approx(timing.total_s, rel=1e-9)


async def test_a_too_small_top_k_is_warned_about_once(fake_theta, fake_t, caplog):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=2)) as c:
        await c.generate_batch(["ab"] * 40, max_tokens=4, seed=0)
        await c.generate_batch(["ab"] * 40, max_tokens=4, seed=1)
        statistics = c.get_statistics()
    warnings = [r for r in caplog.records if "covers little" in r.getMessage()]
    assert len(warnings) == 1 and "Raise top_k" in warnings[0].getMessage()
    assert 0 < statistics["mean_coverage_theta"] < 0.9 and 0 < statistics["mean_coverage_t"] < 0.9
    caplog.clear()
    async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=VOCAB_SIZE)) as c:
        await c.generate_batch(["ab"] * 40, max_tokens=4, seed=0)
        assert c.get_statistics()["mean_coverage_theta"] == pytest.approx(1.0)
    assert not [r for r in caplog.records if "covers little" in r.getMessage()]


async def test_ignore_eos_generates_fixed_lengths(fake_theta, fake_t):
    fake_theta.model.eos_after = fake_t.model.eos_after = 3  # EOS is very likely from position 3
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        normal = await c.generate_batch(["ab"] * 8, max_tokens=12, seed=1)
        fixed = await c.generate_batch(["ab"] * 8, max_tokens=12, seed=1, ignore_eos=True)
    assert any(o.finish_reason == "eos" for o in normal)
    assert all(o.finish_reason == "max_tokens" and len(o.generated_tokens) == 12 for o in fixed)
    assert any(EOS_ID in o.generated_tokens for o in fixed)


async def test_startup_names_the_model_a_server_does_not_serve(fake_theta, fake_t):
    with pytest.raises(UnknownModelError, match="does not serve a model named 'qwen'"):
        async with DualVLLMCoordinator(config(fake_theta, fake_t, t_model="qwen")):
            pass


async def test_finish_reasons_stop_token_stop_string_max_tokens_and_context_limit(fake_theta, fake_t):
    fake_theta.model.max_model_len = fake_t.model.max_model_len = 8
    fake_theta.model.eos_after = fake_t.model.eos_after = 100  # no EOS: let other rules stop
    async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=VOCAB_SIZE)) as c:
        # Greedy decoding makes the continuation deterministic, so stops can be aimed at it.
        (free,) = await c.generate_batch(["ab"], max_tokens=5, temperature=0)
        assert free.finish_reason == "max_tokens" and len(free.generated_tokens) == 5
        second = free.generated_tokens[1]
        (by_token,) = await c.generate_batch(["ab"], max_tokens=5, temperature=0, stop_token_ids=[second])
        assert by_token.finish_reason == "stop_token" and by_token.generated_tokens == free.generated_tokens[:2]
        assert by_token.generated_text == free.generated_text[:1]
        stop = free.generated_text[2:4]
        (by_string,) = await c.generate_batch(["ab"], max_tokens=5, temperature=0, stop=stop)
        assert by_string.finish_reason == "stop_string"
        assert by_string.generated_text == free.generated_text[: free.generated_text.index(stop)]
        (limited,) = await c.generate_batch(["abcde"], max_tokens=50, temperature=0)
        assert limited.finish_reason == "context_limit" and len(limited.generated_tokens) == 3
        (too_long,) = await c.generate_batch(["abcdefgh"], max_tokens=5)
        assert too_long.finish_reason == "context_limit" and "8 tokens" in too_long.error


async def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, max_batch_size=4)) as c:
        alone = await c.generate_batch(["abc"], max_tokens=12, seeds=[42])
        crowded = await c.generate_batch(["de", "abc", "fg", "hi", "jk"], max_tokens=12, seeds=[1, 42, 2, 3, 4])
        again = await c.generate_batch(["de", "abc", "fg", "hi", "jk"], max_tokens=12, seeds=[1, 42, 2, 3, 4])
        other = await c.generate_batch(["abc"] * 8, max_tokens=12, seed=5)
    assert crowded[1].generated_tokens == alone[0].generated_tokens
    assert [o.generated_tokens for o in crowded] == [o.generated_tokens for o in again]
    assert len({tuple(o.generated_tokens) for o in other}) > 1  # different sequences, different draws


async def test_fixed_alpha_pins_the_mixture_weight(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=VOCAB_SIZE)) as c:
        (base,) = await c.generate_batch(["ab"], max_tokens=6, fixed_alpha=0.0, seed=0)
        (teacher,) = await c.generate_batch(["ab"], max_tokens=6, fixed_alpha=1.0, seed=0)
    assert set(base.alpha_history) == {0.0} and set(teacher.alpha_history) == {1.0}
    # With the full vocabulary, q at alpha=0 is the base itself, at alpha=1 the teacher.
    np.testing.assert_allclose(base.logprobs_q, base.logprobs_theta, atol=1e-9)
    np.testing.assert_allclose(teacher.logprobs_q, teacher.logprobs_t, atol=1e-9)


async def test_first_token_frequencies_match_exact_q_star(fake_theta, fake_t):
    """With top_k = vocabulary the merge is exact, so draws must follow q* exactly."""
    context = tokenize("abc")
    lt_theta = fake_theta.model.logprobs(context)[None, :]
    lt_t = fake_t.model.logprobs(context)[None, :]
    temperature = 0.7
    scaled_theta = lt_theta / temperature - np.logaddexp.reduce(lt_theta / temperature, axis=1, keepdims=True)
    scaled_t = lt_t / temperature - np.logaddexp.reduce(lt_t / temperature, axis=1, keepdims=True)
    alpha = solve_alpha(scaled_theta, scaled_t)
    q = np.exp(mixture_logprobs(scaled_theta, scaled_t, alpha))[0]
    n = 4000
    async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=VOCAB_SIZE, max_batch_size=1000)) as c:
        outputs = await c.generate_batch(["abc"] * n, max_tokens=1, temperature=temperature, seed=11)
    first = np.array([o.generated_tokens[0] for o in outputs])
    np.testing.assert_allclose([o.alpha_history[0] for o in outputs], alpha[0], atol=1e-9)
    np.testing.assert_allclose([o.logprobs_q[0] for o in outputs], np.log(q[first]), atol=1e-9)
    assert chi_square_pvalue(first, q, min_bins=3) > 1e-3


async def test_stream_yields_each_output_once_and_early_exit_cancels_the_rest(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, max_batch_size=2)) as c:
        seen = [out.index async for out in c.stream(["ab", "cd", "ef", "gh", "ij"], max_tokens=8, seed=0)]
        assert sorted(seen) == [0, 1, 2, 3, 4]
        async for _ in c.stream(["ab"] * 50, max_tokens=8, seed=0):
            break
        requests_after_break = len(fake_theta.calls["/v1/completions"])
        await c.generate_batch(["ab"], max_tokens=1, seed=0)
    # The 49 abandoned sequences were dropped, not generated to the end.
    assert len(fake_theta.calls["/v1/completions"]) - requests_after_break <= 3


async def test_statistics_summarize_the_run(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        outputs = await c.generate_batch(["ab", "cd"], max_tokens=6, seed=0, return_diagnostics=True)
        s = c.get_statistics()
    all_alphas = [a for o in outputs for a in o.alpha_history]
    assert s["tokens"] == len(all_alphas)
    assert s["mean_alpha"] == pytest.approx(np.mean(all_alphas))
    assert s["sequences_finished"] == 2 and s["sequences_failed"] == 0
    assert s["tokens_per_s"] > 0 and s["step_latency_p95_ms"] >= s["step_latency_p50_ms"] > 0
    for out in outputs:
        assert out.diagnostics["ess_ratio"]["min"] > 0.0
        assert out.diagnostics["coverage_theta"]["max"] <= 1.0 + 1e-9
        assert out.diagnostics["kl_diff"]["max"] == pytest.approx(0.0, abs=1e-5)


async def test_startup_refuses_a_top_k_the_servers_do_not_allow(fake_theta, fake_t):
    with pytest.raises(TopKUnsupportedError, match="--max-logprobs 50"):
        async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=50)):
            pass


async def test_startup_refuses_a_top_k_above_the_vocabulary_before_asking_a_server(fake_theta, fake_t, monkeypatch):
    monkeypatch.setattr("dualvllm.engines.vllm_answers.config_int",
                        lambda root, key, minimum=1: VOCAB_SIZE if key == "vocab_size" else None)
    with pytest.raises(InvalidInputError, match=f"top_k <= {VOCAB_SIZE}"):
        async with DualVLLMCoordinator(config(fake_theta, fake_t, top_k=VOCAB_SIZE + 1)):
            pass
    assert not fake_theta.calls["/v1/completions"] and not fake_t.calls["/v1/completions"]


async def test_startup_refuses_models_with_different_tokenizers(fake_theta, fake_t, monkeypatch):
    import tests.fake_vllm as fake

    async def shifted(self, request):
        from aiohttp import web
        text = (await request.json())["prompt"]
        return web.json_response({"tokens": [ord(ch) for ch in text]})

    monkeypatch.setattr(fake.FakeVLLM, "_tokenize", shifted)
    other = fake.FakeVLLM(fake.FakeModel(seed=3), name="other-family")
    await other.start()
    try:
        with pytest.raises(IncompatibleModelsError, match="fake-base.*other-family"):
            async with DualVLLMCoordinator(config(fake_theta, other)):
                pass
    finally:
        await other.close()


async def test_bad_calls_raise_clear_errors(fake_theta, fake_t):
    coordinator = DualVLLMCoordinator(config(fake_theta, fake_t))
    with pytest.raises(LifecycleError, match="async with"):
        await coordinator.generate_batch(["ab"], max_tokens=1)
    async with coordinator as c:
        for prompts, kwargs, message in [
            ([""], {}, "prompt 0: the prompt is empty"),
            (["ab", 3.5], {}, "prompt 1"),
            ([("ab", "cd", "ef")], {}, "theta_prompt, t_prompt"),
            (["ab"], {"max_tokens": 0}, "max_tokens"),
            (["ab"], {"temperature": -1.0}, "temperature"),
            (["ab"], {"fixed_alpha": 1.5}, "fixed_alpha"),
            (["ab"], {"seeds": [1, 2]}, "2 seeds for 1 prompts"),
        ]:
            kwargs.setdefault("max_tokens", 2)
            with pytest.raises(InvalidInputError, match=message):
                await c.generate_batch(prompts, **kwargs)
    with pytest.raises(LifecycleError, match="entered once"):
        async with coordinator:
            pass


async def test_one_server_as_its_own_teacher_needs_prompts_that_differ(fake_theta):
    """Self-distillation with privileged information: the teacher is the base shown another prompt."""
    pair = ("ab", "cdab")  # the teacher's prompt carries extra context
    async with DualVLLMCoordinator(config(fake_theta, fake_theta)) as c:
        [out] = await c.generate_batch([pair], max_tokens=4, seed=1, ignore_eos=True)
        with pytest.raises(InvalidInputError, match="prompt 1: the base and the teacher are one model"):
            await c.generate_batch([pair, "ab"], max_tokens=4)
        with pytest.raises(InvalidInputError, match="prompt 0: .* one model"):
            await c.generate_batch([("ab", "ab")], max_tokens=4)
    assert out.ok and len(out.generated_tokens) == 4
    # The 4 steps sent 8 requests, all to the one server; the first step's: the base's and the teacher's context.
    prompts = [call["prompt"] for call in fake_theta.calls["/v1/completions"][-8:-6]]
    assert sorted(map(len, prompts[0] + prompts[1])) == [2, 4]
    # alpha* is strictly inside (0, 1): the two prompts give two distributions.
    assert all(0 < a < 1 for a in out.alpha_history)


async def test_auto_mode_falls_back_to_per_token_on_servers_without_the_plugin(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t, mode="auto")) as c:
        assert c.mode == "per_token"
        [out] = await c.generate_batch(["12+34="], max_tokens=3, seed=0)
    assert out.ok, out.error
    with pytest.raises(LockstepUnavailableError, match="no dualvllm lockstep plugin"):
        async with DualVLLMCoordinator(config(fake_theta, fake_t, mode="lockstep")):
            pass


# -- per-call top_k and top_logprobs (what the HTTP service exposes) ---------------------

def test_keep_top_cuts_each_row_to_its_own_k_wherever_its_entries_sit():
    from dualvllm.coordinator.step import keep_top
    from dualvllm.engines.protocol import TopKBatch

    batch = TopKBatch(token_ids=np.array([[4, 7, 9], [5, 2, -1]]),
                      logprobs=np.array([[-2.0, -0.5, -1.0], [-0.1, -3.0, -np.inf]]))
    cut = keep_top(batch, np.array([2, 1]))
    # row 0 keeps its two most likely (7 at -0.5, 9 at -1.0), row 1 its best (5)
    assert cut.token_ids.tolist() == [[-1, 7, 9], [5, -1, -1]]
    assert cut.logprobs.tolist() == [[-np.inf, -0.5, -1.0], [-0.1, -np.inf, -np.inf]]


def test_top_candidates_lists_the_most_likely_first_and_skips_padding():
    from dualvllm.coordinator.step import top_candidates

    ids = np.array([[3, 8, -1], [1, 2, 6]])
    logq = np.array([[np.log(0.3), np.log(0.7), -np.inf], np.log([0.2, 0.5, 0.3])])
    assert top_candidates(ids, logq, 2) == [{8: np.log(0.7), 3: np.log(0.3)}, {2: np.log(0.5), 6: np.log(0.3)}]
    assert top_candidates(ids, logq, 5)[0] == {8: np.log(0.7), 3: np.log(0.3)}


async def test_top_logprobs_hold_the_sampled_tokens_log_q_and_top_k_narrows_q_star(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        [wide] = await c.generate_batch(["abc"], max_tokens=6, seed=4, top_logprobs=20)
        [narrow] = await c.generate_batch(["abc"], max_tokens=6, seed=4, top_logprobs=20, top_k=1)
        [plain] = await c.generate_batch(["abc"], max_tokens=6, seed=4)
        with pytest.raises(TopKUnsupportedError, match="at most 8"):
            await c.generate_batch(["abc"], max_tokens=2, top_k=9)
    assert plain.top_logprobs is None and wide.generated_tokens == plain.generated_tokens
    for token, logq, top in zip(wide.generated_tokens, wide.logprobs_q, wide.top_logprobs):
        assert top[token] == pytest.approx(logq)  # q* over every candidate: the sampled one is listed
        assert np.logaddexp.reduce(list(top.values())) == pytest.approx(0.0, abs=1e-9)  # all of q*
    # one candidate per model: q* is over at most two tokens
    assert all(1 <= len(top) <= 2 for top in narrow.top_logprobs)


async def test_record_topk_keeps_each_models_best_entries_per_token_without_changing_the_tokens(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        [recorded] = await c.generate_batch(["abc"], max_tokens=6, seed=4, record_topk=3)
        [plain] = await c.generate_batch(["abc"], max_tokens=6, seed=4)
        [(theta_ids, t_ids)] = await c.encode(["abc"])
        with pytest.raises(InvalidInputError, match="record_topk=9 is above the coordinator's top_k=8"):
            await c.generate_batch(["abc"], max_tokens=2, record_topk=9)
    assert plain.topk_ids is None and recorded.generated_tokens == plain.generated_tokens
    tokens = recorded.generated_tokens
    assert recorded.topk_ids.shape == recorded.topk_logprobs.shape == (len(tokens), 2, 3)
    for position in range(len(tokens)):
        for model, (fake, prompt) in enumerate(((fake_theta, theta_ids), (fake_t, t_ids))):
            logprobs = fake.model.logprobs(prompt + tokens[:position])
            best = np.argsort(-logprobs, kind="stable")[:3]
            assert recorded.topk_ids[position, model].tolist() == best.tolist()
            np.testing.assert_allclose(recorded.topk_logprobs[position, model], logprobs[best], atol=1e-6)
    # the teacher's logprob of the sampled token, where it is in the teacher's top 3, is the recorded one
    for position, token in enumerate(tokens):
        row = recorded.topk_ids[position, 1].tolist()
        if token in row:
            assert recorded.topk_logprobs[position, 1, row.index(token)] == pytest.approx(recorded.logprobs_t[position])
    assert isinstance(recorded.to_dict()["topk_ids"], list)


async def test_max_alpha_caps_alpha_star_and_at_zero_samples_the_base(fake_theta, fake_t):
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        free = await c.generate_batch(["abc", "de"], max_tokens=6, seed=4)
        capped = await c.generate_batch(["abc", "de"], max_tokens=6, seed=4, max_alpha=0.05)
        zero = await c.generate_batch(["abc", "de"], max_tokens=6, seed=4, max_alpha=0.0)
        base = await c.generate_batch(["abc", "de"], max_tokens=6, seed=4, fixed_alpha=0.0)
        with pytest.raises(InvalidInputError, match="max_alpha must be in"):
            await c.generate_batch(["abc"], max_tokens=2, max_alpha=1.5)
    assert max(a for o in free for a in o.alpha_history) > 0.05  # the premise: alpha* exceeds the cap
    assert all(a <= 0.05 for o in capped for a in o.alpha_history)
    for got, want in zip(zero, base):
        assert got.generated_tokens == want.generated_tokens
        np.testing.assert_allclose(got.logprobs_q, want.logprobs_q, atol=1e-12)


async def test_on_tokens_hands_over_every_token_once_in_order(fake_theta, fake_t):
    seen: dict[int, list[int]] = {0: [], 1: []}
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        outputs = [o async for o in c.stream(["abc", "de"], max_tokens=8, seed=2,
                                             on_tokens=lambda i, tokens, *_: seen[i].extend(tokens))]
    assert {o.index: o.generated_tokens for o in outputs} == seen


async def test_the_start_up_heap_is_frozen_while_a_coordinator_runs(fake_theta, fake_t):
    assert gc.get_freeze_count() == 0, "another test left the heap frozen"
    async with DualVLLMCoordinator(config(fake_theta, fake_t)) as c:
        assert gc.get_freeze_count() > 0
        async with DualVLLMCoordinator(config(fake_theta, fake_t)) as other:
            await other.generate_batch(["ab"], max_tokens=2)
        assert gc.get_freeze_count() > 0, "the first coordinator still runs"
        assert (await c.generate_batch(["ab"], max_tokens=2))[0].ok
    assert gc.get_freeze_count() == 0, "the last coordinator to close thaws the heap"
    async with DualVLLMCoordinator(config(fake_theta, fake_t, freeze_gc_heap=False)):
        assert gc.get_freeze_count() == 0
    with pytest.raises(UnknownModelError):  # a start that fails leaves nothing frozen
        async with DualVLLMCoordinator(config(fake_theta, fake_t, theta_model="missing")):
            pass
    assert gc.get_freeze_count() == 0
