"""Concurrent prompt-scoring requests merged into one server call (dualvllm.service.batching).

The server side is a coroutine gated by events: a call stays in flight until the test lets it
answer, so what queues behind it is decided by the test, not by the clock.
"""

from __future__ import annotations

import asyncio

import pytest

from dualvllm.common.errors import LifecycleError, ServerRejectedError, ServerUnavailableError
from dualvllm.service.batching import Batcher
from tests.waiting import eventually


class GatedServer:
    """Answers each prompt with its own sum, one call at a time, when the test opens the gate."""

    def __init__(self, reject: int | None = None, fail_first: bool = False) -> None:
        self.calls: list[list[list[int]]] = []
        self.gate = asyncio.Event()
        self.reject, self.fail_first = reject, fail_first

    async def send(self, prompts, key):
        self.calls.append([list(p) for p in prompts])
        await self.gate.wait()
        if self.fail_first and len(self.calls) == 1:
            raise ServerUnavailableError("theta", "http://x", "connection refused")
        if self.reject is not None and any(self.reject in p for p in prompts):
            raise ServerRejectedError("theta", "http://x", 400, "prompt too long")
        return [sum(p) * 10 + key for p in prompts]


async def test_requests_that_arrive_while_a_call_is_in_flight_go_out_as_one_call():
    server = GatedServer()
    batcher = Batcher(server.send)
    first = asyncio.create_task(batcher.score([[1, 2]], 1))
    await eventually(lambda: len(server.calls) == 1, "the first request's call left at once")
    rest = [asyncio.create_task(batcher.score([[i], [i, i]], 1)) for i in range(3, 7)]
    await eventually(lambda: len(batcher._queues.get(1, [])) == 4, "the later requests queued behind it")
    server.gate.set()
    assert await first == [31]
    assert [await r for r in rest] == [[10 * i + 1, 20 * i + 1] for i in range(3, 7)]
    assert len(server.calls) == 2 and len(server.calls[1]) == 8  # the four merged: 2 prompts each


async def test_different_keys_never_share_a_call_and_a_call_stays_within_its_token_budget():
    server = GatedServer()
    server.gate.set()
    batcher = Batcher(server.send, max_tokens=4)
    answers = await asyncio.gather(batcher.score([[1, 1, 1]], 1), batcher.score([[2, 2]], 2),
                                   batcher.score([[3, 3]], 1), batcher.score([[4]], 1))
    assert answers == [[31], [42], [61], [41]]
    assert all(sum(len(p) for p in call) <= 4 for call in server.calls)


async def test_a_refused_call_is_split_so_only_the_bad_request_fails():
    server = GatedServer(reject=99)
    batcher = Batcher(server.send)
    first = asyncio.create_task(batcher.score([[1]], 0))
    await eventually(lambda: len(server.calls) == 1, "the first call left")
    good, bad = asyncio.create_task(batcher.score([[2]], 0)), asyncio.create_task(batcher.score([[99]], 0))
    await eventually(lambda: len(batcher._queues.get(0, [])) == 2, "both queued")
    server.gate.set()
    assert await first == [10] and await good == [20]
    with pytest.raises(ServerRejectedError, match="too long"):
        await bad


async def test_a_failed_call_fails_the_requests_it_carried_and_no_other():
    server = GatedServer(fail_first=True)
    batcher = Batcher(server.send)
    carried = asyncio.create_task(batcher.score([[1]], 0))
    await eventually(lambda: len(server.calls) == 1, "the first call left")
    later = asyncio.create_task(batcher.score([[2]], 0))
    await eventually(lambda: len(batcher._queues.get(0, [])) == 1, "the second queued")
    server.gate.set()
    with pytest.raises(ServerUnavailableError):
        await carried
    assert await later == [20]


async def test_a_caller_that_leaves_does_not_cancel_the_call_others_share_and_shutdown_fails_the_queue():
    server = GatedServer()
    batcher = Batcher(server.send)
    leaving = asyncio.create_task(batcher.score([[1]], 0))
    await eventually(lambda: len(server.calls) == 1, "the call left")
    queued = asyncio.create_task(batcher.score([[2]], 0))
    await eventually(lambda: len(batcher._queues.get(0, [])) == 1, "one queued")
    leaving.cancel()
    sender = batcher._senders[0]
    assert not sender.cancelled()
    sender.cancel()  # the service stops: the queued request hears why instead of waiting for ever
    with pytest.raises(LifecycleError, match="stopped before this prompt was scored"):
        await queued


@pytest.mark.parametrize("call_tokens", [16_384, 0], ids=["merged", "scoring_call_tokens-0"])
async def test_concurrent_echo_requests_get_the_answers_each_would_get_alone(fake_theta, fake_t, call_tokens):
    from tests.unit.service.test_service import MODEL, post, running

    prompts = ["abc", "abcdef", "hgfe", "ab", "mnoabc", "cab"]

    def echo(prompt: str) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}

    # Merging is the echo route's: where a server has /inference/v1/generate, each prompt is its own request.
    fake_theta.scale_out = fake_t.scale_out = False
    async with running(fake_theta, fake_t, scoring_call_tokens=call_tokens) as (url, _):
        alone = [await post(url, "/v1/completions", echo(p)) for p in prompts]
        fake_theta.running.clear()  # the base holds its calls: the requests below queue behind the first
        t_before = len(fake_t.calls["/v1/completions"])
        together = [asyncio.create_task(post(url, "/v1/completions", echo(p))) for p in prompts]

        def teacher_saw_all() -> bool:  # each request queues for the base as it sends to the teacher
            return sum(len(c["prompt"]) for c in fake_t.calls["/v1/completions"][t_before:]) == len(prompts)

        await eventually(teacher_saw_all, "every concurrent request reached the (ungated) teacher")
        fake_theta.running.set()
        together = [await t for t in together]
    assert [s for s, _ in together] == [200] * len(prompts)
    for (_, one), (_, merged) in zip(alone, together):
        assert merged["choices"][0]["logprobs"] == one["choices"][0]["logprobs"]
    echoes = [len(c["prompt"]) for c in fake_theta.calls["/v1/completions"] if c.get("echo")]
    # alone: one call each; together: the call in flight when the base was held (the requests that
    # had arrived by then), then all the rest as one
    assert echoes[:len(prompts)] == [1] * len(prompts)
    assert sum(echoes[len(prompts):]) == len(prompts)
    if call_tokens:
        assert len(echoes) - len(prompts) in (1, 2)
    else:  # each request its own call, as before issue 44 (benchmarks/scoring_throughput.py's reference arm)
        assert echoes[len(prompts):] == [1] * len(prompts)
