"""Start-up checks: both servers up, one shared tokenizer, top_k accepted, EOS known."""

from __future__ import annotations

import asyncio

from dualvllm.common.errors import IncompatibleModelsError, InvalidInputError, TopKUnsupportedError
from dualvllm.engines.pool import members
from dualvllm.engines.protocol import Engine, ModelInfo

# Strings whose token ids must agree between the two servers: plain text, digits and
# arithmetic, leading spaces and newlines, code indentation, non-ASCII.
TOKENIZER_PROBES = (
    "Hello, world!",
    "12+34=91",
    " The quick brown fox\njumps over 13 lazy dogs.",
    "def f(x):\n    return x ** 2",
    "naïve café, 東京, ∑ α²",
)


def replica_pairs(theta: Engine, t: Engine) -> list[tuple[Engine, Engine]]:
    """(base, teacher) engine pairs that put every replica of both roles through the pair
    checks: each base replica with the first teacher, each other teacher with the first base."""
    thetas, ts = members(theta), members(t)
    return [(one, ts[0]) for one in thetas] + [(thetas[0], one) for one in ts[1:]]


async def check_health(theta: Engine, t: Engine) -> None:
    await asyncio.gather(theta.health(), t.health())


async def check_tokenizers(theta: Engine, t: Engine, infos: tuple[ModelInfo, ModelInfo]) -> None:
    """Refuse a pair whose tokenizers give different ids for the same text."""
    ids = await asyncio.gather(*(e.tokenize(p, add_special_tokens=False) for p in TOKENIZER_PROBES for e in (theta, t)))
    for i, probe in enumerate(TOKENIZER_PROBES):
        ids_theta, ids_t = ids[2 * i], ids[2 * i + 1]
        if ids_theta != ids_t:
            raise IncompatibleModelsError(
                f"the two models tokenize {probe!r} differently: base {infos[0].name} gives "
                f"{ids_theta[:12]}, teacher {infos[1].name} gives {ids_t[:12]}. q* mixes the "
                "models token by token, so both must share one tokenizer (same family/vocab)."
            )


async def resolve_eos(
    theta: Engine, t: Engine, infos: tuple[ModelInfo, ModelInfo], override: tuple[int, ...] | None
) -> frozenset[int]:
    """The EOS ids: the config's override, else what both servers agree on."""
    if override is not None:
        return frozenset(override)
    eos_theta, eos_t = await asyncio.gather(theta.eos_token_ids(), t.eos_token_ids())
    if not eos_theta or not eos_t:
        missing = infos[0].name if not eos_theta else infos[1].name
        raise InvalidInputError(
            f"cannot learn the EOS token of {missing}: its model directory is not readable "
            "here and the server has no /tokenizer_info. Set eos_token_ids in the config "
            "(DUALVLLM_EOS_TOKEN_IDS='[id]') or start vLLM with --enable-tokenizer-info-endpoint."
        )
    if not eos_theta & eos_t:
        raise IncompatibleModelsError(
            f"the models end sequences with different tokens: base {infos[0].name} uses "
            f"{sorted(eos_theta)}, teacher {infos[1].name} uses {sorted(eos_t)}. Set "
            "eos_token_ids in the config if you know which ids should stop generation."
        )
    return eos_theta | eos_t


async def check_top_k(theta: Engine, t: Engine, k: int, probe_ids: list[int], vocab_size: int | None = None) -> None:
    """Send one real top-k request to each server, so a too-low --max-logprobs fails now.

    A k above the vocabulary is refused before anything is sent: vLLM 0.32 (CPU build)
    answered logprobs=100 on a 98-token model with HTTP 500 and its engine died.
    """
    if vocab_size is not None and k > vocab_size:
        raise InvalidInputError(
            f"top_k={k} is larger than the models' vocabulary of {vocab_size} tokens (a vLLM server "
            f"asked for that many logprobs fails and stops serving); use top_k <= {vocab_size}."
        )
    results = await asyncio.gather(
        theta.next_token_topk([probe_ids], k),
        t.next_token_topk([probe_ids], k),
        return_exceptions=True,
    )
    for result in results:
        if isinstance(result, TopKUnsupportedError):
            raise result
        if isinstance(result, BaseException):
            raise result
