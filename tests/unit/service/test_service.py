"""The q* HTTP service (service/) over real loopback HTTP, on a coordinator over two fake vLLM servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import aiohttp
import pytest

from dualvllm.common.errors import InvalidInputError
from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator
from dualvllm.service.app import serve
from dualvllm.service.config import ServiceConfig
from tests.fake_vllm import EOS_ID, VOCAB_SIZE, FakeModel, FakeVLLM, Failure, detokenize, tokenize
from tests.waiting import eventually

MODEL = "fake-base+fake-teacher"


@contextlib.asynccontextmanager
async def running(theta: FakeVLLM, t: FakeVLLM, coordinator: dict[str, Any] | None = None,
                  **service: Any) -> AsyncIterator[tuple[str, DualVLLMCoordinator]]:
    """(base URL, coordinator) of a q* service started by dualvllm.service.app.serve on a free port."""
    options = {**dict(retry_delay=0.0, top_k=8, mode="per_token", max_retries=1), **(coordinator or {})}
    async with DualVLLMCoordinator(CoordinatorConfig(theta_url=theta.url, t_url=t.url, **options)) as c:
        listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(c, ServiceConfig(service_port=0, **service),
                                         ready=lambda url, model: listening.set_result(url)))
        try:
            yield await asyncio.wait_for(listening, 10), c
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def service(fake_theta, fake_t):
    async with running(fake_theta, fake_t) as (url, coordinator):
        yield url, coordinator


async def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with session.post(url + path, data=data, headers=headers) as response:
            return response.status, await response.json(content_type=None)


async def events(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The data of every server-sent event of a streamed request ("[DONE]" kept as a string)."""
    found = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            async for line in response.content:
                if line.startswith(b"data: "):
                    data = line[6:].strip().decode()
                    found.append(data if data == "[DONE]" else json.loads(data))
    return found


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "abc", "max_tokens": 12, "seed": 5, **fields}


# -- completions -------------------------------------------------------------------------

async def test_a_completion_has_openai_shape_usage_and_the_q_star_record(service):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(n=2, dualvllm={"return_token_ids": True}))
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    generated = 0
    for choice in body["choices"]:
        record = choice["dualvllm"]
        tokens = record["token_ids"]
        generated += len(tokens)
        assert len(record["alpha"]) == len(record["logprobs_q"]) == len(record["logprobs_theta"]) \
            == len(record["logprobs_t"]) == len(tokens) >= 1
        assert record["mean_alpha"] == pytest.approx(sum(record["alpha"]) / len(tokens))
        if record["finish_reason"] == "eos":
            assert choice["finish_reason"] == "stop" and tokens[-1] == EOS_ID
            assert choice["text"] == detokenize(tokens[:-1])
        else:
            assert (choice["finish_reason"], record["finish_reason"], len(tokens)) == ("length", "max_tokens", 12)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": generated, "total_tokens": 3 + generated}


async def test_the_service_samples_what_the_python_api_samples_for_the_same_seed(service):
    url, coordinator = service
    status, body = await post(url, "/v1/completions", completion(prompt=["abc", "de"], n=2))
    assert status == 200, body
    direct = await coordinator.generate_batch(["abc", "abc", "de", "de"], max_tokens=12, seed=5)
    assert [c["text"] for c in body["choices"]] == [o.generated_text for o in direct]
    assert [c["dualvllm"]["mean_alpha"] for c in body["choices"]] == pytest.approx([o.mean_alpha for o in direct])


@pytest.mark.parametrize("prompt, count, prompt_tokens", [
    ("abc", 1, 3), (["abc", "de"], 2, 5), ([1, 2, 3], 1, 3), ([[1, 2, 3], [4, 5]], 2, 5)])
async def test_every_openai_prompt_form_is_a_batch_of_prompts(service, prompt, count, prompt_tokens):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(prompt=prompt, n=3))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(3 * count))
    assert body["usage"]["prompt_tokens"] == prompt_tokens


async def test_q_star_options_fix_alpha_and_give_the_teacher_its_own_prompt(service, fake_t):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(
        dualvllm={"fixed_alpha": 0.0, "t_prompt": "abcde", "return_token_ids": True}))
    assert status == 200, body
    assert set(body["choices"][0]["dualvllm"]["alpha"]) == {0.0}
    teacher_contexts = [p for call in fake_t.calls["/v1/completions"][1:] for p in call["prompt"]]
    assert teacher_contexts[0] == tokenize("abcde")


async def test_stop_strings_end_choices_with_finish_reason_stop(service):
    url, _ = service
    plain = (await post(url, "/v1/completions", completion(max_tokens=6)))[1]["choices"][0]["text"]
    assert len(plain) >= 2, "the fake model should write at least two characters for this seed"
    status, body = await post(url, "/v1/completions", completion(max_tokens=6, stop=[plain[1]]))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == plain[:plain.index(plain[1])] and choice["finish_reason"] == "stop"
    assert choice["dualvllm"]["finish_reason"] == "stop_string"


async def test_logprobs_are_log_q_star_of_each_token_with_q_stars_top_candidates(service):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(
        logprobs=3, dualvllm={"return_token_ids": True}))
    assert status == 200, body
    choice = body["choices"][0]
    logprobs, record = choice["logprobs"], choice["dualvllm"]
    assert logprobs["token_logprobs"] == pytest.approx(record["logprobs_q"])
    texts = ["<eos>" if t == EOS_ID else detokenize([t]) for t in record["token_ids"]]
    # the fake detokenizer drops <eos>, as vLLM's skips special tokens
    assert logprobs["tokens"] == [t if t != "<eos>" else "" for t in texts]
    assert logprobs["text_offset"][0] == 0
    # As vLLM answers: the token itself first, then q*'s top 3 (the token again if among them).
    for top, token, chosen in zip(logprobs["top_logprobs"], logprobs["tokens"], logprobs["token_logprobs"]):
        (first, value), *candidates = top.items()
        assert (first, value) == (token, chosen) and 3 <= len(top) <= 4
        values = [v for _, v in candidates]  # the top 3 but the token's own entry
        assert values == sorted(values, reverse=True) and (len(top) == 3 or max(values) >= chosen - 1e-9)


async def test_top_k_mixes_fewer_candidates_and_above_the_service_it_is_refused(service):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(logprobs=5, dualvllm={"top_k": 1}))
    assert status == 200, body
    # one candidate per model: q* has at most two tokens to choose from
    assert all(len(top) <= 2 for top in body["choices"][0]["logprobs"]["top_logprobs"])
    status, body = await post(url, "/v1/completions", completion(dualvllm={"top_k": 9}))
    assert status == 400 and body["error"]["code"] == "top_k_unsupported"
    assert "at most 8" in body["error"]["message"]


# -- chat --------------------------------------------------------------------------------

async def test_chat_renders_messages_with_each_models_template(service, fake_theta, fake_t):
    url, _ = service
    status, body = await post(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "system", "content": "ignored"}, {"role": "user", "content": "abc"}],
        "max_tokens": 10, "seed": 1, "dualvllm": {"t_messages": [{"role": "user", "content": "abcde"}]}})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert body["usage"]["prompt_tokens"] == 3
    assert [c for c in fake_theta.calls["/tokenize"] if "messages" in c][0]["add_generation_prompt"] is True
    assert [c for c in fake_t.calls["/tokenize"] if "messages" in c][0]["messages"][0]["content"] == "abcde"


async def test_chat_logprobs_and_default_max_tokens_fill_the_context(service):
    url, _ = service
    status, body = await post(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}],
        "logprobs": True, "top_logprobs": 2, "seed": 2})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) <= 2 and entry["bytes"] == list(entry["token"].encode())
               for entry in content)


async def test_a_model_without_chat_template_is_a_400(fake_t):
    theta = FakeVLLM(FakeModel(seed=1), name="fake-base", chat_template=False)
    await theta.start()
    try:
        async with running(theta, fake_t) as (url, _):
            status, body = await post(url, "/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "abc"}]})
        assert status == 400 and "chat template" in body["error"]["message"]
    finally:
        await theta.close()


# -- streaming ---------------------------------------------------------------------------

async def test_a_streamed_completion_adds_up_to_the_whole_one(fake_theta, fake_t):
    fake_theta.model.eos_after = fake_t.model.eos_after = 40  # long enough to arrive in several chunks
    async with running(fake_theta, fake_t) as (url, _):
        whole = (await post(url, "/v1/completions", completion(n=2, max_tokens=20)))[1]
        found = await events(url, "/v1/completions", completion(
            n=2, max_tokens=20, stream=True, stream_options={"include_usage": True}))
    assert found[-1] == "[DONE]"
    *chunks, usage = found[:-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert len(mine) > 2, "tokens should stream in several chunks"
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [choice["finish_reason"]]
        assert mine[-1]["dualvllm"] == choice["dualvllm"]


async def test_streamed_text_never_shows_a_stop_string(fake_theta, fake_t):
    fake_theta.model.eos_after = fake_t.model.eos_after = 40
    async with running(fake_theta, fake_t) as (url, _):
        plain = (await post(url, "/v1/completions", completion(max_tokens=20)))[1]["choices"][0]["text"]
        stop = plain[8:10]
        whole = (await post(url, "/v1/completions", completion(max_tokens=20, stop=stop)))[1]["choices"][0]
        found = await events(url, "/v1/completions", completion(max_tokens=20, stop=stop, stream=True))
    text = "".join(c["choices"][0]["text"] for c in found[:-1])
    assert text == whole["text"] == plain[:plain.index(stop)]


async def test_a_streamed_chat_opens_with_the_assistant_role(service):
    url, _ = service
    found = await events(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 8, "stream": True})
    chunks = [c for c in found if c != "[DONE]"]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


# -- bad requests ------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ([1, 2], 400, None),
    ({"model": MODEL, "prompt": "abc", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "abc", "temprature": 0.5}, 400, "temprature"),
    ({"model": MODEL, "prompt": "abc", "dualvllm": {"alpha": 0.5}}, 400, "dualvllm.alpha"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": [True, False]}, 400, "prompt"),  # JSON booleans are not token ids
    ({"model": MODEL, "prompt": [[5], ["a"]]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "abc", "dualvllm": {"t_prompt": [False]}}, 400, "dualvllm.t_prompt"),
    ({"model": MODEL, "prompt": ""}, 400, None),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": 100}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "abc", "top_p": 0.9}, 400, None),
    ({"model": MODEL, "prompt": "abc", "echo": True, "stream": True}, 400, None),
    ({"model": MODEL, "prompt": "abc", "n": 2000, "max_tokens": 40}, 400, "n"),
    ({"model": "gpt-4", "prompt": "abc"}, 404, "model"),
])
async def test_bad_requests_get_openai_error_objects(service, body, status, param):
    url, _ = service
    got, answer = await post(url, "/v1/completions", body)
    assert got == status, answer
    error = answer["error"]
    assert error["message"] and error["type"] and error["param"] == param
    assert "Traceback" not in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [5, VOCAB_SIZE]}, "prompt"),
    ({"prompt": [[5], [-1]]}, "prompt"),
    ({"prompt": "abc", "dualvllm": {"t_prompt": [5, 99999]}}, "dualvllm.t_prompt"),
])
async def test_token_ids_outside_the_vocabulary_are_refused_before_any_server(tmp_path, fake_theta, fake_t, body,
                                                                            param):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE}))  # what the service reads it from
    fake_theta.root = fake_t.root = str(tmp_path)
    async with running(fake_theta, fake_t) as (url, coordinator):
        assert coordinator.session.vocab_size == VOCAB_SIZE
        served = len(fake_theta.calls["/v1/completions"])
        status, answer = await post(url, "/v1/completions", {"model": MODEL, **body})
        assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, param, "invalid_token_id")
        assert f"outside the vocabulary of {VOCAB_SIZE} tokens" in answer["error"]["message"]
        assert len(fake_theta.calls["/v1/completions"]) == served  # no server saw it
        assert (await post(url, "/v1/completions", {"model": MODEL, "prompt": [5, VOCAB_SIZE - 1], "max_tokens": 2}))[0] == 200


async def test_a_context_too_long_names_the_limit(service):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(prompt="abcdefghij" * 6, max_tokens=8))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in body["error"]["message"]


async def test_unknown_routes_and_oversized_bodies_get_error_objects(fake_theta, fake_t):
    async with running(fake_theta, fake_t, max_body_bytes=2048) as (url, _):
        status, body = await post(url, "/v1/embeddings", {"model": MODEL, "input": "abc"})
        assert status == 404 and body["error"]["type"] == "invalid_request_error"
        status, body = await post(url, "/v1/completions", completion(prompt="a" * 4096))
        assert status == 413 and "error" in body


async def test_a_server_that_keeps_failing_is_a_502_and_the_service_goes_on(service, fake_theta):
    url, _ = service
    fake_theta.fail_next("/v1/completions", Failure(503), Failure(503))
    status, body = await post(url, "/v1/completions", completion())
    assert status == 502 and "theta" in body["error"]["message"]
    assert (await post(url, "/v1/completions", completion()))[0] == 200


# -- limits, auth, sharing ---------------------------------------------------------------

async def test_a_full_queue_answers_429_with_retry_after(fake_theta, fake_t):
    fake_theta.model.eos_after = fake_t.model.eos_after = 60
    async with running(fake_theta, fake_t, {"max_batch_size": 2}, max_queued_sequences=1) as (url, _):
        before = len(fake_theta.calls["/v1/completions"])
        fake_theta.running.clear()  # the base holds the first request's first step until the 429 is seen
        first = asyncio.create_task(post(url, "/v1/completions", completion(n=3, max_tokens=24)))
        await eventually(lambda: len(fake_theta.calls["/v1/completions"]) > before, "the first request's first step")
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=completion(n=1)) as response:
                assert response.status == 429
                assert 1 <= int(response.headers["Retry-After"]) <= 60
                assert (await response.json())["error"]["code"] == "queue_full"
        fake_theta.running.set()
        assert (await first)[0] == 200
        assert (await post(url, "/v1/completions", completion(n=3)))[0] == 200  # room again


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as response:
            return await response.text()


async def in_flight(url: str) -> float:
    """Sequences the service holds, running or queued (its /metrics gauges)."""
    text = await metrics_text(url)
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("dualvllm_active_sequences ", "dualvllm_queued_sequences ")))


async def test_concurrent_clients_share_the_coordinators_steps(fake_theta, fake_t):
    async with running(fake_theta, fake_t) as (url, _):
        before = len(fake_theta.calls["/v1/completions"])
        fake_theta.running.clear()  # the base holds every step until all six requests are in
        requests = [asyncio.create_task(post(url, "/v1/completions", completion(seed=i, max_tokens=8)))
                    for i in range(6)]

        async def all_in() -> bool:
            return await in_flight(url) == 6

        await eventually(all_in, "all six requests' sequences in the service")
        fake_theta.running.set()
        results = await asyncio.gather(*requests)
    assert all(status == 200 for status, _ in results)
    batches = [len(call["prompt"]) for call in fake_theta.calls["/v1/completions"][before:]]
    assert max(batches) >= 4, f"requests should share steps, got batches {batches}"


async def test_an_api_key_guards_everything_but_health(fake_theta, fake_t):
    async with running(fake_theta, fake_t, api_key="s3cret") as (url, _):
        status, body = await post(url, "/v1/completions", completion())
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert (await post(url, "/v1/completions", completion(), {"Authorization": "Bearer wrong"}))[0] == 401
        assert (await post(url, "/v1/completions", completion(), {"Authorization": "Bearer s3cret"}))[0] == 200
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as response:
                assert response.status == 200
            async with session.get(url + "/metrics") as response:
                assert response.status == 401


def test_binding_beyond_loopback_needs_a_key(monkeypatch):
    monkeypatch.delenv("DUALVLLM_API_KEY", raising=False)
    with pytest.raises(InvalidInputError, match="not loopback"):
        ServiceConfig(service_host="0.0.0.0")
    assert ServiceConfig(service_host="0.0.0.0", api_key="k").api_key is not None


CANCELLED_4 = 'dualvllm_sequences_total{outcome="cancelled"} 4.0'
ABANDONED_1 = 'dualvllm_requests_total{route="/v1/completions",status="499"} 1.0'


async def test_a_client_that_disconnects_cancels_its_sequences(fake_theta, fake_t):
    fake_theta.model.eos_after = fake_t.model.eos_after = 60
    fake_theta.completion_delay_s = 0.05
    async with running(fake_theta, fake_t) as (url, coordinator):
        before = len(fake_theta.calls["/v1/completions"])
        async with aiohttp.ClientSession() as session:
            leaving = asyncio.create_task(session.post(url + "/v1/completions", json=completion(n=4, max_tokens=50)))
            # The client leaves once its sequences are generating (their first step asked for).
            await eventually(lambda: len(fake_theta.calls["/v1/completions"]) > before, "the request's first step")
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving

        async def let_go() -> bool:
            text = await metrics_text(url)
            return await in_flight(url) == 0 and CANCELLED_4 in text and ABANDONED_1 in text

        # The service cancels the sequences and lets go of them: nothing is left to step.
        await eventually(let_go, "the four sequences of the client that left, cancelled and gone")
        metrics = await metrics_text(url)
    assert CANCELLED_4 in metrics
    assert ABANDONED_1 in metrics
    assert coordinator.get_statistics()["tokens"] < 4 * 50


async def test_models_health_and_metrics(service):
    url, _ = service
    assert (await post(url, "/v1/completions", completion()))[0] == 200
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as response:
            card = (await response.json())["data"][0]
        async with session.get(url + "/health") as response:
            assert response.status == 200 and (await response.json())["mode"] == "per_token"
        async with session.get(url + "/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            metrics = await response.text()
    assert card["id"] == MODEL and card["max_model_len"] == 64 and card["dualvllm"]["top_k"] == 8
    assert 'dualvllm_requests_total{route="/v1/completions",status="200"} 1.0' in metrics
    assert 'dualvllm_sequences_total{outcome="finished"} 1.0' in metrics
    assert 'dualvllm_server_call_seconds_count{route="/v1/completions",server="theta"}' in metrics
    assert "dualvllm_alpha_mean " in metrics and "dualvllm_tokens_per_second " in metrics
    assert "dualvllm_active_sequences 0.0" in metrics


async def test_a_stream_refuses_bad_options_before_it_starts_and_reports_failures_inside(service, fake_theta):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(stream=True, dualvllm={"top_k": 9}))
    assert status == 400 and body["error"]["code"] == "top_k_unsupported"  # a plain answer, no stream
    fake_theta.fail_next("/v1/completions", Failure(503), Failure(503))
    found = await events(url, "/v1/completions", completion(stream=True))
    assert found[-1] == "[DONE]" and found[-2]["error"]["type"] == "upstream_error"
    assert "theta" in found[-2]["error"]["message"]


# -- what the `openai` client raises for each kind of bad request ---------------------------

@pytest.mark.parametrize("kwargs, error", [
    ({"max_tokens": -1}, "BadRequestError"),
    ({"n": 0}, "BadRequestError"),
    ({"temperature": -1}, "BadRequestError"),
    ({"extra_body": {"temperature": "hot"}}, "BadRequestError"),
    ({"extra_body": {"dualvllm": {"fixed_alpha": 2}}}, "BadRequestError"),
    ({"extra_body": {"temprature": 0.5}}, "BadRequestError"),  # an unknown field
    ({"prompt": [True, False]}, "BadRequestError"),
    ({"prompt": [5, 99999]}, "BadRequestError"),  # outside the vocabulary
    ({"max_tokens": 100}, "BadRequestError"),  # beyond the context
    ({"top_p": 0.5}, "BadRequestError"),  # what q* cannot do
    ({"model": "gpt-4"}, "NotFoundError"),
    ({"api_key": "wrong"}, "AuthenticationError"),
])
async def test_the_openai_client_raises_the_exception_its_users_catch(tmp_path, fake_theta, fake_t, kwargs, error):
    openai = pytest.importorskip("openai")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE}))
    fake_theta.root = fake_t.root = str(tmp_path)
    async with running(fake_theta, fake_t, api_key="sk-right") as (url, _):
        request = {"model": MODEL, "prompt": "abc", "max_tokens": 4, **kwargs}
        key = request.pop("api_key", "sk-right")
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as client:
            with pytest.raises(getattr(openai, error)) as raised:
                await client.completions.create(**request)
        assert raised.value.body["message"] and "Traceback" not in raised.value.body["message"]
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-right", max_retries=0) as client:
            assert len((await client.completions.create(model=MODEL, prompt="abc", max_tokens=2)).choices) == 1
