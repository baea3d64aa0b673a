"""Streams of the q* service over fake vLLM servers: logprobs, read with the `openai` client as
its users read them, and a stream the client leaves.

A stream's logprobs put together are the whole answer's (same seed, same q* draws), and
each chunk carries the logprobs of the tokens it brings, as vLLM streams them, not the
choice's last chunk alone. A stream left mid-way leaves no task behind in the service.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from dualvllm.service.streaming import ChoiceText, Decided
from tests.unit.service.test_service import MODEL, completion, in_flight, metrics_text, post, running
from tests.waiting import eventually

openai = pytest.importorskip("openai")

# Long enough for many chunks (the fakes end a sequence with EOS after 40 tokens).
TOKENS = 20
CHAT = {"messages": [{"role": "user", "content": "abc"}], "logprobs": True, "top_logprobs": 2}
COMPLETION = {"prompt": "abc", "logprobs": 3}


async def whole_and_chunks(fake_theta, fake_t, route: str) -> tuple[Any, list[Any]]:
    """(the answer, every chunk of the same request streamed) from the `openai` client."""
    fake_theta.model.eos_after = fake_t.model.eos_after = 40
    async with running(fake_theta, fake_t) as (url, _):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            create = client.chat.completions.create if route == "chat" else client.completions.create
            request = {"model": MODEL, "max_tokens": TOKENS, "seed": 5, **(CHAT if route == "chat" else COMPLETION)}
            whole = await create(**request)
            chunks = [chunk async for chunk in await create(**request, stream=True)]
    return whole, chunks


def chunk_logprobs(chunks: list[Any], route: str) -> list[list[tuple]]:
    """Per chunk, (token, logprob, top candidates, text offset) of each token it carries."""
    found = []
    for chunk in chunks:
        logprobs = chunk.choices[0].logprobs
        assert logprobs is not None, f"a chunk without logprobs: {chunk}"
        if route == "chat":
            found.append([(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs], None)
                          for e in logprobs.content])
        else:
            found.append(list(zip(logprobs.tokens, logprobs.token_logprobs,
                                  [sorted(top.items()) for top in logprobs.top_logprobs], logprobs.text_offset)))
    return found


def whole_logprobs(whole: Any, route: str) -> list[tuple]:
    return chunk_logprobs([whole], route)[0]


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_streamed_logprobs_add_up_to_the_whole_answers(fake_theta, fake_t, route):
    whole, chunks = await whole_and_chunks(fake_theta, fake_t, route)
    streamed = [token for chunk in chunk_logprobs(chunks, route) for token in chunk]
    assert streamed == whole_logprobs(whole, route)
    assert len(streamed) == whole.usage.completion_tokens > 2
    text = "".join(c.choices[0].delta.content if route == "chat" else c.choices[0].text for c in chunks)
    assert text == (whole.choices[0].message.content if route == "chat" else whole.choices[0].text)


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_each_chunk_carries_the_logprobs_of_the_tokens_it_brings(fake_theta, fake_t, route):
    whole, chunks = await whole_and_chunks(fake_theta, fake_t, route)
    per_chunk = [len(tokens) for tokens in chunk_logprobs(chunks, route)]
    assert sum(per_chunk) == whole.usage.completion_tokens
    # Tokens are reported as steps decide them: most chunks bring some, the last few at most.
    assert sum(1 for n in per_chunk[:-1] if n) > 2, per_chunk
    assert per_chunk[-1] < sum(per_chunk) // 2, per_chunk


async def test_a_stream_left_mid_way_leaves_no_task_behind(fake_theta, fake_t):
    fake_theta.model.eos_after = fake_t.model.eos_after = 60

    async def tasks() -> float:
        return float(next(line.split()[-1] for line in (await metrics_text(url)).splitlines()
                          if line.startswith("dualvllm_asyncio_tasks ")))

    async with running(fake_theta, fake_t) as (url, _):
        assert (await post(url, "/v1/completions", completion(max_tokens=4)))[0] == 200  # connections made
        at_rest = await tasks()
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=completion(max_tokens=50, stream=True)) as response:
                assert (await response.content.readline()).startswith(b"data: ")
                response.close()  # the client leaves after its first chunk

        async def let_go() -> bool:
            return await in_flight(url) == 0 and await tasks() <= at_rest

        await eventually(let_go, f"the abandoned stream's sequence and tasks gone (at rest: {at_rest:g} tasks)")


# -- what a streamed choice shows, synchronously (dualvllm.service.streaming.ChoiceText) ---------------

def test_text_waits_for_a_whole_character_and_past_a_possible_stop_string():
    choice = ChoiceText(hold=len("STOP") - 1, stops=("STOP",))  # the last 3 characters may begin "STOP"
    assert choice.delta("abcd\ufffd") == "a"  # the incomplete character goes, then "bcd" waits
    assert choice.delta("abcdef") == "bc"
    assert choice.delta("abcdefST") == "de"  # "fST" waits
    assert choice.delta("abcdefSTOPxyz") == "f"  # cut at the stop string
    assert choice.last("abcdef") == ""  # the final text ends before the stop string: all sent


def test_logprobs_of_decided_tokens_are_reported_once_each():
    choice = ChoiceText(hold=0, stops=())
    choice.add(Decided([5, 6], [-0.5, -1.0], [{5: -0.5}, {6: -1.0}]))
    reported = choice.unlogged(with_top=True)
    assert (list(reported.ids), list(reported.logprobs), list(reported.top)) == ([5, 6], [-0.5, -1.0],
                                                                                [{5: -0.5}, {6: -1.0}])
    assert choice.unlogged(with_top=False).top is None
    choice.logged = 2  # what the chunk that carried them counts
    choice.add(Decided([7], [-2.0], [{7: -2.0}]))
    assert (list(choice.unlogged(with_top=True).ids), list(choice.unlogged(with_top=True).logprobs)) == ([7], [-2.0])
