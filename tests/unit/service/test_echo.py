"""q* loglikelihoods: `echo` with `logprobs` on /v1/completions (service/scoring.py), over fake vLLM servers.

With the coordinator's top_k at the fake's whole vocabulary (16 tokens), the merged
candidates are the vocabulary, so every value must equal the exact full-vocabulary q*
of tests/exact_q.py (an independent solver) at every prompt position.
"""

from __future__ import annotations

import math

import aiohttp
import numpy as np
import pytest

from dualvllm.common.errors import MalformedResponseError, TopKUnsupportedError
from dualvllm.engines.vllm_client import VLLMClient
from tests.exact_q import exact_q_star
from tests.fake_vllm import VOCAB_SIZE, FakeModel, detokenize, token_text, tokenize
from tests.unit.service.test_service import MODEL, post, running, service  # noqa: F401 - a fixture

WHOLE_VOCAB = {"top_k": VOCAB_SIZE}


def exact(prompt: str, base: FakeModel, teacher: FakeModel) -> tuple[list[float], list[float]]:
    """(log q*(token), alpha*) at positions 1.. of `prompt`, over the whole vocabulary."""
    ids, logq, alphas = tokenize(prompt), [], []
    for j in range(1, len(ids)):
        q, alpha = exact_q_star(base.logprobs(ids[:j]), teacher.logprobs(ids[:j]))
        logq.append(math.log(q[ids[j]]))
        alphas.append(alpha)
    return logq, alphas


def echoed(answer: dict, choice: int = 0) -> tuple[dict, dict]:
    """(OpenAI logprobs, the `dualvllm.prompt` record) of a choice."""
    entry = answer["choices"][choice]
    return entry["logprobs"], entry["dualvllm"]["prompt"]


def echo(prompt, **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 2, **fields}


@pytest.mark.parametrize("scale_out", [True, False], ids=["generate-route", "echo-route"])
async def test_each_prompt_token_gets_the_exact_log_q_star_in_openai_echo_format(fake_theta, fake_t, scale_out):
    fake_theta.scale_out = fake_t.scale_out = scale_out  # the servers' top-k through either route
    async with running(fake_theta, fake_t, WHOLE_VOCAB) as (url, _):
        status, answer = await post(url, "/v1/completions", echo(["abcdef", "hij"]))
    assert status == 200, answer
    for choice, prompt in enumerate(["abcdef", "hij"]):
        logprobs, record = echoed(answer, choice)
        want_logq, want_alpha = exact(prompt, fake_theta.model, fake_t.model)
        assert answer["choices"][choice]["text"] == prompt
        assert logprobs["tokens"] == list(prompt)
        assert logprobs["text_offset"] == list(range(len(prompt)))
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(want_logq, abs=1e-6)
        assert record["alpha"][0] is None and record["alpha"][1:] == pytest.approx(want_alpha, abs=1e-5)
        assert record["logprobs_q"] == logprobs["token_logprobs"]
        assert record["token_ids"] == tokenize(prompt)
        ids = tokenize(prompt)
        assert record["logprobs_theta"][1:] == pytest.approx(
            [fake_theta.model.logprobs(ids[:j])[ids[j]] for j in range(1, len(ids))], abs=1e-9)
        assert record["logprobs_t"][1:] == pytest.approx(
            [fake_t.model.logprobs(ids[:j])[ids[j]] for j in range(1, len(ids))], abs=1e-9)
        for j, top in enumerate(logprobs["top_logprobs"][1:], start=1):
            # q*'s 2 most likely tokens and the token itself, as vLLM's echo gives them
            assert prompt[j] in top and 2 <= len(top) <= 3
            assert max(top.values()) >= logprobs["token_logprobs"][j]
    assert answer["usage"] == {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "length"]


async def test_without_the_generate_route_one_echo_request_per_server_for_all_prompts_and_choices(
        fake_theta, fake_t):
    fake_theta.scale_out = fake_t.scale_out = False  # servers started without --enable-scale-out: a 403
    async with running(fake_theta, fake_t) as (url, _):
        before = [len(s.calls["/v1/completions"]) for s in (fake_theta, fake_t)]
        status, answer = await post(url, "/v1/completions", echo([[1, 2, 3], [4, 5], [6, 7, 8, 9]], n=2))
        assert status == 200, answer
        for server, calls_before in zip((fake_theta, fake_t), before):
            (call,) = server.calls["/v1/completions"][calls_before:]
            assert call["echo"] and call["max_tokens"] == 0 and call["logprobs"] == 8  # the coordinator's top_k
            assert call["prompt"] == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    # n choices per prompt, each with its prompt's scores
    assert [c["text"] for c in answer["choices"]] == ["abc", "abc", "de", "de", "fghi", "fghi"]
    assert echoed(answer, 0) == echoed(answer, 1) and echoed(answer, 4) == echoed(answer, 5)


async def test_with_the_generate_route_each_prompt_is_scored_without_detokenizing_and_echo_is_never_sent(
        fake_theta, fake_t):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    async with running(fake_theta, fake_t) as (url, _):
        for _ in range(2):  # the route is found on the first request and kept
            status, answer = await post(url, "/v1/completions", echo(prompts))
            assert status == 200, answer
    for server in (fake_theta, fake_t):
        calls = server.calls["/inference/v1/generate"]
        assert sorted(c["token_ids"] for c in calls) == sorted(prompts * 2)
        assert all(c["sampling_params"] == {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 8,
                                            "detokenize": False} for c in calls)
        assert not [c for c in server.calls["/v1/completions"] if c.get("echo")]


@pytest.mark.parametrize("alpha, role", [(0.0, "theta"), (1.0, "t")])
async def test_a_fixed_alpha_scores_with_one_model_by_option_or_model_name(fake_theta, fake_t, alpha, role):
    model = {"theta": fake_theta, "t": fake_t}[role].model
    ids = tokenize("abcdefg")
    want = [model.logprobs(ids[:j])[ids[j]] for j in range(1, len(ids))]
    async with running(fake_theta, fake_t, WHOLE_VOCAB) as (url, _):
        by_option = await post(url, "/v1/completions", echo("abcdefg", dualvllm={"fixed_alpha": alpha}))
        by_name = await post(url, "/v1/completions", echo("abcdefg", model=f"{MODEL}@alpha={alpha:g}"))
    for status, answer in (by_option, by_name):
        assert status == 200, answer
        logprobs, record = echoed(answer)
        assert logprobs["token_logprobs"][1:] == pytest.approx(want, abs=1e-9)  # the whole vocabulary: exact
        assert record["alpha"][1:] == [alpha] * len(want)
    assert echoed(by_option[1]) == echoed(by_name[1])


async def test_a_token_outside_both_top_k_lists_gets_its_own_logprob(fake_theta, fake_t):
    """With top_k 2 of 16, a token neither model ranks in its top 2 is still a candidate
    (vLLM reports it), so its log q* is finite and below q*'s top candidates; sampling would
    never have drawn it."""
    ids, position = _rare_token_prompt(fake_theta.model, fake_t.model, k=2)
    async with running(fake_theta, fake_t, {"top_k": 2}) as (url, _):
        status, answer = await post(url, "/v1/completions", echo([ids], logprobs=1))
    assert status == 200, answer
    logprobs, record = echoed(answer)
    value = logprobs["token_logprobs"][position]
    top = logprobs["top_logprobs"][position]
    assert math.isfinite(value) and value < max(top.values())
    assert top[token_text(ids[position])] == value and len(top) == 2  # q*'s best and the token
    assert record["logprobs_theta"][position] == pytest.approx(fake_theta.model.logprobs(ids[:position])[ids[position]])


def _rare_token_prompt(base: FakeModel, teacher: FakeModel, k: int) -> tuple[list[int], int]:
    """A prompt [1, y] whose second token is outside both models' top k after [1]."""
    first = [1]
    ranks = [np.argsort(-m.logprobs(first))[:k] for m in (base, teacher)]
    rare = next(t for t in range(1, VOCAB_SIZE) if all(t not in r for r in ranks))
    return first + [rare], 1


async def test_echo_with_generated_tokens_puts_the_prompt_first(fake_theta, fake_t):
    """max_tokens > 0: the prompt's logprobs, then the completion's, as vLLM answers echo
    (lm-eval's loglikelihood requests send max_tokens 1 and drop the last entry)."""
    async with running(fake_theta, fake_t) as (url, _):
        status, answer = await post(url, "/v1/completions", echo(
            "abcd", max_tokens=3, seed=7, dualvllm={"return_token_ids": True}, logprobs=1))
        plain_status, plain = await post(url, "/v1/completions", {
            "model": MODEL, "prompt": "abcd", "max_tokens": 3, "seed": 7, "logprobs": 1,
            "dualvllm": {"return_token_ids": True}})
        _, alone = await post(url, "/v1/completions", echo("abcd"))
    assert status == plain_status == 200, (answer, plain)
    choice, plain_choice = answer["choices"][0], plain["choices"][0]
    generated = plain_choice["dualvllm"]["token_ids"]
    assert choice["text"] == "abcd" + plain_choice["text"] == "abcd" + detokenize(generated)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list("abcd") + [token_text(t) for t in generated]
    assert logprobs["token_logprobs"][:4] == echoed(alone)[0]["token_logprobs"]
    assert logprobs["token_logprobs"][4:] == plain_choice["logprobs"]["token_logprobs"]
    assert logprobs["text_offset"] == list(range(4 + len(generated)))
    for j, token in enumerate(generated, start=4):
        assert logprobs["top_logprobs"][j][token_text(token)] == logprobs["token_logprobs"][j]
    assert choice["dualvllm"]["token_ids"] == generated and choice["finish_reason"] == plain_choice["finish_reason"]
    assert answer["usage"]["completion_tokens"] == len(generated)


async def test_lm_eval_reads_the_loglikelihood_of_a_continuation(fake_theta, fake_t):
    """lm-eval's local-completions request for loglikelihood, parsed by lm-eval's own code."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    context, continuation = tokenize("abc"), tokenize("def")
    async with running(fake_theta, fake_t, WHOLE_VOCAB) as (url, _):
        status, answer = await post(url, "/v1/completions", {  # LocalCompletionsAPI._create_payload(generate=False)
            "model": MODEL, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True})
    assert status == 200, answer
    ((loglikelihood, greedy),) = LocalCompletionsAPI.parse_logprobs(answer, ctxlens=[len(context)])
    want, _ = exact("abcdef", fake_theta.model, fake_t.model)
    assert loglikelihood == pytest.approx(sum(want[len(context) - 1:]), abs=1e-6)
    top = echoed(answer)[0]["top_logprobs"]
    assert greedy == all(max(row.values()) == row[c] for row, c in zip(top[3:6], "def"))


async def test_echo_without_logprobs_repeats_the_prompt_and_scores_nothing(fake_theta, fake_t):
    async with running(fake_theta, fake_t) as (url, _):
        before = len(fake_theta.calls["/v1/completions"])
        status, answer = await post(url, "/v1/completions", echo("abc", logprobs=None))
        assert status == 200, answer
        assert len(fake_theta.calls["/v1/completions"]) == before  # no prompt logprobs asked, nothing generated
    choice = answer["choices"][0]
    assert (choice["text"], choice["logprobs"]) == ("abc", None) and "prompt" not in choice["dualvllm"]


async def test_the_pair_and_its_fixed_alpha_names_are_listed(service):
    url, _ = service
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as response:
        cards = (await response.json())["data"]
    assert [(c["id"], c["dualvllm"].get("fixed_alpha")) for c in cards] == [
        (MODEL, None), (f"{MODEL}@alpha=0", 0.0), (f"{MODEL}@alpha=1", 1.0)]


@pytest.mark.parametrize("body, status, param, words", [
    (echo("abc", stream=True), 400, None, "echo is not streamed"),
    (echo("abc", dualvllm={"t_prompt": "abcd"}), 400, None, "t_prompt"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": 0}, 400, "max_tokens", "echo=true"),
    (echo("abc", max_tokens=-1), 400, "max_tokens", "greater than or equal to 0"),
    (echo("abc", model=f"{MODEL}@alpha=2"), 400, "model", "in [0, 1]"),
    (echo("abc", model=f"{MODEL}@alpha=base"), 400, "model", "in [0, 1]"),
    (echo("abc", model=f"{MODEL}@alpha=0", dualvllm={"fixed_alpha": 1.0}), 400, "dualvllm.fixed_alpha",
     "give one of them"),
    (echo("abc", model="other@alpha=0"), 404, "model", "does not exist"),
    (echo("abc", dualvllm={"top_k": 9}), 400, "dualvllm.top_k", "top_k=9"),
])
async def test_echo_requests_q_star_cannot_answer_are_refused_with_openai_errors(service, body, status, param, words):
    url, _ = service
    got, answer = await post(url, "/v1/completions", body)
    assert (got, answer["error"]["param"]) == (status, param), answer
    assert answer["error"]["type"] == "invalid_request_error" and words in answer["error"]["message"]


async def test_the_prompt_tokens_a_request_scores_count_toward_its_ceiling(fake_theta, fake_t):
    async with running(fake_theta, fake_t, max_request_tokens=10) as (url, _):
        got, answer = await post(url, "/v1/completions", echo(["abcdef", "ghijkl"]))  # 12 tokens to score
        assert (got, answer["error"]["code"], answer["error"]["param"]) == (400, "request_too_large", "prompt")
        assert "scores 12 prompt tokens" in answer["error"]["message"]
        assert (await post(url, "/v1/completions", echo("abcdef")))[0] == 200
        assert (await post(url, "/v1/completions", echo(["abcdef", "ghijkl"], logprobs=None)))[0] == 200  # no scoring


@pytest.mark.parametrize("scale_out", [True, False], ids=["generate-route", "echo-route"])
async def test_the_client_reads_prompt_logprobs_and_refuses_a_malformed_answer(fake_theta, monkeypatch, scale_out):
    """VLLMClient.prompt_topk checks what vLLM sent back against the prompt it asked about."""
    fake_theta.scale_out = scale_out
    async with VLLMClient(fake_theta.url, max_retries=0) as client:
        (rows,) = await client.prompt_topk([[1, 2, 3]], 4)
        assert rows.token_ids.shape == (2, 5)  # positions 1 and 2; the top 4 and maybe the token
        for row, (context, token) in enumerate([([1], 2), ([1, 2], 3)]):
            assert token in rows.token_ids[row]
            got = rows.logprobs[row][list(rows.token_ids[row]).index(token)]
            assert got == pytest.approx(fake_theta.model.logprobs(context)[token])
        fake_theta.max_logprobs = 2  # a k above the server's --max-logprobs: what to change, not a 502
        with pytest.raises(TopKUnsupportedError, match="--max-logprobs 4"):
            await client.prompt_topk([[1, 2, 3]], 4)
        fake_theta.max_logprobs = 20
        original = fake_theta._echo

        def without_own_token(index, prompt, k, key):  # a proxy or a server that dropped the prompt token
            rows = [None] + [{key(99): -1.0}] * (len(prompt) - 1)
            return {**original(index, prompt, k, key), "logprobs": {"tokens": [key(t) for t in prompt],
                                                                     "top_logprobs": rows}}

        def rows_without_own_token(prompt, k):
            return [None] + [{"99": {"logprob": -1.0, "rank": 1, "decoded_token": None}}] * (len(prompt) - 1)

        monkeypatch.setattr(fake_theta, "_echo", without_own_token)
        monkeypatch.setattr(fake_theta, "_prompt_logprobs", rows_without_own_token)
        with pytest.raises(MalformedResponseError, match="own token"):
            await client.prompt_topk([[1, 2, 3]], 4)
