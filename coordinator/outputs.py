"""What a generation call takes and gives back."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Union
from collections.abc import Sequence

import numpy as np

# A prompt is text, token ids, or a (theta_prompt, t_prompt) pair: the two models may see
# different prompts (e.g. the teacher gets a hint) while sharing the continuation.
PromptPart = Union[str, Sequence[int]]
Prompt = Union[PromptPart, tuple[PromptPart, PromptPart]]

FinishReason = Literal[
    "eos",  # the sampled token is an EOS id of the models
    "stop_token",  # the sampled token is one of the call's stop_token_ids
    "stop_string",  # the generated text contains one of the call's stop strings
    "max_tokens",  # the call's max_tokens were generated
    "context_limit",  # prompt + generated tokens reached a server's max_model_len
    "error",  # a request failed after its retries; see GenerationOutput.error
]


@dataclass
class GenerationOutput:
    """One finished sequence.

    The per-token logprobs are of the sampled token: `logprobs_q` under the distribution
    it was actually drawn from (q* at the call's temperature, the behaviour policy that
    importance weights need), `logprobs_theta` / `logprobs_t` the raw (temperature 1)
    logprobs the servers reported, or the fill value when the token was outside that
    model's top-k (see dualvllm.theory.merge).
    """

    index: int  # position in the call's prompt list
    prompt: Prompt
    generated_text: str
    generated_tokens: list[int]
    alpha_history: list[float]
    logprobs_q: list[float]
    logprobs_theta: list[float]
    logprobs_t: list[float]
    finish_reason: FinishReason
    diagnostics: dict[str, dict[str, float]] | None = None  # key -> {mean, std, min, max}
    error: str | None = None  # which server failed and how, when finish_reason == "error"
    # Per token, q*'s most likely candidates {token id: log q*} (at the call's temperature),
    # when the call asked for top_logprobs.
    top_logprobs: list[dict[int, float]] | None = None
    # When the call asked for record_topk=k: per token, the base's (row 0) and the teacher's
    # (row 1) k most likely ids, best first, int64 [T, 2, k], and their raw logprobs
    # (temperature 1), float64 [T, 2, k]; PAD id and -inf where a model reported fewer.
    # 32·k bytes per token (k = 20: 640 B), for losses that need the teacher's distribution.
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def mean_alpha(self) -> float:
        return sum(self.alpha_history) / len(self.alpha_history) if self.alpha_history else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (prompt pairs become two-element lists; top_logprobs and the recorded
        top-k only if asked for, as nested lists)."""
        record = asdict(self)
        for key in ("top_logprobs", "topk_ids", "topk_logprobs"):
            if record[key] is None:
                del record[key]
            elif isinstance(record[key], np.ndarray):
                record[key] = record[key].tolist()
        if isinstance(self.prompt, tuple):
            record["prompt"] = [_jsonable(p) for p in self.prompt]
        else:
            record["prompt"] = _jsonable(self.prompt)
        return record


def _jsonable(part: PromptPart) -> str | list[int]:
    return part if isinstance(part, str) else [int(t) for t in part]
