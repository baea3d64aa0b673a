"""VLLMClient's admin calls (pause, resume, reload_weights, reset_prefix_cache) against the fake vLLM:
what each sends, which failures each resends, and how each reports a server that cannot do it.

Outcomes are read from the requests the fake received, never from the clock.
"""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dualvllm.common.errors import (
    MalformedResponseError,
    ServerInternalError,
    ServerRejectedError,
    ServerTimeoutError,
    WeightSyncError,
)
from dualvllm.engines.vllm_client import VLLMClient
from tests.fake_vllm import Failure, write_fake_weights

TIMEOUT_S = 1.0  # the client's request timeout in these tests
STALL_S = 5.0  # a scripted stall, far beyond TIMEOUT_S
REFUSED = Failure(200, '{"success": false}')  # vLLM's answer while running requests hold KV blocks


def client(url: str, **kw) -> VLLMClient:
    kw.setdefault("retry_delay_s", 0.0)
    kw.setdefault("request_timeout_s", TIMEOUT_S)
    return VLLMClient(url, name="theta", **kw)


async def test_pause_holds_generation_until_resume(fake_theta):
    async with client(fake_theta.url) as c:
        assert await c.admin.pause() is True
        assert not fake_theta.running.is_set()  # the fake's /v1/completions now waits, as vLLM's does
        await c.admin.resume()
    assert fake_theta.running.is_set() and fake_theta.order == ["/pause", "/resume"]


async def test_pause_sends_its_mode():
    modes = []

    async def pause(request: web.Request) -> web.Response:
        modes.append(request.query.get("mode"))
        return web.json_response({"status": "paused"})

    app = web.Application()
    app.router.add_post("/pause", pause)
    async with TestServer(app, host="127.0.0.1") as server:
        async with client(str(server.make_url("")).rstrip("/")) as c:
            await c.admin.pause()
            await c.admin.pause(mode="abort")
    assert modes == ["wait", "abort"]


async def test_pause_on_a_server_without_the_route_says_so_instead_of_raising(fake_theta):
    fake_theta.fail_next("/pause", Failure(404, "Not Found"))
    async with client(fake_theta.url) as c:
        assert await c.admin.pause() is False


async def test_reload_weights_loads_the_checkpoint_it_names(fake_theta, tmp_path):
    weights = write_fake_weights(tmp_path / "step-1", seed=7)
    async with client(fake_theta.url) as c:
        await c.admin.reload_weights(weights)
    assert fake_theta.calls["/collective_rpc"] == [{"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(weights)}}]
    assert fake_theta.model.seed == 7


async def test_a_reload_may_take_longer_than_the_request_timeout_when_told(fake_theta, tmp_path):
    weights = write_fake_weights(tmp_path / "step-1", seed=7)
    fake_theta.fail_next("/collective_rpc", Failure(0, delay_s=2 * TIMEOUT_S, after_handling=True))
    async with client(fake_theta.url) as c:
        await c.admin.reload_weights(weights, timeout_s=10 * TIMEOUT_S)
    assert len(fake_theta.calls["/collective_rpc"]) == 1 and fake_theta.model.seed == 7


# Every failure after sending, for every admin call: resent if the call only sets a state.
CALLS = [  # (id, route, call, resent)
    ("pause", "/pause", lambda c, _: c.admin.pause(), True),
    ("resume", "/resume", lambda c, _: c.admin.resume(), True),
    ("reset_prefix_cache", "/reset_prefix_cache", lambda c, _: c.admin.reset_prefix_cache(), True),
    ("reload_weights", "/collective_rpc", lambda c, w: c.admin.reload_weights(w), False),
]


@pytest.mark.parametrize("failure, error", [(Failure(503, "overloaded"), ServerInternalError),
                                            (Failure(504, "stalled", delay_s=STALL_S), ServerTimeoutError)],
                         ids=["5xx", "timeout"])
@pytest.mark.parametrize("route, call, resent", [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])
async def test_only_calls_that_set_a_state_are_resent_after_they_may_have_acted(
        fake_theta, tmp_path, failure, error, route, call, resent):
    weights = write_fake_weights(tmp_path / "step-1", seed=7)
    fake_theta.fail_next(route, failure)
    async with client(fake_theta.url, max_retries=3) as c:
        if resent:
            await call(c, weights)
            assert c.transport.retries == 1 and len(fake_theta.calls[route]) == 2
        else:
            with pytest.raises(error):
                await call(c, weights)
            assert c.transport.retries == 0 and len(fake_theta.calls[route]) == 1


@pytest.mark.parametrize("route, call", [c[1:3] for c in CALLS], ids=[c[0] for c in CALLS])
async def test_a_refusal_is_never_resent(fake_theta, tmp_path, route, call):
    fake_theta.fail_next(route, Failure(400, "bad request"))
    async with client(fake_theta.url, max_retries=3) as c:
        with pytest.raises(ServerRejectedError, match="HTTP 400: bad request"):
            await call(c, write_fake_weights(tmp_path / "step-1", seed=7))
    assert len(fake_theta.calls[route]) == 1


async def test_a_reload_on_a_server_without_dev_mode_says_how_to_restart_it(fake_theta, tmp_path):
    fake_theta.fail_next("/collective_rpc", Failure(404, "Not Found"))
    async with client(fake_theta.url) as c:
        with pytest.raises(WeightSyncError, match="has no /collective_rpc: it was started without dev mode. Restart "
                                                  "it with VLLM_SERVER_DEV_MODE=1"):
            await c.admin.reload_weights(write_fake_weights(tmp_path / "step-1", seed=7))
    assert len(fake_theta.calls["/collective_rpc"]) == 1


async def test_a_refused_cache_reset_is_asked_again_until_it_succeeds(fake_theta):
    fake_theta.fail_next("/reset_prefix_cache", REFUSED, REFUSED)
    async with client(fake_theta.url) as c:
        await c.admin.reset_prefix_cache(retry_delay_s=0.0)
        assert c.transport.retries == 0  # answered refusals are asked again by the method, not resent by the transport
    assert len(fake_theta.calls["/reset_prefix_cache"]) == 3


async def test_a_cache_reset_refused_every_time_raises_after_its_attempts(fake_theta):
    fake_theta.fail_next("/reset_prefix_cache", *[REFUSED] * 4)
    async with client(fake_theta.url) as c:
        with pytest.raises(WeightSyncError, match="refused to reset its prefix cache 3 times.*honours /pause"):
            await c.admin.reset_prefix_cache(attempts=3, retry_delay_s=0.0)
    assert len(fake_theta.calls["/reset_prefix_cache"]) == 3


async def test_a_cache_reset_answer_without_success_is_malformed(fake_theta):
    fake_theta.fail_next("/reset_prefix_cache", Failure(200, '{"status": "ok"}'))
    async with client(fake_theta.url) as c:
        with pytest.raises(MalformedResponseError, match="not {'success': bool}"):
            await c.admin.reset_prefix_cache()


# -- the digest of the weights a server took (engines/vllm_plugin/worker_extension.py) -----------

async def test_weight_digest_is_every_rank_s_answer_once_they_agree(fake_theta):
    fake_theta.world_size, fake_theta.weight_digest = 2, "ab" * 16
    async with client(fake_theta.url) as c:
        assert (await c.admin.weight_digest()).digest == "ab" * 16
        fake_theta.weight_digest = None  # no update finished yet
        none = await c.admin.weight_digest()
    assert none.digest is None and "reports no digest" in none.missing
    assert fake_theta.calls["/collective_rpc"][0] == {"method": "dualvllm_weight_digest"}


async def test_ranks_that_took_different_weights_fail_the_digest(fake_theta):
    fake_theta.fail_next("/collective_rpc", Failure(200, '{"results": ["' + "a" * 32 + '", "' + "b" * 32 + '"]}'))
    async with client(fake_theta.url) as c:
        with pytest.raises(WeightSyncError, match="its ranks took different weights \\(digests by rank: "
                                                  "aaaaaaaaaaaa, bbbbbbbbbbbb\\)"):
            await c.admin.weight_digest()


async def test_a_server_without_the_extension_says_which_flag_is_missing_and_is_asked_once(fake_theta):
    fake_theta.digest_extension = False
    async with client(fake_theta.url, max_retries=3) as c:
        answer = await c.admin.weight_digest()
    assert answer.digest is None
    assert "--worker-extension-cls dualvllm.engines.vllm_plugin.worker_extension.WeightDigestExtension" in answer.missing
    assert len(fake_theta.calls["/collective_rpc"]) == 1  # "not implemented" is not asked again
