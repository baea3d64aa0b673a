"""vLLM's dev routes on the q* service, forwarded to the base servers (ServiceConfig.dev_mode).

A trainer written for a stock vLLM server (TRL's VLLMClient) reads the server's config and
pushes weights through these routes; here they reach every healthy base replica:

    GET  /server_info            the first base replica's vllm_config; logprobs_mode says
                                 "processed_logprobs" (the logprobs returned are log q* of the
                                 distribution sampled, after temperature), plus a `dualvllm` key
    GET  /get_world_size         the sum of the base replicas' (TP x PP x DP each): the ranks an
                                 NCCL trainer's group must hold besides its own (TRL adds 1)
    POST /init_weight_transfer_engine
                                 to every base replica, at once; an NCCL payload's rank_offset
                                 is the first replica's, and each next one starts after the
                                 ranks of those before it
                                 (dualvllm.engines.vllm_admin.replica_init_infos)
    POST /update_weights         to every base replica, at once
    POST /start_weight_update    holds the coordinator (coordinator.paused(): lockstep sequences
                                 leave the servers at their agreed tokens), pauses each base
                                 server (mode "keep"), then starts the update on each
    POST /finish_weight_update   finishes it on each, drops their KV cache, resumes them, and
                                 lets the coordinator go on: what is sampled after comes from
                                 the new weights
    POST /reset_prefix_cache     to every base replica
    GET  /weight_info            the first base replica's

A base that ties its input and output embeddings (its config's `tie_word_embeddings: true`)
takes no weight push: vLLM 0.32's in-place update loads its embedding and leaves its output
layer, so it would serve a model nobody trained (dualvllm.training.untie; `dualvllm train`
refuses it too). The refusal comes at the first weight-transfer call (init or start), with the
untie command, and not when the service starts: a tied base is served, sampled and scored
correctly in dev mode too, and only a push into it goes wrong.

An update left open (a trainer that died between start and finish) is ended after
UPDATE_IDLE_S without a phase: the servers finish it (keeping what arrived) and the
coordinator goes on, so one dead trainer cannot stop sampling for good.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any
from collections.abc import Awaitable, Callable

from aiohttp import web

from dualvllm.common.errors import WeightSyncError
from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.engines.pool import live_members
from dualvllm.engines.vllm_admin import replica_init_infos
from dualvllm.engines.protocol import WeightTransferServer
from dualvllm.service.errors import RequestError
from dualvllm.training.untie import UNTIE_COMMAND

log = logging.getLogger("dualvllm.service")

# How long one forwarded phase may take (a chunk of a large model loads in seconds).
PHASE_TIMEOUT_S = 600.0
# How long an open update may go without a phase before it is ended for the trainer.
UPDATE_IDLE_S = 600.0
# How long the coordinator may take to hold its sequences (each leaves at its server's next step).
HOLD_TIMEOUT_S = 120.0


class UpdateInProgress:
    """One weight update, start to finish: the coordinator's pause held in a task of its own
    (a handler's task ends with its request), released by `finish` or by the idle watchdog."""

    def __init__(self, coordinator: DualVLLMCoordinator) -> None:
        self.held, self.release = asyncio.Event(), asyncio.Event()
        self.touched = asyncio.Event()  # set by every phase; the watchdog waits on it
        self.task = asyncio.create_task(self._hold(coordinator))

    async def _hold(self, coordinator: DualVLLMCoordinator) -> None:
        async with coordinator.paused():
            self.held.set()
            await self.release.wait()

    async def wait_held(self) -> None:
        waiter = asyncio.ensure_future(self.held.wait())
        done, _ = await asyncio.wait([waiter, self.task], timeout=HOLD_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self.task in done:
            self.task.result()  # raises why the hold failed
        if not self.held.is_set():
            raise WeightSyncError(
                f"the coordinator did not hold its sequences within {HOLD_TIMEOUT_S:.0f} s for the weight update"
            )

    async def end(self) -> None:
        """Let the coordinator go on; bounded by the hold's own exit (it resubmits its sequences)."""
        self.release.set()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), HOLD_TIMEOUT_S)
        except TimeoutError:
            log.error("the coordinator took over %.0f s to resume after a weight update", HOLD_TIMEOUT_S)


class DevRoutes:
    """The handlers; `add_to(app)` registers them."""

    def __init__(self, coordinator: DualVLLMCoordinator, idle_s: float | None = None) -> None:
        self.coordinator = coordinator
        self.idle_s = UPDATE_IDLE_S if idle_s is None else idle_s
        self.update: UpdateInProgress | None = None
        self.watchdog: asyncio.Task | None = None
        self.untied = False  # the base was found untied (asked at the first weight-transfer call)

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_world_size", self.get_world_size)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_post("/init_weight_transfer_engine", self.init_weight_transfer_engine)
        app.router.add_post("/start_weight_update", self.start_weight_update)
        app.router.add_post("/update_weights", self.update_weights)
        app.router.add_post("/finish_weight_update", self.finish_weight_update)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.on_cleanup.append(self._close)

    # -- the base replicas --------------------------------------------------------------

    def bases(self) -> list[WeightTransferServer]:
        """Every healthy base replica (one without a pool)."""
        admins = [getattr(m, "admin", None) for m in live_members(self.coordinator.base_engine)]
        if not admins or not all(isinstance(a, WeightTransferServer) for a in admins):
            raise RequestError(
                "the dev routes forward to vLLM base servers; this coordinator's base engine "
                f"{self.coordinator.base_engine.name!r} is not one",
                code="unsupported_parameter",
            )
        return admins  # type: ignore[return-value]

    async def _each(self, call: Callable[[WeightTransferServer], Awaitable[Any]]) -> list[Any]:
        return list(await asyncio.gather(*(call(c) for c in self.bases())))

    # -- read-only ----------------------------------------------------------------------

    async def server_info(self, request: web.Request) -> web.Response:
        base = self.bases()[0]
        config = await base.server_config()
        if config is None:
            return _not_dev_mode(base)
        model = dict(config.get("model_config") or {})
        model["logprobs_mode"] = "processed_logprobs"  # log q* of what was sampled, temperature applied
        theta, t = self.coordinator.session.model_names
        return web.json_response(
            {
                "vllm_config": {
                    **config,
                    "model_config": model,
                    "dualvllm": {
                        "base": theta,
                        "teacher": t,
                        "base_replicas": len(self.bases()),
                        "mode": self.coordinator.mode,
                    },
                }
            }
        )

    async def get_world_size(self, request: web.Request) -> web.Response:
        include_dp = request.query.get("include_dp", "true").lower() != "false"
        return web.json_response({"world_size": sum(await self._each(lambda c: c.world_size(include_dp)))})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": await self.bases()[0].weight_version()})

    # -- the four phases ----------------------------------------------------------------

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        info = (await _json(request)).get("init_info")
        if not isinstance(info, dict):
            raise RequestError("the body needs init_info: an object (the backend's init arguments)", param="init_info")
        await self._refuse_tied_base()
        bases = self.bases()
        sizes = await asyncio.gather(*(c.world_size() for c in bases)) if "rank_offset" in info else [1] * len(bases)
        try:
            infos = replica_init_infos(info, sizes)
        except WeightSyncError as err:
            raise RequestError(str(err), param="init_info") from err
        await asyncio.gather(
            *(c.init_weight_transfer_engine(i, timeout_s=PHASE_TIMEOUT_S) for c, i in zip(bases, infos))
        )
        return web.json_response({"message": "Weight transfer initialized"})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        if self.update is not None:
            raise RequestError(
                "a weight update is already in progress: finish it (POST /finish_weight_update) "
                "before starting another",
                code="conflict",
                status=409,
            )
        await self._refuse_tied_base()
        update = self.update = UpdateInProgress(self.coordinator)
        try:
            await update.wait_held()
            await self._each(lambda c: c.pause(mode="keep"))
            await self._each(lambda c: c.start_weight_update(timeout_s=PHASE_TIMEOUT_S))
        except BaseException:
            await self._end(finish=False)
            raise
        self.watchdog = asyncio.create_task(self._watch(update))
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        info = (await _json(request)).get("update_info")
        update = self._open("update_weights")
        update.touched.set()
        await self._each(lambda c: c.update_weights(info, timeout_s=PHASE_TIMEOUT_S))
        update.touched.set()
        return web.json_response({"message": "Weights updated"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        version = (await _json(request)).get("weight_version")
        self._open("finish_weight_update")
        await self._end(finish=True, version=version)
        return web.json_response({"message": "Weight update finished"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        await self._each(lambda c: c.reset_prefix_cache())
        return web.json_response({"success": True})

    async def _refuse_tied_base(self) -> None:
        """Refuse a weight push into a base that ties its embeddings (see the module's docstring)."""
        if self.untied:
            return
        root = (await self.coordinator.base_engine.model_info()).root
        if ties_embeddings(root, await self.bases()[0].server_config()):
            raise RequestError(
                f"the base model {root} ties its input and output embeddings (tie_word_embeddings: true), and vLLM "
                "0.32's in-place weight update loads a tied model's embedding but not its output layer: it would "
                "serve a model that was never trained (`dualvllm train` refuses it too). Untie it once, "
                f"`{UNTIE_COMMAND} {root} {root.rstrip('/')}-untied`, serve that directory as the base, and push "
                "into it",
                code="tied_embeddings",
                status=409,
            )
        self.untied = True

    # -- ending an update ---------------------------------------------------------------

    def _open(self, phase: str) -> UpdateInProgress:
        if self.update is None:
            raise RequestError(
                f"{phase} needs a weight update in progress: POST /start_weight_update first (an "
                f"update idle for {self.idle_s:.0f} s is ended for its trainer)",
                code="conflict",
                status=409,
            )
        return self.update

    async def _end(self, *, finish: bool, version: str | None = None) -> None:
        """Finish the update on the servers (if asked), drop their KV, resume them, release the
        coordinator; every step is tried even when one before it failed, the first error raised."""
        update, self.update = self.update, None
        if self.watchdog is not None and self.watchdog is not asyncio.current_task():
            self.watchdog.cancel()
        self.watchdog = None
        errors: list[BaseException] = []
        steps: list[Callable[[WeightTransferServer], Awaitable[Any]]] = [
            lambda c: c.reset_prefix_cache(reset_running_requests=True),
            lambda c: c.resume(),
        ]
        if finish:
            steps.insert(0, lambda c: c.finish_weight_update(version, timeout_s=PHASE_TIMEOUT_S))
        for step in steps:
            try:
                await self._each(step)
            except Exception as exc:  # noqa: BLE001 - the servers must be resumed whatever failed before
                errors.append(exc)
        if update is not None:
            await update.end()
        if errors:
            raise errors[0]

    async def _watch(self, update: UpdateInProgress) -> None:
        """End an update that went UPDATE_IDLE_S without a phase (its trainer is gone)."""
        while True:
            update.touched.clear()
            try:
                await asyncio.wait_for(update.touched.wait(), self.idle_s)
            except TimeoutError:
                break
        if self.update is update:
            log.error(
                "a weight update went %.0f s without a phase; its trainer is gone: ending it (the base servers "
                "keep what arrived) and resuming sampling",
                self.idle_s,
            )
            try:
                await self._end(finish=True)
            except Exception:  # logged: nobody waits on the watchdog
                log.exception("ending the abandoned weight update failed")

    async def _close(self, app: web.Application) -> None:
        if self.update is not None:
            await self._end(finish=True)


def ties_embeddings(root: str, server_config: dict[str, Any] | None) -> bool:
    """Whether the base ties its input and output embeddings: `tie_word_embeddings` in the
    config.json of its model directory `root` (dev mode serves from this machine), else in the
    server's own config (/server_info's model_config.hf_config, which vLLM writes as the repr of
    transformers' config, a JSON text); False when neither says."""
    try:
        config = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):  # a hub name, or a directory not readable here
        config = None
    if isinstance(config, dict) and "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    model = (server_config or {}).get("model_config")
    hf_config = str(model.get("hf_config", "")) if isinstance(model, dict) else ""
    return re.search(r'"tie_word_embeddings":\s*true', hf_config) is not None


async def _json(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    body = await request.json()
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def _not_dev_mode(base: WeightTransferServer) -> web.Response:
    from dualvllm.service.errors import error_body

    return web.json_response(
        error_body(
            f"the base server at {base.url} has no /server_info: it runs without dev mode. Start `dualvllm serve` with "
            "--dev-mode (the servers and these routes, loopback only)",
            "invalid_request_error",
        ),
        status=404,
    )
