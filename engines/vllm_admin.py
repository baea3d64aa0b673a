"""A vLLM server's admin routes: fencing, reloads, prefix-cache resets, native weight transfer.

`VLLMClient.admin` holds one over the client's transport (dualvllm.engines.vllm_transport:
retries, timeouts, error translation), and the routes here change the server's state, so each is resent only where the
table below says so. Every route here, /pause, /resume and /reset_prefix_cache included, needs a
dev-mode server (VLLM_SERVER_DEV_MODE=1): vLLM 0.32 registers them, the weight-transfer and
/collective_rpc routes and /server_info only under it (vllm/entrypoints/launchers/api_server/
routers.py: the dev and rl routers). Such a server must listen on a loopback host only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Literal


from dualvllm.common.errors import ServerRejectedError, ServerStatusError, ServerUnavailableError, WeightSyncError
from dualvllm.engines.http import expect
from dualvllm.engines.vllm_plugin.worker_extension import DIGEST_METHOD, WORKER_EXTENSION
from dualvllm.engines.vllm_transport import ServerTransport
from dualvllm.engines.weights_dir import checked_weights_dir

# vLLM refuses a prefix-cache reset (`success: false`) while running requests hold blocks;
# inside a /pause fence they drain within a few decode steps (~25 ms each on CPU), so 50
# tries 0.1 s apart outlast them, and a server that still refuses is reported.
RESET_ATTEMPTS = 50
RESET_RETRY_DELAY_S = 0.1
# The dtypes a vLLM server computes in, as /server_info names them (without "torch.").
SERVED_DTYPES = frozenset({"bfloat16", "float16", "float32"})
# What /pause does with requests in flight (vLLM 0.32's `mode`): wait for them to finish,
# abort them, or keep them queued until /resume.
PauseMode = Literal["wait", "abort", "keep"]
# What vLLM 0.32 answers (HTTP 500) for a collective_rpc method its worker lacks (v1/serial_utils.py run_method).
NOT_IMPLEMENTED = "is not implemented"
# vLLM's dense NCCL weight-transfer engine (--weight-transfer-config '{"backend": "nccl"}').
NCCL_BACKEND = "nccl"


def replica_init_infos(init_info: dict[str, Any], world_sizes: Sequence[int]) -> list[dict[str, Any]]:
    """One base replica's init payload each, for one trainer group across all of them.

    An NCCL-style payload (it has `rank_offset`) names where the first replica's workers
    start; the replicas' workers then take consecutive ranks, replica i from `rank_offset`
    plus the world sizes (TP x PP x DP) of the replicas before it, so no two workers claim
    the same rank. Its `world_size` must hold them all. Any other payload (the shared-memory
    engine's) goes to every replica as it is.
    """
    if "rank_offset" not in init_info:
        return [dict(init_info) for _ in world_sizes]
    first, total = init_info["rank_offset"], init_info.get("world_size")
    if not isinstance(first, int) or not isinstance(total, int):
        raise WeightSyncError(f"init_info's rank_offset and world_size must be integers (got {first!r} and {total!r})")
    offsets = [first + sum(world_sizes[:i]) for i in range(len(world_sizes))]
    if first + sum(world_sizes) > total:
        raise WeightSyncError(
            f"init_info's world_size {total} cannot hold the base replicas' workers: ranks {first} to "
            f"{first + sum(world_sizes) - 1} for world sizes {list(world_sizes)} (TP x PP x DP each). Size "
            f"the group as rank_offset + the sum of their world sizes ({first + sum(world_sizes)}); "
            "GET /get_world_size gives that sum"
        )
    return [{**init_info, "rank_offset": offset} for offset in offsets]


@dataclass(frozen=True)
class ServedDigest:
    """A server's answer to `VLLMAdmin.weight_digest`: the digest, or why it has none."""

    digest: str | None
    missing: str | None = None  # why there is no digest (None when there is one)


class VLLMAdmin:
    """The admin routes of the server behind `transport`; implements dualvllm.engines.protocol.WeightTransferServer."""

    def __init__(self, transport: ServerTransport) -> None:
        self._transport = transport

    @property
    def name(self) -> str:
        return self._transport.name

    @property
    def url(self) -> str:
        return self._transport.url

    # -- admin: weight pushes (dualvllm.training.weight_sync); the reload needs a dev-mode server ---
    #
    #   call                   sent again after a timeout, 5xx or lost connection?
    #   pause, resume          yes: each sets a state, and a second send sets the same one
    #   reset_prefix_cache     yes: emptying an empty cache changes nothing; a refusal
    #                          (`success: false`) is asked again, up to RESET_ATTEMPTS
    #   reload_weights         no, only when nothing was sent: a reload that may have run
    #                          is the caller's to check (it probes the weights served)
    #
    # 4xx answers are never resent (dualvllm.engines.http's table).

    async def pause(self, mode: PauseMode = "wait") -> bool:
        """Stop the server from scheduling new requests (`mode`: what happens to those running).

        True once paused; False if the server has no /pause route (an older vLLM), so the
        caller knows its reload is not fenced.
        """
        try:
            await self._transport.call("POST", f"/pause?mode={mode}", idempotent=True)
        except ServerRejectedError as err:
            if err.status == 404:
                return False
            raise
        return True

    async def resume(self) -> None:
        """Let the server schedule requests again after `pause`."""
        await self._transport.call("POST", "/resume", idempotent=True)

    async def reload_weights(self, weights_path: Path | str, *, timeout_s: float | None = None) -> None:
        """Load the HF-format checkpoint in `weights_path` into the running server, in place.

        The path is sent absolute, and only once `dualvllm.engines.weights_dir.checked_weights_dir`
        found a readable checkpoint there: the server reads it from its own working directory
        and filesystem, and a reload of a path vLLM cannot read can kill the server. A
        missing or corrupt checkpoint raises WeightSyncError and nothing is sent. On two
        machines the directory must be at the same absolute path on both.

        Sent at most once unless the connection never opened (see the table above): a
        timeout, 5xx or lost connection raises its ServerError, and the server may or may
        not serve the new weights. `timeout_s` replaces the request timeout for this call
        (a large model's reload takes longer than a decode step). A server started without
        dev mode has no /collective_rpc: WeightSyncError says how to restart it.
        """
        weights_dir = checked_weights_dir(weights_path)
        timeout = None if timeout_s is None else self._transport.timeout(timeout_s)
        try:
            await self._transport.call(
                "POST",
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}},
                idempotent=False,
                timeout=timeout,
            )
        except ServerRejectedError as err:
            if err.status == 404:
                raise WeightSyncError(
                    f"{self._transport.name} server at {self._transport.url} has no /collective_rpc: it was started without dev "
                    "mode. Restart it with VLLM_SERVER_DEV_MODE=1 (ServerConfig(dev_mode=True), or `dualvllm "
                    "serve --dev-mode`), on a loopback host only"
                ) from err
            raise

    async def served_dtype(self) -> str | None:
        """The dtype the server computes in ("bfloat16", "float16", "float32"), from the dev-mode
        GET /server_info; None if the server has no such route (started without dev mode).

        A weight push compares the server's logprobs with the learner's, which are only
        comparable at the same precision: `--dtype auto` serves a float32 checkpoint in
        bfloat16 on the CPU build, and a bf16 checkpoint in bf16 everywhere.
        """
        config = await self.server_config()
        if config is None:
            return None
        model = config.get("model_config", {})
        dtype = str(model.get("dtype", "")) if isinstance(model, dict) else ""
        expect(
            dtype.removeprefix("torch.") in SERVED_DTYPES,
            self._transport.name,
            self._transport.url,
            f"/server_info names no model dtype among {sorted(SERVED_DTYPES)} (got {dtype!r})",
        )
        return dtype.removeprefix("torch.")

    async def weight_transfer_backend(self) -> str | None:
        """The weight-transfer engine the server was started with (--weight-transfer-config), from
        the dev-mode GET /server_info; None if it has none, or no such route."""
        config = await self.server_config()
        transfer = (config or {}).get("weight_transfer_config")
        return transfer.get("backend") if isinstance(transfer, dict) else None

    async def server_config(self) -> dict[str, Any] | None:
        """The server's vllm_config from GET /server_info (dev mode); None without that route."""
        try:
            info = await self._transport.call("GET", "/server_info?config_format=json")
        except ServerRejectedError as err:
            if err.status == 404:
                return None
            raise
        config = info.get("vllm_config") if isinstance(info, dict) else None
        return config if isinstance(config, dict) else {}

    async def reset_prefix_cache(
        self,
        *,
        attempts: int = RESET_ATTEMPTS,
        retry_delay_s: float = RESET_RETRY_DELAY_S,
        reset_running_requests: bool = False,
    ) -> None:
        """Drop every cached KV block, so that none computed with old weights is reused.

        vLLM answers `success: false` while running requests hold blocks: asked again up to
        `attempts` times, `retry_delay_s` apart; then WeightSyncError (call it inside `pause`).
        `reset_running_requests` drops the blocks of running requests too: vLLM preempts them,
        and they recompute their context when they are scheduled again.
        """
        path = "/reset_prefix_cache" + ("?reset_running_requests=true" if reset_running_requests else "")
        for attempt in range(attempts):
            answer = await self._transport.call("POST", path, idempotent=True)
            expect(
                isinstance(answer, dict) and "success" in answer,
                self._transport.name,
                self._transport.url,
                f"/reset_prefix_cache answered {answer!r}, not {{'success': bool}}",
            )
            if answer["success"]:
                return
            if attempt + 1 < attempts:
                await asyncio.sleep(retry_delay_s)
        raise WeightSyncError(
            f"{self._transport.name} server at {self._transport.url} refused to reset its prefix cache {attempts} times, and stale KV "
            "blocks would give wrong logprobs; running requests hold blocks: reset inside pause(), and check "
            "that the server honours /pause"
        )

    # -- admin: vLLM's native weight transfer (dualvllm.training.weight_transfer); dev mode ----------
    #
    # Four phases, each sent once (a phase changes the server's state): init the transfer
    # engine, start an update, update_weights per chunk, finish. None is resent after a
    # timeout: the caller ends the update and verifies what the server serves.

    async def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout_s: float) -> None:
        """Set up the server's weight-transfer engine (its --weight-transfer-config backend)."""
        await self._transfer_phase("/init_weight_transfer_engine", {"init_info": init_info}, timeout_s)

    async def start_weight_update(self, *, timeout_s: float) -> None:
        await self._transfer_phase("/start_weight_update", None, timeout_s)

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]], *, timeout_s: float) -> None:
        """Send one chunk's description; the server loads the chunk before it answers."""
        await self._transfer_phase("/update_weights", {"update_info": update_info}, timeout_s)

    async def finish_weight_update(self, weight_version: str | None = None, *, timeout_s: float) -> None:
        payload = None if weight_version is None else {"weight_version": weight_version}
        await self._transfer_phase("/finish_weight_update", payload, timeout_s)

    async def shutdown_weight_transfer_engine(self, *, timeout_s: float) -> None:
        """Release the server's side of the transfer (an NCCL group's communicator); the server
        keeps serving, and a later init opens a new one."""
        await self._transfer_phase("/shutdown_weight_transfer_engine", None, timeout_s)

    async def world_size(self, include_dp: bool = True) -> int:
        """The server's worker count (TP x PP, x DP with `include_dp`): GET /get_world_size (dev mode)."""
        body = await self._transport.call("GET", "/get_world_size" + ("" if include_dp else "?include_dp=false"))
        expect(
            isinstance(body, dict) and isinstance(body.get("world_size"), int),
            self._transport.name,
            self._transport.url,
            f"/get_world_size answered {body!r}, not {{'world_size': int}}",
        )
        return body["world_size"]

    async def weight_version(self) -> str | None:
        """The version the last finished update was tagged with (GET /weight_info)."""
        body = await self._transport.call("GET", "/weight_info")
        return body.get("weight_version") if isinstance(body, dict) else None

    async def weight_digest(self) -> ServedDigest:
        """The digest of the weights the server took at its last finished update
        (dualvllm.engines.weight_digest), from every rank through the dev-mode worker extension
        (`POST /collective_rpc {"method": DIGEST_METHOD}`); or why it gives none.

        Not resent after a 5xx: vLLM answers a method its worker lacks (a server started without
        the extension) with a 500, and asking again cannot change that; resent once after a reset
        connection. Ranks that disagree
        (tensor parallelism: each digests what it loaded) raise WeightSyncError.
        """
        try:
            try:
                body = await self._transport.call(
                    "POST", "/collective_rpc", {"method": DIGEST_METHOD}, idempotent=False
                )
            except ServerUnavailableError:
                # uvicorn closes a connection after a 500 (a call's unhandled error, this one's included), and
                # the next request on it is reset: this one is a read, so it is sent once more.
                body = await self._transport.call(
                    "POST", "/collective_rpc", {"method": DIGEST_METHOD}, idempotent=False
                )
        except ServerStatusError as err:
            if err.status == 404:
                return ServedDigest(None, "it has no /collective_rpc (not in dev mode)")
            if NOT_IMPLEMENTED in err.body:
                return ServedDigest(
                    None,
                    f"it was started without dualvllm's worker extension: add --worker-extension-cls {WORKER_EXTENSION} "
                    "(the servers dualvllm starts have it)",
                )
            raise
        results = body.get("results") if isinstance(body, dict) else None
        expect(
            isinstance(results, list) and bool(results) and all(r is None or isinstance(r, str) for r in results),
            self._transport.name,
            self._transport.url,
            f"/collective_rpc {DIGEST_METHOD} answered {body!r}, not {{'results': [digest or null, one per rank]}}",
        )
        assert isinstance(results, list)  # for mypy: expect() raised otherwise
        if len(set(results)) > 1:
            raise WeightSyncError(
                f"{self._transport.name} server at {self._transport.url}: its ranks took different weights (digests by rank: "
                f"{', '.join(str(r)[:12] for r in results)}); restart it and push again"
            )
        if results[0] is None:
            return ServedDigest(None, "it reports no digest: its weight-transfer engine does not digest what it loads")
        return ServedDigest(results[0])

    async def _transfer_phase(self, path: str, payload: Any, timeout_s: float) -> None:
        timeout = self._transport.timeout(timeout_s)
        try:
            await self._transport.call("POST", path, payload, idempotent=False, timeout=timeout)
        except ServerRejectedError as err:
            if err.status == 404:
                raise WeightSyncError(
                    f"{self._transport.name} server at {self._transport.url} has no {path}: it was started without dev mode. Restart it "
                    "with VLLM_SERVER_DEV_MODE=1 (ServerConfig(dev_mode=True)), on a loopback host only"
                ) from err
            raise
