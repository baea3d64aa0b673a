"""A vLLM worker extension that reports the digest of the weights the server last took.

vLLM mixes the class named by `--worker-extension-cls` into its worker (ParallelConfig.
worker_extension_cls, vLLM 0.32), so its methods run on every worker through the dev-mode
`POST /collective_rpc {"method": "dualvllm_weight_digest"}` route, which answers
`{"results": [one per rank]}`: with tensor parallelism every rank digests the shards it
loaded from the same full tensors, so the ranks must agree. The launcher adds the flag to
the dev-mode base servers it starts with a weight-transfer engine (WORKER_EXTENSION); a server
without it answers that the method "is not implemented", and the trainer verifies its pushes
by a logprob probe instead.

Importing this module needs neither torch nor vLLM: the worker imports it by name.
"""

from __future__ import annotations

# The qualified name vLLM resolves (--worker-extension-cls).
WORKER_EXTENSION = "dualvllm.engines.vllm_plugin.worker_extension.WeightDigestExtension"
# The collective_rpc method the trainer calls.
DIGEST_METHOD = "dualvllm_weight_digest"


class WeightDigestExtension:
    """Mixed into vLLM's worker, which holds `weight_transfer_engine` (None without one)."""

    def dualvllm_weight_digest(self) -> str | None:
        """The digest of the last finished weight update (dualvllm.engines.weight_digest); None if
        none finished, or the worker's weight-transfer engine does not digest what it loads."""
        engine = getattr(self, "weight_transfer_engine", None)
        digest = getattr(engine, "last_digest", None)
        return digest if isinstance(digest, str) else None
