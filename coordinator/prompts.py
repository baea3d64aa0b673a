"""Turn user prompts (text, token ids, or a (theta, t) pair) into token ids per model."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dualvllm.coordinator.outputs import Prompt, PromptPart
from dualvllm.common.errors import InvalidInputError
from dualvllm.engines.protocol import Engine

# At most this many tokenize requests in flight per server while preparing a call.
MAX_CONCURRENT_TOKENIZE = 32


def split_prompt(index: int, prompt: Prompt) -> tuple[PromptPart, PromptPart]:
    """(theta part, t part) of one prompt; both are the same unless a pair was given."""
    problem = prompt_problem(prompt)
    if problem is not None:
        raise InvalidInputError(f"prompt {index}: {problem}")
    return prompt if isinstance(prompt, tuple) else (prompt, prompt)


def prompt_problem(prompt: object) -> str | None:
    """What is wrong with a prompt, or None if it is valid: the one check of every way
    prompts come in (the Python API, JSONL files)."""
    if isinstance(prompt, tuple):
        if len(prompt) != 2:
            return f"a tuple prompt must be (theta_prompt, t_prompt), got {len(prompt)} items"
        return _part_problem(prompt[0]) or _part_problem(prompt[1])
    return _part_problem(prompt)


def _part_problem(part: object) -> str | None:
    if isinstance(part, str):
        return None if part else "the prompt is empty; give at least one character"
    if (
        isinstance(part, Sequence)
        and part
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in part)
    ):
        return None
    shown = repr(part) if len(repr(part)) <= 60 else repr(part)[:57] + "..."
    return (
        "a prompt must be a non-empty string, a non-empty list of token ids (ints >= 0), or a "
        f"(theta_prompt, t_prompt) pair of those; got {shown}"
    )


async def encode_prompts(prompts: Sequence[Prompt], theta: Engine, t: Engine) -> list[tuple[list[int], list[int]]]:
    """Token ids of every prompt for each model; text is tokenized by that model's server,
    once per distinct text: RL calls repeat each prompt for its group of samples (GRPO's G),
    and every /tokenize is an HTTP request (with 8 samples a prompt, a sequence's own CPU fell
    from 1.61-2.01 to 0.97-1.56 ms: benchmarks/sequence_overhead.py, benchmarks/README.md)."""
    parts = [split_prompt(i, p) for i, p in enumerate(prompts)]
    limits = {id(engine): asyncio.Semaphore(MAX_CONCURRENT_TOKENIZE) for engine in (theta, t)}
    texts: dict[tuple[int, str], asyncio.Future[list[int]]] = {}  # (engine, text) -> its ids

    async def tokenize(engine: Engine, text: str) -> list[int]:
        async with limits[id(engine)]:
            return await engine.tokenize(text)

    def encode(engine: Engine, part: PromptPart) -> asyncio.Future[list[int]] | list[int]:
        if not isinstance(part, str):
            return list(part)
        key = (id(engine), part)
        if key not in texts:
            texts[key] = asyncio.ensure_future(tokenize(engine, part))
        return texts[key]

    encoded = [[encode(engine, part) for engine, part in zip((theta, t), pair)] for pair in parts]
    try:
        await asyncio.gather(*texts.values())
    finally:  # one failed: the others are not left running
        for task in texts.values():
            task.cancel()
    # Each sequence gets its own list: a caller may change one prompt's ids without the others'.
    return [
        tuple(ids if isinstance(ids, list) else list(ids.result()) for ids in pair)  # type: ignore[misc]
        for pair in encoded
    ]
