"""Given prompts scored by a vLLM server: the top-k before every prompt token, or vLLM's own
prompt logprobs. `VLLMClient` delegates its prompt_topk and prompt_logprobs here; a scorer takes the
server's transport (dualvllm.engines.vllm_transport), not the client.

The top-k has two routes that give the same rows. Where the server has /inference/v1/generate
(vLLM's --enable-scale-out, which dualvllm's launcher passes), one request per prompt with
`detokenize` off. Through /v1/completions, vLLM turns each of the k entries at every position
into text, even with `return_tokens_as_token_ids`, which a q* score never reads: at k = 20 that
cost a server 1.2x the CPU per scored request at Qwen's vocabulary, 1.7-1.9x on the bundled models
(benchmarks/README.md, scoring_throughput.py). Elsewhere (a 403 or a 404 on the first call: an older vLLM, or a
server started without the flag), echo on /v1/completions, every prompt in one request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from collections.abc import Sequence

from dualvllm.common.errors import ServerRejectedError
from dualvllm.engines import vllm_answers as answers
from dualvllm.engines.protocol import TopKBatch
from dualvllm.engines.vllm_transport import GENERATE_PATH, ServerTransport

ROUTE_ABSENT = frozenset({403, 404})  # disabled (vLLM's answer without the flag), or unknown


class PromptScorer:
    """Scores given prompts with the model the server behind `transport` serves."""

    def __init__(self, transport: ServerTransport) -> None:
        self._transport = transport
        self._token_ids = answers.TokenIdCache()
        self.generate_route: bool | None = None  # the server answers GENERATE_PATH; None: not yet asked

    async def topk(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        """The top-k before every token of each prompt but its first.

        Answer i has len(prompts[i]) - 1 rows; row j holds the raw logprobs of the distribution
        prompts[i][j + 1] was drawn from, with that token's own logprob always among them:
        vLLM adds it as a (k+1)-th entry when it is outside the top k. Not for decoding: a
        prompt-logprobs request bypasses the prefix cache, so its cost grows with the prompt.
        """
        if self.generate_route is None and prompts:
            try:
                first = await self._generated(prompts[0], k)
            except ServerRejectedError as err:
                if err.status not in ROUTE_ABSENT:
                    raise
                self.generate_route = False
            else:
                self.generate_route = True
                return [first, *await asyncio.gather(*(self._generated(p, k) for p in prompts[1:]))]
        if self.generate_route:
            return list(await asyncio.gather(*(self._generated(p, k) for p in prompts)))
        return await self._echoed(prompts, k)

    async def logprobs(self, prompts: Sequence[Sequence[int]], k: int) -> list[list[dict[str, Any] | None]]:
        """vLLM's own prompt logprobs of each prompt, as its server gives them: per position
        None (position 0), then {"<token id>": {"logprob", "rank", "decoded_token"}} with the
        top k and the position's own token at its true rank (k = -1: the whole vocabulary,
        if the server allows it). One batched request; a q* service passes them through
        when a request scores with one model alone, so vLLM's decoded tokens are kept."""
        info = await self._transport.model_info()
        payload = {
            "model": info.name,
            "prompt": [list(p) for p in prompts],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": k,
        }
        return await self._transport.completions(
            payload, k, decode=lambda raw: answers.prompt_logprob_rows(json.loads(raw), prompts)
        )

    async def _generated(self, prompt: Sequence[int], k: int) -> TopKBatch:
        info = await self._transport.model_info()
        payload = {
            "model": info.name,
            "token_ids": list(prompt),
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k, "detokenize": False},
        }
        return await self._transport.completions(
            payload, k, decode=lambda raw: answers.generated_prompt_rows(raw, prompt, k), path=GENERATE_PATH
        )

    async def _echoed(self, prompts: Sequence[Sequence[int]], k: int) -> list[TopKBatch]:
        info = await self._transport.model_info()
        payload = {
            "model": info.name,
            "prompt": [list(p) for p in prompts],
            "max_tokens": 0,
            "echo": True,
            "logprobs": k,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        ids = self._token_ids
        return await self._transport.completions(
            payload, k, decode=lambda raw: answers.echoed_prompt_rows(json.loads(raw), prompts, k, ids)
        )
