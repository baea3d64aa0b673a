"""VLLMClient over real loopback HTTP against the fake vLLM: request shape, parsing, retries, errors."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from dualvllm.common.errors import (
    InvalidInputError,
    LifecycleError,
    MalformedResponseError,
    ServerConnectError,
    ServerInternalError,
    ServerRejectedError,
    ServerTimeoutError,
    ServerUnavailableError,
    TopKUnsupportedError,
    UnknownModelError,
)
from dualvllm.engines.http import RetryPolicy, request_json
from dualvllm.engines.vllm_client import VLLMClient
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
        assert (c.transport.retries, c.transport.failures, c.transport.requests) == (2, 0, 4)  # /v1/models + 3 tries


async def test_5xx_gives_up_after_max_retries_with_typed_error(fake_theta):
    fake_theta.fail_next("/v1/completions", *[Failure(500, "engine dead")] * 3)
    async with client(fake_theta.url, max_retries=2) as c:
        with pytest.raises(ServerInternalError, match=r"theta .*HTTP 500: engine dead"):
            await c.next_token_topk([[1]], k=2)
        assert (c.transport.retries, c.transport.failures) == (2, 1)


async def test_4xx_is_never_retried(fake_theta):
    fake_theta.fail_next("/v1/completions", Failure(422, "bad prompt"), Failure(422))
    async with client(fake_theta.url, max_retries=5) as c:
        with pytest.raises(ServerRejectedError) as info:
            await c.next_token_topk([[1]], k=2)
        assert info.value.status == 422 and c.transport.retries == 0
    assert len(fake_theta.calls["/v1/completions"]) == 1


async def test_too_large_top_k_names_the_server_flag(fake_theta):
    async with client(fake_theta.url) as c:
        with pytest.raises(TopKUnsupportedError, match="--max-logprobs 50"):
            await c.next_token_topk([[1]], k=50)


async def test_timeouts_are_retried_then_typed(fake_theta):
    fake_theta.fail_next("/tokenize", Failure(0, delay_s=1.0))
    async with client(fake_theta.url, request_timeout_s=0.3, max_retries=1) as c:
        assert await c.tokenize("abc") == [1, 2, 3]  # the retry succeeds
        assert c.transport.retries == 1
        fake_theta.fail_next("/tokenize", Failure(0, delay_s=1.0), Failure(0, delay_s=1.0))
        with pytest.raises(ServerTimeoutError, match="request_timeout"):
            await c.tokenize("abc")


async def test_unreachable_server_is_typed_and_says_what_to_check():
    async with client("http://127.0.0.1:9", max_retries=1) as c:
        with pytest.raises(ServerUnavailableError, match="is it running"):
            await c.health()
        assert c.transport.retries == 1


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


@pytest.mark.parametrize("logprobs, call", [
    ({"top_logprobs": [{"12345678901": -0.1}]}, lambda c: c.next_token_topk([[1]], k=2)),
    ({"tokens": ["7"], "top_logprobs": [{"7": -0.1, "3": -2.5}]},
     lambda c: c.draft([1], max_tokens=1, k=2, temperature=1.0, seed=0)),
], ids=["next_token_topk", "draft"])
async def test_logprob_keys_without_token_ids_are_refused(fake_theta, logprobs, call):
    # A server (or proxy) that ignored return_tokens_as_token_ids keys entries by text.
    answer = {"choices": [{"index": 0, "logprobs": logprobs}]}
    fake_theta.fail_next("/v1/completions", Failure(200, json.dumps(answer)))
    async with client(fake_theta.url) as c:
        with pytest.raises(MalformedResponseError, match="return_tokens_as_token_ids"):
            await call(c)


async def test_a_draft_row_drops_the_drafted_token_vllm_adds_beyond_the_top_k(fake_theta):
    answer = {"choices": [{"index": 0, "logprobs": {"tokens": ["token_id:9", "token_id:2"], "top_logprobs": [
        {"token_id:7": -0.1, "token_id:3": -2.5, "token_id:9": -4.0},  # 9 is not in the top 2
        {"token_id:2": -0.5, "token_id:4": -1.0},
    ]}}]}
    fake_theta.fail_next("/v1/completions", Failure(200, json.dumps(answer)))
    async with client(fake_theta.url) as c:
        draft = await c.draft([1], max_tokens=2, k=2, temperature=1.0, seed=0)
    assert draft.token_ids.tolist() == [9, 2]
    assert draft.topk.token_ids.tolist() == [[7, 3, -1], [2, 4, -1]]
    assert draft.topk.logprobs.tolist() == [[-0.1, -2.5, -np.inf], [-0.5, -1.0, -np.inf]]


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
        assert info.value.status == 404 and c.transport.retries == 0


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
        monkeypatch.setattr(c.transport, "_model_info", type(info)(info.name, str(tmp_path), info.max_model_len))
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


def test_vocab_size_and_pad_token_come_from_a_readable_model_dir(tmp_path):
    from dualvllm.engines.vllm_answers import config_int as _config_int

    assert _config_int(tmp_path, "vocab_size") is None  # nothing to read: unknown
    (tmp_path / "config.json").write_text('{"text_config": {"vocab_size": 151936}}')
    assert _config_int(tmp_path, "vocab_size") == 151936
    (tmp_path / "config.json").write_text('{"vocab_size": 98, "pad_token_id": 0}')
    assert _config_int(tmp_path, "vocab_size") == 98
    assert _config_int(tmp_path, "pad_token_id", minimum=0) == 0
    (tmp_path / "config.json").write_text('{"vocab_size": 98, "pad_token_id": null}')
    assert _config_int(tmp_path, "pad_token_id", minimum=0) is None


async def test_a_local_tokenizer_is_the_models_own_and_sends_no_tokenize_requests(fake_theta):
    transformers = pytest.importorskip("transformers")
    from dualvllm import tinymodels

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


# -- which calls are resent: dualvllm.engines.http's table, ServerTransport.IDEMPOTENT_POSTS --------

ROUTES = [  # (method, path, payload, idempotent)
    ("GET", "/health", None, True),
    ("GET", "/v1/models", None, True),
    ("POST", "/tokenize", {"model": "fake-base", "prompt": "ab"}, True),
    ("POST", "/detokenize", {"model": "fake-base", "tokens": [1, 2]}, True),
    ("POST", "/v1/completions", {"model": "fake-base", "prompt": [[1]], "max_tokens": 1, "logprobs": 2}, True),
    ("POST", "/reset_prefix_cache", None, True),
    ("POST", "/pause?mode=wait", None, True),
    ("POST", "/resume", None, True),
    ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent"}}, False),
]
# A scripted stall, far beyond the request timeout of these tests; the timeout itself leaves
# a loaded machine room to answer the retry that follows.
STALL_S = 5.0
STALL_TEST_TIMEOUT_S = 1.0


@pytest.mark.parametrize("failure, error", [(Failure(503, "overloaded"), ServerInternalError),
                                            (Failure(504, "stalled", delay_s=STALL_S), ServerTimeoutError)],
                         ids=["5xx", "timeout"])
@pytest.mark.parametrize("method, path, payload, idempotent", ROUTES, ids=[r[1] for r in ROUTES])
async def test_a_call_that_changes_state_is_not_resent_after_it_may_have_acted(
        fake_theta, failure, error, method, path, payload, idempotent):
    route = path.partition("?")[0]
    fake_theta.fail_next(route, failure)
    async with client(fake_theta.url, request_timeout_s=STALL_TEST_TIMEOUT_S, max_retries=3) as c:
        if idempotent:
            await c.call(method, path, payload)
            assert c.transport.retries == 1 and len(fake_theta.calls[route]) == 2
        else:
            with pytest.raises(error):
                await c.call(method, path, payload)
            assert c.transport.retries == 0 and len(fake_theta.calls[route]) == 1


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("POST", "/collective_rpc")])
async def test_a_refused_connection_is_retried_for_every_call(method, path):
    async with client(f"http://127.0.0.1:{_closed_port()}", max_retries=2) as c:
        with pytest.raises(ServerConnectError, match="nothing was sent; is it running"):
            await c.call(method, path, {"method": "reload_weights"} if method == "POST" else None)
        assert c.transport.retries == 2


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_refused_call_reaches_the_server_once_it_listens(idempotent):
    received = []

    async def reload(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({"results": [None]})

    app = web.Application()
    app.router.add_post("/collective_rpc", reload)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/collective_rpc"
    refused, serving = [], []

    def come_up(err):
        refused.append(err)
        sock.listen()  # the retry's connection now waits in the backlog for the server below
        serving.append(asyncio.ensure_future(web.SockSite(runner, sock).start()))

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            answer = await request_json(session, "POST", url, server="theta", payload={"method": "reload_weights"},
                                        retry=RetryPolicy(max_retries=1, base_delay_s=0.0),
                                        idempotent=idempotent, on_retry=come_up)
    finally:
        await runner.cleanup()
        sock.close()
    assert answer == {"results": [None]}
    assert [type(e) for e in refused] == [ServerConnectError] and received == [{"method": "reload_weights"}]


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_connection_lost_after_sending_is_resent_only_if_idempotent(idempotent):
    requests = []

    async def read_then_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(read_then_hang_up, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/collective_rpc"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            with pytest.raises(ServerUnavailableError, match="may have received the request") as info:
                await request_json(session, "POST", url, server="theta", payload={"method": "reload_weights"},
                                   retry=RetryPolicy(max_retries=2, base_delay_s=0.0), idempotent=idempotent)
    finally:
        server.close()
        await server.wait_closed()
    assert not isinstance(info.value, ServerConnectError)
    assert len(requests) == (3 if idempotent else 1)


async def _streaming_completions(release: asyncio.Event, chunks: list[bytes],
                                 seen: list[dict] | None = None) -> tuple[web.AppRunner, str]:
    """A /v1/completions that starts a streamed answer at once and sends `chunks` on `release`;
    the request bodies go to `seen`."""
    seen = [] if seen is None else seen

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)  # the headers go out now, as vLLM's do
        await release.wait()
        for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "root": "m", "max_model_len": 64}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_a_lockstep_request_is_accepted_when_its_stream_starts_and_ends_with_its_finish_reason():
    release = asyncio.Event()
    seen: list[dict] = []
    runner, url = await _streaming_completions(release, [
        b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n',
        b'data: {"choices": [{"text": "bc", "finish_reason": "stop"}]}\n\n',
        b"data: [DONE]\n\n"], seen)
    accepted = asyncio.Event()
    try:
        async with client(url) as c:
            request = asyncio.create_task(c.forced_generation([1, 2], max_tokens=9, stop_token=0,
                                                              lockstep_args={"dualvllm_id": 5},
                                                              on_accepted=accepted.set))
            await asyncio.wait_for(accepted.wait(), 10)  # before any token: the body is held back
            assert not request.done()
            release.set()
            assert await request == "stop"
    finally:
        await runner.cleanup()
    (sent,) = seen
    assert sent["stream"] is True and sent["stream_interval"] == 10  # first and last token only
    assert sent["vllm_xargs"] == {"dualvllm_id": 5}


@pytest.mark.parametrize("chunks, message", [
    ([b'data: {"error": {"message": "engine dead"}}\n\n'], "error in the stream"),
    ([b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n', b"data: [DONE]\n\n"], "without a finish_reason"),
], ids=["error-chunk", "no-finish"])
async def test_a_lockstep_stream_that_reports_an_error_or_no_end_is_a_malformed_answer(chunks, message):
    release = asyncio.Event()
    release.set()
    runner, url = await _streaming_completions(release, chunks)
    try:
        async with client(url) as c:
            with pytest.raises(MalformedResponseError, match=message):
                await c.forced_generation([1], max_tokens=2, stop_token=0, lockstep_args={})
    finally:
        await runner.cleanup()
