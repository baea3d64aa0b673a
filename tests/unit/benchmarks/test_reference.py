"""The reference-protocol client benchmarks/throughput.py measures against, on fake servers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # `benchmarks` is not an installed package

from benchmarks.reference_protocol import ReferenceProtocolClient  # noqa: E402
from tests.fake_vllm import tokenize  # noqa: E402
from dualvllm.theory.alpha import solve_alpha  # noqa: E402
from dualvllm.theory.mixture import apply_temperature  # noqa: E402


async def test_each_token_sends_the_full_text_once_to_each_server(fake_theta, fake_t):
    prompts = ["abc", "de"]
    async with ReferenceProtocolClient(fake_theta.url, fake_t.url, top_k=16) as client:
        outputs = await client.generate(prompts, max_tokens=5, seed=0)
    assert [len(o.tokens) for o in outputs] == [5, 5] and client.requests == 2 * 2 * 5
    for server in (fake_theta, fake_t):
        sent = sorted(call["prompt"] for call in server.calls["/v1/completions"])
        # One request per sequence per token, each carrying the prompt and the text so far.
        expected = sorted(p + "".join(o.tokens[:j]) for p, o in zip(prompts, outputs) for j in range(5))
        assert sent == expected
        assert all(call["max_tokens"] == 1 and call["logprobs"] == 16 and "return_tokens_as_token_ids" not in call
                   for call in server.calls["/v1/completions"])
    for prompt, out in zip(prompts, outputs):
        assert out.text == "".join(out.tokens)


async def test_alpha_is_solved_on_the_merged_text_keyed_top_k(fake_theta, fake_t):
    async with ReferenceProtocolClient(fake_theta.url, fake_t.url, top_k=16) as client:
        (out,) = await client.generate(["abc"], max_tokens=1, seed=3)
    # k = 16 is the whole fake vocabulary: alpha* is the exact one of the two models.
    context = tokenize("abc")
    lp_theta = fake_theta.model.logprobs(context)[None, :]
    lp_t = fake_t.model.logprobs(context)[None, :]
    mask = np.ones_like(lp_theta, dtype=bool)
    exact = solve_alpha(apply_temperature(lp_theta, 1.0, mask), apply_temperature(lp_t, 1.0, mask), mask)
    assert abs(out.alphas[0] - exact[0]) < 1e-9


async def test_seeded_runs_repeat(fake_theta, fake_t):
    async with ReferenceProtocolClient(fake_theta.url, fake_t.url, top_k=16) as client:
        first = await client.generate(["ab", "cd"], max_tokens=4, seed=7)
        again = await client.generate(["ab", "cd"], max_tokens=4, seed=7)
    assert [o.tokens for o in first] == [o.tokens for o in again]
