"""vLLM's tokens-in, tokens-out routes on the q* service (issue 44): /inference/v1/generate and
/v1/chat/completions/render, in the pinned vLLM's shapes, over two fake vLLM servers and real
loopback HTTP. A generate request is the /v1/completions request with token ids as its
prompt, so the same seed must give the same tokens through both routes.
"""

from __future__ import annotations

import re

import pytest

from tests.fake_vllm import tokenize
from tests.unit.service.test_service import MODEL, post, running


@pytest.fixture
async def service(fake_theta, fake_t):
    async with running(fake_theta, fake_t, coordinator={"top_k": 8}) as (url, coordinator):
        yield url, coordinator


def generate(**fields):
    params = {"max_tokens": 6, "seed": 3, **fields.pop("sampling_params", {})}
    return {"token_ids": tokenize("abc"), "sampling_params": params, **fields}


async def test_generate_gives_token_ids_and_log_q_star_in_vllms_shape(service):
    url, _ = service
    status, body = await post(url, "/inference/v1/generate", generate(
        request_id="r-1", return_token_ids=True, sampling_params={"n": 2, "logprobs": 3},
        dualvllm={"return_token_ids": True}))
    assert status == 200, body
    assert body["request_id"] == "r-1" and body["model"] == MODEL and body["output_mode"] == "tokens"
    assert body["prompt_token_ids"] == tokenize("abc")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    generated = 0
    for choice in body["choices"]:
        record = choice["dualvllm"]
        assert choice["token_ids"] == record["token_ids"] and "text" not in choice
        content = choice["logprobs"]["content"]
        assert [e["token_id"] for e in content] == record["token_ids"]
        assert [e["logprob"] for e in content] == pytest.approx(record["logprobs_q"], abs=1e-12)
        for entry in content:
            top = entry["top_logprobs"]
            # vLLM's order and cut: the sampled token first, then the likeliest others, logprobs entries in all
            assert top[0] == {"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": entry["rank"]}
            assert len(top) == 3 and len({t["token_id"] for t in top}) == 3
            others = [t["logprob"] for t in top[1:]]
            assert others == sorted(others, reverse=True)
            assert all(t["rank"] >= 1 for t in top[1:])
        generated += len(choice["token_ids"])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": generated, "total_tokens": 3 + generated}


async def test_generate_samples_what_the_same_completion_request_samples(service):
    url, _ = service
    status, completion = await post(url, "/v1/completions", {
        "model": MODEL, "prompt": tokenize("abc"), "max_tokens": 6, "seed": 3, "n": 2, "return_token_ids": True})
    assert status == 200, completion
    status, body = await post(url, "/inference/v1/generate", generate(output_mode="text", sampling_params={"n": 2}))
    assert status == 200, body
    assert [c["token_ids"] for c in body["choices"]] == [c["token_ids"] for c in completion["choices"]]
    assert [c["text"] for c in body["choices"]] == [c["text"] for c in completion["choices"]]
    assert all(c["logprobs"] is None for c in body["choices"])  # none asked for


async def test_generate_logprobs_zero_shows_the_sampled_token_alone_and_text_mode_names_tokens(service):
    url, _ = service
    status, body = await post(url, "/inference/v1/generate", generate(sampling_params={"logprobs": 0}))
    assert status == 200, body
    for entry in body["choices"][0]["logprobs"]["content"]:
        assert entry["top_logprobs"] == [{"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": None}]
    status, text = await post(url, "/inference/v1/generate", generate(output_mode="text",
                                                                      sampling_params={"logprobs": 1}))
    assert status == 200, text
    content = text["choices"][0]["logprobs"]["content"]  # chat's shape, with token texts
    assert "".join(e["token"] for e in content if e["token"] != "<eos>") == text["choices"][0]["text"]
    assert all(len(e["top_logprobs"]) == 1 for e in content)


async def test_stop_token_ids_end_the_sequence_with_vllms_stop_reason(service):
    url, _ = service
    stop = tokenize("abcdefghijklmno")  # every id but EOS: the first token stops it
    status, body = await post(url, "/inference/v1/generate", generate(sampling_params={"stop_token_ids": stop}))
    assert status == 200, body
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 1 and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == choice["token_ids"][0]
    status, completion = await post(url, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 6,
                                                             "stop_token_ids": stop, "return_token_ids": True})
    assert status == 200 and len(completion["choices"][0]["token_ids"]) == 1, completion


async def test_the_teacher_route_generates_from_the_teacher_alone_when_no_model_is_named(service):
    url, _ = service
    status, body = await post(url, "/teacher/inference/v1/generate", generate())
    assert status == 200, body
    assert body["model"] == f"{MODEL}@alpha=1" and body["choices"][0]["dualvllm"]["mean_alpha"] == 1.0


async def test_a_rendered_chat_request_generates_the_chats_reply(service):
    url, _ = service
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 5, "seed": 7, "n": 2,
            "logprobs": True, "top_logprobs": 2}
    status, rendered = await post(url, "/v1/chat/completions/render", chat)
    assert status == 200, rendered
    assert rendered["token_ids"] == tokenize("abc") and rendered["features"] is None
    assert rendered["sampling_params"]["max_tokens"] == 5 and rendered["sampling_params"]["logprobs"] == 2
    assert "t_prompt" not in rendered["dualvllm"]  # one template renders both the same
    status, generated = await post(url, "/inference/v1/generate", rendered)
    assert status == 200, generated
    status, replied = await post(url, "/v1/chat/completions", {**chat, "return_token_ids": True})
    assert status == 200, replied
    assert [c["token_ids"] for c in generated["choices"]] == [c["token_ids"] for c in replied["choices"]]


async def test_render_carries_the_teachers_own_prompt(service):
    url, _ = service
    status, rendered = await post(url, "/v1/chat/completions/render", {
        "model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3,
        "dualvllm": {"t_messages": [{"role": "user", "content": "abcde"}]}})
    assert status == 200, rendered
    assert rendered["token_ids"] == tokenize("abc") and rendered["dualvllm"]["t_prompt"] == tokenize("abcde")
    status, generated = await post(url, "/inference/v1/generate", rendered)
    assert status == 200, generated


@pytest.mark.parametrize("fields, message", [
    ({"features": {"mm_hashes": {}, "mm_placeholders": {}}}, "multimodal features"),
    ({"stream": True}, "not streamed here"),
    ({"sampling_params": {"top_k": 5}}, r"top_k=5 would truncate q\*"),
    ({"sampling_params": {"best_of": 2}}, "unknown field 'sampling_params.best_of'"),
    ({"sampling_params": {"include_stop_str_in_output": True}}, "include_stop_str_in_output"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, -1]}, "token_ids.1: Input should be greater than or equal to 0"),
    ({"model": "other"}, "does not exist here"),
])
async def test_generate_refuses_what_it_cannot_do_with_the_reason(service, fields, message):
    url, _ = service
    status, body = await post(url, "/inference/v1/generate", generate(**fields))
    assert status in (400, 404), body
    assert re.search(message, body["error"]["message"]), body
