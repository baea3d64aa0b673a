"""vLLM's dev routes on the q* service (dualvllm.service.dev_routes), forwarded to the base servers, as
TRL's stock client drives them, against fake vLLM servers (the real phases move weights in
tests/integration/training/test_service_trl.py).

What is asserted is what the base server received, in order: the update is fenced (pause
"keep" before start), finished, the KV cache dropped and the server resumed, and the
teacher never touched.
"""

from __future__ import annotations

import asyncio

import pytest

from dualvllm.service import dev_routes
from tests.unit.service.test_service import MODEL, post, running
from tests.waiting import eventually

vllm_client = pytest.importorskip("trl.generation.vllm_client")

WEIGHT_PATHS = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                "/reset_prefix_cache", "/resume"]


@pytest.fixture
async def dev_service(fake_theta, fake_t):
    async with running(fake_theta, fake_t, dev_mode=True) as (url, coordinator):
        yield url, coordinator


def weight_calls(fake) -> list[str]:
    return [path for path in fake.order if path in WEIGHT_PATHS]


async def test_trl_reads_the_base_servers_config_with_processed_logprobs(dev_service):
    url, _ = dev_service
    client = await asyncio.to_thread(vllm_client.VLLMClient, base_url=url)
    info = await asyncio.to_thread(client.get_server_info)
    # log q* of what was sampled, temperature applied: TRL's IS correction then warns of nothing
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["weight_transfer_config"] == {"backend": "dualvllm_shm"}
    assert info["dualvllm"]["teacher"] and info["dualvllm"]["base_replicas"] == 1
    assert await asyncio.to_thread(client.get_world_size) == 1


async def test_an_update_is_fenced_finished_and_resumed_on_the_base_alone(dev_service, fake_theta, fake_t):
    url, _ = dev_service
    for path, body in [("/init_weight_transfer_engine", {"init_info": {"segment": "x"}}),
                       ("/start_weight_update", {}),
                       ("/update_weights", {"update_info": {"names": ["a"]}}),
                       ("/update_weights", {"update_info": {"names": ["b"]}}),
                       ("/finish_weight_update", {"weight_version": "step-7"})]:
        status, answer = await post(url, path, body)
        assert status == 200, (path, answer)
    assert weight_calls(fake_theta) == ["/pause", "/start_weight_update", "/update_weights", "/update_weights",
                                        "/finish_weight_update", "/reset_prefix_cache", "/resume"]
    assert fake_theta.calls["/init_weight_transfer_engine"] == [{"init_info": {"segment": "x"}}]
    assert [b["update_info"]["names"] for b in fake_theta.calls["/update_weights"]] == [["a"], ["b"]]
    assert fake_theta.calls["/finish_weight_update"] == [{"weight_version": "step-7"}]
    assert weight_calls(fake_t) == [] and not fake_t.calls["/init_weight_transfer_engine"]
    status, info = await post(url, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 3})
    assert status == 200, info  # sampling goes on after the update


async def test_phases_out_of_order_are_refused(dev_service, fake_theta):
    url, _ = dev_service
    status, body = await post(url, "/update_weights", {"update_info": {}})
    assert status == 409 and "POST /start_weight_update first" in body["error"]["message"]
    assert (await post(url, "/start_weight_update", {}))[0] == 200
    status, body = await post(url, "/start_weight_update", {})
    assert status == 409 and "already in progress" in body["error"]["message"]
    assert (await post(url, "/finish_weight_update", {}))[0] == 200
    assert fake_theta.running.is_set()


async def test_an_update_its_trainer_abandoned_is_ended_and_sampling_resumes(fake_theta, fake_t, monkeypatch):
    monkeypatch.setattr(dev_routes, "UPDATE_IDLE_S", 0.2)
    async with running(fake_theta, fake_t, dev_mode=True) as (url, _):
        assert (await post(url, "/start_weight_update", {}))[0] == 200
        assert not fake_theta.running.is_set()  # paused for the update
        await eventually(lambda: fake_theta.running.is_set(), "the abandoned update ended and the base resumed")
        assert weight_calls(fake_theta)[-3:] == ["/finish_weight_update", "/reset_prefix_cache", "/resume"]
        status, body = await post(url, "/update_weights", {"update_info": {}})
        assert status == 409, body  # the trainer that comes back late hears it


async def test_without_dev_mode_the_routes_do_not_exist(fake_theta, fake_t):
    async with running(fake_theta, fake_t) as (url, _):
        for path in ("/start_weight_update", "/init_weight_transfer_engine", "/reset_prefix_cache"):
            assert (await post(url, path, {}))[0] == 404
        assert not fake_theta.calls["/start_weight_update"]
