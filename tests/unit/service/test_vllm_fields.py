"""vLLM's own request fields on the q* service, as TRL's stock client sends them (issue 44).

TRL's `trl.generation.vllm_client.VLLMClient` (the client every TRL trainer uses in server
mode) talks to the service here over real loopback HTTP, on a coordinator over two fake vLLM
servers; tests/integration/training/test_service_trl.py runs it against real ones. The client is
synchronous (requests): it runs in a thread while the service answers on the event loop.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.fake_vllm import tokenize
from tests.unit.service.test_service import MODEL, events, post, running

vllm_client = pytest.importorskip("trl.generation.vllm_client")


@pytest.fixture
async def service(fake_theta, fake_t):
    async with running(fake_theta, fake_t, coordinator={"top_k": 8}) as (url, coordinator):
        yield url, coordinator


def completion(**fields):
    return {"model": MODEL, "prompt": "abc", "max_tokens": 6, "seed": 3, **fields}


async def test_trl_generate_gets_ids_and_log_q_star_per_token(service):
    url, _ = service
    client = await asyncio.to_thread(vllm_client.VLLMClient, base_url=url)
    assert client.model == MODEL
    out = await asyncio.to_thread(client.generate, ["abc", "abcd"], n=2, max_tokens=5, logprobs=2,
                                  generation_kwargs={"seed": 4})
    # prompt-major: the n completions of a prompt come before the next prompt's
    assert out["prompt_ids"] == [tokenize("abc"), tokenize("abcd")]
    assert len(out["completion_ids"]) == 4
    for ids, logprobs, logprob_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert 1 <= len(ids) <= 5 and len(logprobs) == len(ids) == len(logprob_ids)
        for token, row, row_ids in zip(ids, logprobs, logprob_ids):
            assert token in row_ids and 2 <= len(row) <= 3  # the token and q*'s top 2
            assert row == sorted(row, reverse=True)


async def test_the_returned_ids_and_logprobs_are_the_coordinators_log_q_star(service):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(
        n=2, logprobs=0, return_token_ids=True, return_tokens_as_token_ids=True, dualvllm={"return_token_ids": True}))
    assert status == 200, body
    for choice in body["choices"]:
        record = choice["dualvllm"]
        assert choice["prompt_token_ids"] == tokenize("abc")
        assert choice["token_ids"] == record["token_ids"]
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{t}" for t in record["token_ids"]]
        assert logprobs["token_logprobs"] == pytest.approx(record["logprobs_q"], abs=1e-12)
        # logprobs 0: each position holds the token alone, as vLLM answers
        assert logprobs["top_logprobs"] == [{f"token_id:{t}": v} for t, v in zip(record["token_ids"],
                                                                               record["logprobs_q"])]


async def test_trl_chat_gets_the_rendered_prompt_and_forwards_template_kwargs(service, fake_theta):
    url, _ = service
    client = await asyncio.to_thread(vllm_client.VLLMClient, base_url=url)
    out = await asyncio.to_thread(client.chat, [[{"role": "user", "content": "abc"}]], n=2, max_tokens=4,
                                  logprobs=1, chat_template_kwargs={"enable_thinking": False})
    assert out["prompt_ids"] == [tokenize("abc")] and len(out["completion_ids"]) == 2
    assert all(len(lp) == len(ids) for lp, ids in zip(out["logprobs"], out["completion_ids"]))
    rendered = [c for c in fake_theta.calls["/tokenize"] if "messages" in c]
    assert rendered[-1]["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("fields, message", [
    ({"top_k": 5}, r"top_k=5 would truncate q\*.* dualvllm\.top_k"),
    ({"repetition_penalty": 1.1}, "repetition_penalty is not supported"),
    ({"min_p": 0.05}, "min_p is not supported"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
], ids=["top_k", "repetition_penalty", "min_p", "structured_outputs"])
async def test_what_q_star_cannot_honour_is_refused_with_its_reason(service, fields, message):
    import re

    url, _ = service
    status, body = await post(url, "/v1/completions", completion(**fields))
    assert status == 400 and re.search(message, body["error"]["message"]), body


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "abc"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]}),
], ids=["completion", "chat"])
async def test_streamed_token_ids_put_together_are_the_whole_answers(service, path, body):
    """vLLM's return_token_ids in a stream: each chunk's new ids, the prompt's ids once per choice."""
    url, _ = service
    request = {"model": MODEL, "max_tokens": 6, "seed": 5, "n": 2, "return_token_ids": True, **body}
    status, whole = await post(url, path, request)
    assert status == 200, whole
    chunks = [c for c in await events(url, path, {**request, "stream": True}) if c != "[DONE]"]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompts = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["token_ids"]
            prompts += [ids for ids in (choice.get("prompt_token_ids"), chunk.get("prompt_token_ids")) if ids]
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in whole["choices"]]
    assert prompts == [tokenize("abc")] * 2  # with each choice's first chunk only


async def test_trl_defaults_are_accepted_as_neutral(service):
    """TRL sends top_k 0, min_p 0 and repetition_penalty 1 on every request: no truncation, no penalty."""
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(top_k=0, min_p=0.0, repetition_penalty=1.0,
                                                                  ignore_eos=True, max_tokens=6))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 6  # ignore_eos, vLLM's top-level field: full length


# -- prompt_logprobs: what TRL's get_sequence_logprobs asks (teacher scoring) -----------------------

def model_logprobs(seed: int, prompt: list[int], position: int):
    from tests.fake_vllm import FakeModel

    return FakeModel(seed=seed).logprobs(prompt[:position])


async def test_trl_sequence_logprobs_from_the_teacher_alone_are_the_teachers_own(service):
    """`<name>@alpha=1` scores with the teacher's server alone: its own logprobs, its own ranks."""
    url, _ = service
    client = await asyncio.to_thread(vllm_client.VLLMClient, base_url=url)
    client.model = f"{MODEL}@alpha=1"  # what a distillation trainer's teacher client is pointed at
    sequences = [tokenize("abcdef"), tokenize("abchgf")]
    out = await asyncio.to_thread(client.get_sequence_logprobs, sequences, [3, 2], top_logprobs=4)
    for sequence, start, top, top_ids, actual in zip(sequences, [3, 2], out["logprobs"], out["logprob_token_ids"],
                                                     out["actual_logprobs"]):
        assert len(top) == len(sequence) - start
        for row, ids, (value,), position in zip(top, top_ids, actual, range(start, len(sequence))):
            exact = model_logprobs(2, sequence, position)  # fake_t is FakeModel(seed=2)
            assert value == pytest.approx(exact[sequence[position]], abs=1e-6)
            assert ids == [int(i) for i in (-exact).argsort(kind="stable")[:4]]
            assert row == pytest.approx(exact[ids], abs=1e-6)


async def test_q_star_prompt_logprobs_are_the_echoed_log_q_star_with_ranks(service):
    url, _ = service
    prompt = tokenize("abcdef")
    status, scored = await post(url, "/v1/completions", completion(prompt=prompt, max_tokens=1, prompt_logprobs=3))
    assert status == 200, scored
    status, echoed = await post(url, "/v1/completions", completion(prompt=prompt, max_tokens=0, echo=True,
                                                                   logprobs=3, return_tokens_as_token_ids=True))
    assert status == 200, echoed
    rows, echo = scored["choices"][0]["prompt_logprobs"], echoed["choices"][0]["logprobs"]
    assert rows[0] is None and len(rows) == len(prompt)
    for position, (row, value) in enumerate(zip(rows[1:], echo["token_logprobs"][1:]), start=1):
        own = row[str(prompt[position])]
        assert own["logprob"] == pytest.approx(value, abs=1e-9)  # the same log q* as echo's
        # q*'s top 3 at ranks 1-3, and the token itself at its own rank (one of them, or below)
        ranks = sorted(e["rank"] for e in row.values())
        assert ranks == ([1, 2, 3] if own["rank"] <= 3 else [1, 2, 3, own["rank"]])
        values = [e["logprob"] for e in sorted(row.values(), key=lambda e: e["rank"])]
        assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("fields, message", [
    ({"prompt_logprobs": -1}, r"prompt_logprobs=-1 .* one model alone"),
    ({"prompt_logprobs": 2, "echo": True, "max_tokens": 0}, "prompt_logprobs goes with stream=false and echo=false"),
], ids=["whole-vocabulary-q*", "with-echo"])
async def test_prompt_logprobs_that_cannot_be_answered_are_refused(service, fields, message):
    import re

    url, _ = service
    status, body = await post(url, "/v1/completions", completion(**fields))
    assert status == 400 and re.search(message, body["error"]["message"]), body


async def test_prompt_logprobs_above_the_servers_limit_name_the_flag(service, fake_t):
    url, _ = service
    status, body = await post(url, "/v1/completions", completion(model=f"{MODEL}@alpha=1",
                                                                  prompt_logprobs=fake_t.max_logprobs + 1))
    assert status == 400 and "--max-logprobs" in body["error"]["message"], body


async def test_a_client_pointed_at_the_teacher_prefix_scores_with_the_teacher_alone(service):
    """TRL's distillation trainers take the first model of teacher_model_server_url: /teacher lists it first."""
    url, _ = service
    teacher = await asyncio.to_thread(vllm_client.VLLMClient, base_url=url + "/teacher")
    assert teacher.model == f"{MODEL}@alpha=1"
    base = await asyncio.to_thread(vllm_client.VLLMClient, base_url=url + "/base")
    assert base.model == f"{MODEL}@alpha=0"
    sequence = tokenize("abcdef")
    out = await asyncio.to_thread(teacher.get_sequence_logprobs, [sequence], [2], top_logprobs=3)
    exact = model_logprobs(2, sequence, 2)
    assert out["actual_logprobs"][0][0][0] == pytest.approx(exact[sequence[2]], abs=1e-6)
