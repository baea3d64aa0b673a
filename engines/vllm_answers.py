"""vLLM's answers, read: pure functions from a /v1/completions body to the engine's types.

Nothing here does I/O. Each reader raises ValueError on an answer of the wrong shape;
`dualvllm.engines.vllm_client` runs them as the `decode` of its request, so that the transport
(dualvllm.engines.http) turns that ValueError into a MalformedResponseError naming the server.

Top-k entries are keyed "token_id:N" (`return_tokens_as_token_ids`: without it, distinct ids
that decode to the same string collide in the logprobs dict), and rows are padded to k + 1:
vLLM adds the sampled (or prompt) token as a (k+1)-th entry when it is outside the top k.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Sequence

import msgspec
import numpy as np

from dualvllm.engines.protocol import Draft, TopKBatch

TOKEN_ID_PREFIX = "token_id:"  # key format with return_tokens_as_token_ids
SHAPE_HINT = "; is this a vLLM OpenAI-compatible server of a supported version?"


class _TopLogprobs(msgspec.Struct):
    top_logprobs: list[dict[str, float] | None] = []


class _Choice(msgspec.Struct):
    index: int
    logprobs: _TopLogprobs | None = None


class Completion(msgspec.Struct):
    """The part of a /v1/completions answer next_token_topk reads; the rest is skipped unparsed."""

    choices: list[_Choice]


# Decoding only these fields, typed, takes 90 µs for a 64-prompt top-20 answer (60 kB)
# where json.loads of the whole body took 410 µs.
decode_completion: Callable[[bytes], Completion] = msgspec.json.Decoder(Completion).decode


class _PromptLogprob(msgspec.Struct):
    logprob: float


class _Generated(msgspec.Struct):
    """The part of an /inference/v1/generate answer generated_prompt_rows reads: its
    prompt_logprobs, keyed by plain token ids (this route has no "token_id:N" keys)."""

    prompt_logprobs: list[dict[int, _PromptLogprob] | None] | None = None


decode_generated: Callable[[bytes], _Generated] = msgspec.json.Decoder(_Generated).decode


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what + SHAPE_HINT)


def token_id(key: str) -> int:
    """ "token_id:123" -> 123; any other key is a ValueError (the client always asks for ids)."""
    if not key.startswith(TOKEN_ID_PREFIX) or not key[len(TOKEN_ID_PREFIX) :].isdigit():
        raise ValueError(f"logprob key {key[:40]!r} is not 'token_id:N'; the server ignored return_tokens_as_token_ids")
    return int(key[len(TOKEN_ID_PREFIX) :])


class TokenIdCache(dict[str, int]):
    """token_id of every key, parsed once per distinct key (at most the vocabulary).

    A dict lookup per logprob entry instead of a slice and an int(): 38 µs instead of
    142 µs for the 1,280 entries of a 64-prompt top-20 answer.
    """

    def __missing__(self, key: str) -> int:
        value = self[key] = token_id(key)
        return value


def token_ids(keys: Iterable[str], count: int, cache: TokenIdCache) -> np.ndarray:
    """`count` "token_id:N" keys -> int64 [count]."""
    return np.fromiter(map(cache.__getitem__, keys), np.int64, count)


def pad_rows(entries: Sequence[dict[str, float]], width: int, cache: TokenIdCache) -> TopKBatch:
    """Each {"token_id:N": logprob} dict as one row, in order, padded to `width`.

    Vectorized over the rows: the entries of all rows are read in one pass each for ids and
    values (TopKBatch.from_flat scatters them into the padded arrays).
    """
    counts = np.fromiter(map(len, entries), np.int64, len(entries))  # [B]
    _check(int(counts.max(initial=0)) <= width, f"more than {width} logprobs in a row")
    total = int(counts.sum())
    ids = token_ids(itertools.chain.from_iterable(entries), total, cache)
    values = np.fromiter(itertools.chain.from_iterable(e.values() for e in entries), np.float64, total)
    return TopKBatch.from_flat(ids, values, counts, width)


def next_token_rows(answer: Completion, batch_size: int, k: int, cache: TokenIdCache) -> TopKBatch:
    """A next-token answer (max_tokens 1, logprobs k) as [batch_size, k + 1] arrays, rows in prompt order."""
    choices = answer.choices
    _check(len(choices) == batch_size, f"expected {batch_size} choices")
    entries = [c.logprobs.top_logprobs[0] if c.logprobs and c.logprobs.top_logprobs else None for c in choices]
    _check(all(entries), "choice without top_logprobs; was `logprobs` dropped by a proxy?")
    rows = np.fromiter((c.index for c in choices), np.int64, batch_size)  # [B]
    _check(
        np.array_equal(np.sort(rows), np.arange(batch_size)),
        f"choice indices {rows.tolist()[:8]}... are not 0..{batch_size - 1}",
    )
    batch = pad_rows(entries, k + 1, cache)  # type: ignore[arg-type]  # rows in answer order
    if np.array_equal(rows, np.arange(batch_size)):
        return batch
    order = np.argsort(rows)
    return TopKBatch(token_ids=batch.token_ids[order], logprobs=batch.logprobs[order])


def _by_index(body: Any, count: int) -> list[dict[str, Any]]:
    """The `count` choices of an answer, in prompt order (each index once)."""
    choices = body.get("choices") if isinstance(body, dict) else None
    _check(isinstance(choices, list) and len(choices) == count, f"expected {count} choices")
    ordered: list[dict[str, Any] | None] = [None] * count
    for choice in choices:  # type: ignore[union-attr]
        index = choice.get("index") if isinstance(choice, dict) else None
        _check(
            isinstance(index, int) and 0 <= index < count and ordered[index] is None,
            f"choice index {index!r} is not one of 0..{count - 1}, once each",
        )
        ordered[index] = choice  # type: ignore[index]
    return ordered  # type: ignore[return-value]


def echoed_prompt_rows(body: Any, prompts: Sequence[Sequence[int]], k: int, cache: TokenIdCache) -> list[TopKBatch]:
    """An echo answer (max_tokens 0, echo, logprobs k): each prompt's top-k rows at positions 1..,
    checked against the prompt sent."""
    answers = []
    for choice, prompt in zip(_by_index(body, len(prompts)), prompts):
        logprobs = choice.get("logprobs") or {}
        tokens, top = logprobs.get("tokens") or [], logprobs.get("top_logprobs") or []
        _check(
            len(tokens) == len(top) == len(prompt),
            f"an echo answer has {len(tokens)} tokens and {len(top)} top_logprobs for a prompt of "
            f"{len(prompt)} tokens; was `logprobs` dropped by a proxy?",
        )
        _check(token_ids(tokens, len(tokens), cache).tolist() == list(prompt), "the echoed tokens are not the prompt's")
        rows = top[1:]  # position 0 has no distribution (None)
        _check(
            all(isinstance(row, dict) and key in row for row, key in zip(rows, tokens[1:])),
            "a prompt position without its own token's logprob",
        )
        answers.append(pad_rows(rows, k + 1, cache))
    return answers


def generated_prompt_rows(raw: bytes, prompt: Sequence[int], k: int) -> TopKBatch:
    """An /inference/v1/generate answer (max_tokens 1, prompt_logprobs k): the prompt's top-k rows
    at positions 1.., as echoed_prompt_rows gives them, checked against the prompt sent."""
    rows = decode_generated(raw).prompt_logprobs or []
    entries = rows[1:]  # position 0 has no distribution (None)
    _check(
        len(rows) == len(prompt) and all(row is not None and token in row for row, token in zip(entries, prompt[1:])),
        f"prompt_logprobs of {len(rows)} positions for a prompt of {len(prompt)} tokens, or a position "
        "without its own token's logprob",
    )
    counts = np.fromiter(map(len, entries), np.int64, len(entries))  # type: ignore[arg-type]  # checked: no None
    _check(int(counts.max(initial=0)) <= k + 1, f"more than {k + 1} logprobs in a row")
    total = int(counts.sum())
    ids = np.fromiter(itertools.chain.from_iterable(entries), np.int64, total)  # type: ignore[arg-type]
    values = np.fromiter(
        (entry.logprob for row in entries for entry in row.values()),  # type: ignore[union-attr]
        np.float64,
        total,
    )
    return TopKBatch.from_flat(ids, values, counts, k + 1)


def prompt_logprob_rows(body: Any, prompts: Sequence[Sequence[int]]) -> list[list[dict[str, Any] | None]]:
    """A prompt_logprobs answer's rows per prompt, as vLLM gives them, checked to cover each prompt."""
    answers: list[list[dict[str, Any] | None]] = []
    for choice, prompt in zip(_by_index(body, len(prompts)), prompts):
        rows = choice.get("prompt_logprobs") or []
        _check(
            isinstance(rows, list)
            and len(rows) == len(prompt)
            and all(isinstance(row, dict) and str(token) in row for row, token in zip(rows[1:], prompt[1:])),
            "prompt_logprobs do not cover the prompt, each position with its own token",
        )
        answers.append(rows)
    return answers


def top_row(entries: dict[str, float], token: str, k: int) -> dict[str, float]:
    """A drafted position's top-k, keyed as the answer keys them; vLLM adds the position's own
    token as a (k+1)-th entry when it is not in the top k, and that entry is dropped so rows
    match next_token_rows."""
    if len(entries) > k:
        return {key: v for key, v in entries.items() if key != token}
    return entries


def drafts(body: Any, count: int, k: int, cache: TokenIdCache) -> list[Draft]:
    """The `count` choices of a draft request, in prompt order, each with its per-token top-k."""
    out = []
    for choice in _by_index(body, count):
        logprobs = choice.get("logprobs") or {}
        tokens, top = logprobs.get("tokens") or [], logprobs.get("top_logprobs") or []
        _check(
            0 < len(tokens) == len(top), "a draft without per-token top_logprobs; was `logprobs` dropped by a proxy?"
        )
        rows = [top_row(entries, token, k) for entries, token in zip(top, tokens)]
        out.append(Draft(token_ids=token_ids(tokens, len(tokens), cache), topk=pad_rows(rows, k + 1, cache)))
    return out


def streamed_finish_reason(raw: bytes) -> str:
    """The finish_reason of a streamed one-choice completion (server-sent events)."""
    finish = None
    for line in raw.splitlines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[len(b"data: ") :])
        if "error" in chunk:
            raise ValueError(f"the server reported an error in the stream: {chunk['error']}")
        choices = chunk.get("choices") or [{}]
        finish = choices[0].get("finish_reason") or finish
    if finish is None:
        raise ValueError("the stream ended without a finish_reason")
    return str(finish)


def neutral_sampling(k: int) -> dict[str, Any]:
    """Sampling fields that make a draft's distribution the top-k at the request temperature.

    Every field is sent explicitly: vLLM otherwise takes defaults from the model's
    generation_config.json (e.g. top_p 0.8, repetition_penalty 1.05 for Qwen models), and
    any of them would change the distribution the acceptance test divides by.
    """
    return {
        "top_k": k,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
    }


# -- the served model's directory, when it is readable here ------------------------------


def config_int(root: Path, key: str, *, minimum: int = 1) -> int | None:
    """config.json's `key` (or its text_config's), if the server's model dir is readable here."""
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get(key)
    if value is None:
        value = (config.get("text_config") or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum else None


def eos_ids_from_model_dir(root: Path) -> frozenset[int]:
    """eos_token_id from generation_config.json and config.json (int or list), if present."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = root / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
