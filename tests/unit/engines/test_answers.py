"""dualvllm.engines.vllm_answers: vLLM's /v1/completions answers read into the engine's types, no server."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from hypothesis import given, strategies as st

from dualvllm.engines import vllm_answers as answers
from dualvllm.engines.protocol import PAD_TOKEN_ID


def key(token: int) -> str:
    return f"token_id:{token}"


def next_token_body(rows: list[dict[int, float]], order: list[int] | None = None) -> bytes:
    """A /v1/completions answer with one next-token top-k per choice, in `order` (default: prompt order)."""
    order = list(range(len(rows))) if order is None else order
    choices = [{"index": i, "text": "", "logprobs": {"top_logprobs": [{key(t): v for t, v in rows[i].items()}]}}
               for i in order]
    return json.dumps({"id": "cmpl-1", "choices": choices, "usage": {}}).encode()


def read_next(body: bytes, batch_size: int, k: int):
    return answers.next_token_rows(answers.decode_completion(body), batch_size, k, answers.TokenIdCache())


def test_rows_come_back_in_prompt_order_padded_to_k_plus_one():
    rows = [{5: -0.1, 7: -2.5}, {9: -0.3}, {1: -1.0, 2: -1.5, 3: -3.0}]  # the last has k + 1: the sampled token
    batch = read_next(next_token_body(rows, order=[2, 0, 1]), 3, k=2)
    assert batch.token_ids.tolist() == [[5, 7, PAD_TOKEN_ID], [9, PAD_TOKEN_ID, PAD_TOKEN_ID], [1, 2, 3]]
    assert batch.logprobs[0, :2].tolist() == [-0.1, -2.5] and np.isneginf(batch.logprobs[1, 1:]).all()


@given(st.lists(st.dictionaries(st.integers(0, 151_935), st.floats(-50, 0), min_size=1, max_size=6),
                min_size=1, max_size=8), st.randoms())
def test_any_order_of_choices_gives_the_same_rows(rows, rng):
    order = list(range(len(rows)))
    rng.shuffle(order)
    shuffled, straight = read_next(next_token_body(rows, order), len(rows), 5), read_next(next_token_body(rows),
                                                                                         len(rows), 5)
    assert np.array_equal(shuffled.token_ids, straight.token_ids)
    assert np.array_equal(shuffled.logprobs, straight.logprobs)
    for row, ids in zip(rows, straight.token_ids):
        assert sorted(ids[ids != PAD_TOKEN_ID].tolist()) == sorted(row)


@pytest.mark.parametrize(("body", "batch_size", "message"), [
    (next_token_body([{1: -0.1}]), 2, "expected 2 choices"),
    (next_token_body([{1: -0.1}, {2: -0.2}], order=[0, 0]), 2, r"choice indices \[0, 0\]"),
    (json.dumps({"choices": [{"index": 0, "logprobs": None}]}).encode(), 1, "choice without top_logprobs"),
    (json.dumps({"choices": [{"index": 0, "logprobs": {"top_logprobs": [{"hello": -0.1}]}}]}).encode(), 1,
     "return_tokens_as_token_ids"),
    (next_token_body([{1: -0.1, 2: -0.2, 3: -0.3, 4: -0.4}]), 1, "more than 3 logprobs in a row"),
])
def test_a_malformed_next_token_answer_is_a_value_error_that_says_what(body, batch_size, message):
    with pytest.raises(ValueError, match=message):
        read_next(body, batch_size, k=2)


def test_a_body_that_is_not_a_completion_is_a_decode_error():
    with pytest.raises(msgspec.DecodeError):  # a ValueError: the transport reports it as malformed
        read_next(b'{"object": "error"}', 1, k=2)


def echo_body(prompts: list[list[int]], tops: list[list[dict[int, float] | None]]) -> dict:
    return {"choices": [{"index": i, "logprobs": {"tokens": [key(t) for t in p],
                                                  "top_logprobs": [None if r is None else {key(t): v for t, v in
                                                                                           r.items()} for r in top]}}
                        for i, (p, top) in enumerate(zip(prompts, tops))]}


def test_echoed_prompt_rows_start_at_the_second_token_and_keep_its_own_entry():
    prompts = [[4, 8, 2]]
    tops = [[None, {8: -0.5, 3: -1.0, 9: -9.0}, {2: -0.1}]]  # 9: the prompt token, outside the top 2
    (batch,) = answers.echoed_prompt_rows(echo_body(prompts, tops), prompts, 2, answers.TokenIdCache())
    assert batch.token_ids.tolist() == [[8, 3, 9], [2, PAD_TOKEN_ID, PAD_TOKEN_ID]]


@given(st.lists(st.dictionaries(st.integers(0, 151_935), st.floats(-50, 0), min_size=1, max_size=4),
                min_size=1, max_size=6), st.integers(0, 151_935))
def test_the_generate_route_gives_the_rows_echo_gives(tops, first):
    """/inference/v1/generate's prompt_logprobs (plain id keys, {logprob, rank, decoded_token})
    read into the same TopKBatch as the echo answer of the same prompt."""
    prompt = [first, *(next(iter(row)) for row in tops)]  # each position's own token among its entries
    generated = json.dumps({"prompt_logprobs": [None, *({str(t): {"logprob": v, "rank": 1, "decoded_token": None}
                                                          for t, v in row.items()} for row in tops)]}).encode()
    via_generate = answers.generated_prompt_rows(generated, prompt, 4)
    (via_echo,) = answers.echoed_prompt_rows(echo_body([prompt], [[None, *tops]]), [prompt], 4,
                                             answers.TokenIdCache())
    assert np.array_equal(via_generate.token_ids, via_echo.token_ids)
    assert np.array_equal(via_generate.logprobs, via_echo.logprobs)


@pytest.mark.parametrize(("rows", "message"), [
    ([None, {"9": {"logprob": -0.5}}], "without its own token's logprob"),
    ([None], "prompt_logprobs of 1 positions for a prompt of 2 tokens"),
    ([None, {str(t): {"logprob": -1.0} for t in (8, 1, 2, 3, 4)}], "more than 3 logprobs in a row"),
])
def test_a_generate_answer_that_does_not_cover_the_prompt_is_refused(rows, message):
    with pytest.raises(ValueError, match=message):
        answers.generated_prompt_rows(json.dumps({"prompt_logprobs": rows}).encode(), [4, 8], 2)


@pytest.mark.parametrize(("echoed", "tops", "message"), [
    ([4, 7], [None, {7: -0.5}], "not the prompt's"),  # another prompt's echo
    ([4, 8], [None, {3: -0.5}], "without its own token's logprob"),
    ([4, 8], [None], "2 tokens and 1 top_logprobs for a prompt of 2 tokens"),  # a proxy cut the logprobs
])
def test_an_echo_that_does_not_match_the_prompt_sent_is_refused(echoed, tops, message):
    body = echo_body([echoed], [tops])
    body["choices"][0]["logprobs"]["tokens"] = [key(t) for t in echoed]
    with pytest.raises(ValueError, match=message):
        answers.echoed_prompt_rows(body, [[4, 8]], 2, answers.TokenIdCache())


def test_prompt_logprob_rows_are_vllms_own_in_prompt_order_and_cover_each_prompt():
    prompts = [[1, 2], [3, 4, 5]]
    rows = [[None, {"2": {"logprob": -1.0}}], [None, {"4": {"logprob": -2.0}}, {"5": {"logprob": -0.5}}]]
    body = {"choices": [{"index": 1, "prompt_logprobs": rows[1]}, {"index": 0, "prompt_logprobs": rows[0]}]}
    assert answers.prompt_logprob_rows(body, prompts) == rows
    body["choices"][0]["prompt_logprobs"] = rows[1][:2]
    with pytest.raises(ValueError, match="do not cover the prompt"):
        answers.prompt_logprob_rows(body, prompts)
    with pytest.raises(ValueError, match="once each"):
        answers.prompt_logprob_rows({"choices": [{"index": 0, "prompt_logprobs": rows[0]}] * 2}, prompts)


def test_a_draft_drops_its_own_token_when_vllm_added_it_beyond_the_top_k():
    body = {"choices": [{"index": 0, "logprobs": {
        "tokens": [key(6), key(2)],
        "top_logprobs": [{key(1): -0.2, key(3): -0.9, key(6): -4.0}, {key(2): -0.1, key(5): -2.0}]}}]}
    (draft,) = answers.drafts(body, 1, 2, answers.TokenIdCache())
    assert draft.token_ids.tolist() == [6, 2]
    assert draft.topk.token_ids.tolist() == [[1, 3, PAD_TOKEN_ID], [2, 5, PAD_TOKEN_ID]]


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_a_stream_gives_its_last_finish_reason_and_reports_an_error_chunk():
    assert answers.streamed_finish_reason(sse({"choices": [{"finish_reason": None}]},
                                              {"choices": [{"finish_reason": "stop"}]})) == "stop"
    with pytest.raises(ValueError, match="error in the stream: boom"):
        answers.streamed_finish_reason(sse({"error": "boom"}))
    with pytest.raises(ValueError, match="without a finish_reason"):
        answers.streamed_finish_reason(sse({"choices": [{"finish_reason": None}]}))
