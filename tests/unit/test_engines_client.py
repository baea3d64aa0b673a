"""VLLMClient over real loopback HTTP against the fake vLLM: request shape, parsing, retries, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.errors import (
    InvalidInputError,
    LifecycleError,
    MalformedResponseError,
    ServerInternalError,
    ServerRejectedError,
    ServerTimeoutError,
    ServerUnavailableError,
    TopKUnsupportedError,
    UnknownModelError,
)
from engines.vllm_client import VLLMClient
from tests.fake_vllm import EOS_ID, Failure


def client(url: str, **kw) -> VLLMClient:
    kw.setdefault("retry_delay_s", 0.0)
    return VLLMClient(url, name="theta", **kw)


async def test_topk_batches_all_contexts_into_one_request(fake_theta):
    async with client(fake_theta.url) as c:
        batch = await c.next_token_topk([[1, 2], [3]], k=4)
    (request,) = fake_theta.calls["/v1/completions"]
    assert request["prompt"] == [[1, 2], [3]]
    assert request["max_tokens"] == 1 and request["logprobs"] == 4
    assert request["temperature"] == 0.0 and request["return_tokens_as_token_ids"] is True
    assert batch.token_ids.shape == (2, 5)  # k + 1: vLLM may add the sampled token
    for row, context in enumerate([[1, 2], [3]]):
        exact = fake_theta.model.logprobs(context)
        ids = batch.token_ids[row, :4]
        np.testing.assert_allclose(batch.logprobs[row, :4], exact[ids])
        assert set(ids) == set(np.argsort(-exact)[:4])
        assert batch.token_ids[row, 4] == -1 and np.isneginf(batch.logprobs[row, 4])


async def test_5xx_is_retried_then_succeeds_and_is_counted(fake_theta):
    fake_theta.fail_next("/v1/completions", Failure(503), Failure(500))
    async with client(fake_theta.url, max_retries=3) as c:
        batch = await c.next_token_topk([[1]], k=2)
        assert batch.token_ids.shape == (1, 3)
        assert (c.retries, c.failures, c.requests) == (2, 0, 4)  # /v1/models + 3 tries


async def test_5xx_gives_up_after_max_retries_with_typed_error(fake_theta):
    fake_theta.fail_next("/v1/completions", *[Failure(500, "engine dead")] * 3)
    async with client(fake_theta.url, max_retries=2) as c:
        with pytest.raises(ServerInternalError, match=r"theta .*HTTP 500: engine dead"):
            await c.next_token_topk([[1]], k=2)
        assert (c.retries, c.failures) == (2, 1)


async def test_4xx_is_never_retried(fake_theta):
    fake_theta.fail_next("/v1/completions", Failure(422, "bad prompt"), Failure(422))
    async with client(fake_theta.url, max_retries=5) as c:
        with pytest.raises(ServerRejectedError) as info:
            await c.next_token_topk([[1]], k=2)
        assert info.value.status == 422 and c.retries == 0
    assert len(fake_theta.calls["/v1/completions"]) == 1


async def test_too_large_top_k_names_the_server_flag(fake_theta):
    async with client(fake_theta.url) as c:
        with pytest.raises(TopKUnsupportedError, match="--max-logprobs 50"):
            await c.next_token_topk([[1]], k=50)


async def test_timeouts_are_retried_then_typed(fake_theta):
    fake_theta.fail_next("/tokenize", Failure(0, delay_s=1.0))
    async with client(fake_theta.url, request_timeout_s=0.3, max_retries=1) as c:
        assert await c.tokenize("abc") == [1, 2, 3]  # the retry succeeds
        assert c.retries == 1
        fake_theta.fail_next("/tokenize", Failure(0, delay_s=1.0), Failure(0, delay_s=1.0))
        with pytest.raises(ServerTimeoutError, match="request_timeout"):
            await c.tokenize("abc")


async def test_unreachable_server_is_typed_and_says_what_to_check():
    async with client("http://127.0.0.1:9", max_retries=1) as c:
        with pytest.raises(ServerUnavailableError, match="is it running"):
            await c.health()
        assert c.retries == 1


async def test_malformed_answer_is_reported_not_misparsed(fake_theta):
    fake_theta.fail_next("/v1/completions", Failure(200, json.dumps({"choices": [{"index": 0, "logprobs": None}]})))
    fake_theta.fail_next("/v1/completions", Failure(200, "<html>proxy</html>"))
    async with client(fake_theta.url) as c:
        with pytest.raises(MalformedResponseError, match="top_logprobs"):
            await c.next_token_topk([[1]], k=2)
        with pytest.raises(MalformedResponseError, match="expected JSON"):
            await c.next_token_topk([[1]], k=2)


async def test_choices_are_put_back_in_prompt_order(fake_theta):
    answer = {"choices": [
        {"index": 1, "text": "x", "logprobs": {"top_logprobs": [{"token_id:7": -0.1, "token_id:3": -2.5}]}},
        {"index": 0, "text": "y", "logprobs": {"top_logprobs": [{"token_id:2": -0.5}]}},
    ], "usage": {"prompt_tokens": 3}}
    fake_theta.fail_next("/v1/completions", Failure(200, json.dumps(answer)))
    async with client(fake_theta.url) as c:
        batch = await c.next_token_topk([[1], [2, 3]], k=2)
    assert batch.token_ids.tolist() == [[2, -1, -1], [7, 3, -1]]
    assert batch.logprobs.tolist() == [[-0.5, -np.inf, -np.inf], [-0.1, -2.5, -np.inf]]


async def test_logprob_keys_without_token_ids_are_refused(fake_theta):
    # A server (or proxy) that ignored return_tokens_as_token_ids keys entries by text.
    answer = {"choices": [{"index": 0, "logprobs": {"top_logprobs": [{"12345678901": -0.1}]}}]}
    fake_theta.fail_next("/v1/completions", Failure(200, json.dumps(answer)))
    async with client(fake_theta.url) as c:
        with pytest.raises(MalformedResponseError, match="return_tokens_as_token_ids"):
            await c.next_token_topk([[1]], k=2)


async def test_fewer_logprobs_than_asked_are_padded(fake_theta):
    # The fake vocabulary has 16 tokens: asking for 20 gets 16 back, the rest is padding.
    async with client(fake_theta.url) as c:
        batch = await c.next_token_topk([[1, 2]], k=20)
    assert batch.token_ids.shape == (1, 21)
    assert (batch.token_ids[0] >= 0).sum() == 16 and set(batch.token_ids[0, 16:]) == {-1}
    assert np.all(np.isneginf(batch.logprobs[0, 16:]))
    np.testing.assert_allclose(np.logaddexp.reduce(batch.logprobs[0, :16]), 0.0, atol=1e-9)


async def test_unknown_model_name_lists_what_the_server_serves(fake_theta):
    async with client(fake_theta.url, model="Qwen/Qwen2.5-7B") as c:
        with pytest.raises(UnknownModelError, match=r"serves \['fake-base'\]"):
            await c.model_info()
    async with client(fake_theta.url, model="fake-base") as c:
        assert (await c.model_info()).name == "fake-base"


async def test_a_model_name_the_server_rejects_is_a_4xx_not_a_retry(fake_theta):
    async with client(fake_theta.url, max_retries=3) as c:
        with pytest.raises(ServerRejectedError, match="does not exist") as info:
            await c.call("POST", "/tokenize", {"model": "other", "prompt": "x"})
        assert info.value.status == 404 and c.retries == 0


async def test_api_key_is_sent_as_bearer_token(fake_theta):
    fake_theta.api_key = "s3cret"
    async with client(fake_theta.url, api_key="wrong") as c:
        with pytest.raises(ServerRejectedError, match="401"):
            await c.model_info()
    async with client(fake_theta.url, api_key="s3cret") as c:
        assert (await c.model_info()).name == "fake-base"


async def test_eos_comes_from_tokenizer_info_when_the_model_dir_is_remote(fake_theta):
    async with client(fake_theta.url) as c:
        assert await c.eos_token_ids() == frozenset({EOS_ID})


async def test_eos_is_empty_when_the_server_cannot_tell(fake_theta):
    fake_theta.fail_next("/tokenizer_info", Failure(404, "Not Found"))
    async with client(fake_theta.url) as c:
        assert await c.eos_token_ids() == frozenset()


async def test_eos_comes_from_a_readable_model_dir(fake_theta, tmp_path, monkeypatch):
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 9]}')
    (tmp_path / "config.json").write_text('{"eos_token_id": 7}')
    async with client(fake_theta.url) as c:
        info = await c.model_info()
        monkeypatch.setattr(c, "_model_info", type(info)(info.name, str(tmp_path), info.max_model_len))
        assert await c.eos_token_ids() == frozenset({7, 9})


async def test_client_lifecycle_is_enforced(fake_theta):
    c = client(fake_theta.url)
    with pytest.raises(LifecycleError, match="async with"):
        await c.tokenize("x")
    async with c:
        pass
    with pytest.raises(LifecycleError, match="already entered"):
        async with c:
            pass


def test_vocab_size_comes_from_a_readable_model_dir(tmp_path):
    from engines.vllm_client import _vocab_size_from_model_dir

    assert _vocab_size_from_model_dir(tmp_path) is None  # nothing to read: unknown
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 151936}}')
    assert _vocab_size_from_model_dir(tmp_path) == 151936
    (tmp_path / "config.json").write_text('{"vocab_size": 98}')
    assert _vocab_size_from_model_dir(tmp_path) == 98


async def test_a_local_tokenizer_is_the_models_own_and_sends_no_tokenize_requests(fake_theta):
    transformers = pytest.importorskip("transformers")
    import tinymodels

    fake_theta.root = str(tinymodels.BASE_DIR)
    expected = transformers.AutoTokenizer.from_pretrained(tinymodels.BASE_DIR)
    async with VLLMClient(fake_theta.url, local_tokenizer=True) as client:
        ids = await client.tokenize("12+34= 46")
        text = await client.detokenize(ids)
    assert ids == expected("12+34= 46")["input_ids"] and text == "12+34= 46"
    assert "/tokenize" not in fake_theta.calls and "/detokenize" not in fake_theta.calls


async def test_a_local_tokenizer_needs_the_model_directory_here(fake_theta):
    async with VLLMClient(fake_theta.url, name="theta", local_tokenizer=True) as client:
        with pytest.raises(InvalidInputError, match="theta server's model directory /nonexistent/fake-base has no "
                                                    "tokenizer files readable here"):
            await client.tokenize("ab")
