"""The dev routes with several base replicas (dualvllm.service.dev_routes): an NCCL trainer sizes its
group from /get_world_size and every replica's workers get ranks of their own; and a tied base
takes no weight push. Against fake vLLM servers over real HTTP, which record what they received."""

from __future__ import annotations

import json

import aiohttp

from dualvllm.service.dev_routes import ties_embeddings
from dualvllm.training.untie import UNTIE_COMMAND
from tests.unit.service.test_service import post, running

NCCL_INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 6,
             "packed": True}


async def world_size(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url + "/get_world_size") as response:
        assert response.status == 200
        return (await response.json())["world_size"]


async def test_each_base_replica_gets_its_own_rank_offset_in_a_group_sized_by_get_world_size(
        fake_theta, second_theta, fake_t):
    fake_theta.world_size, second_theta.world_size = 2, 3  # TP 2, and TP 3 (x PP x DP)
    async with running(fake_theta, fake_t, {"theta_urls": [fake_theta.url, second_theta.url]},
                       dev_mode=True) as (url, _):
        assert await world_size(url) == 5  # TRL's client adds its own rank: a group of 6
        status, answer = await post(url, "/init_weight_transfer_engine", {"init_info": NCCL_INIT})
        assert status == 200, answer
    sent = [s.calls["/init_weight_transfer_engine"] for s in (fake_theta, second_theta)]
    assert sent == [[{"init_info": {**NCCL_INIT, "rank_offset": 1}}], [{"init_info": {**NCCL_INIT, "rank_offset": 3}}]]


async def test_a_group_too_small_for_the_replicas_is_refused_before_any_replica_hears_of_it(
        fake_theta, second_theta, fake_t):
    fake_theta.world_size, second_theta.world_size = 2, 2
    async with running(fake_theta, fake_t, {"theta_urls": [fake_theta.url, second_theta.url]},
                       dev_mode=True) as (url, _):
        status, answer = await post(url, "/init_weight_transfer_engine",
                                     {"init_info": {**NCCL_INIT, "world_size": 3}})  # one replica's worth
    assert status == 400 and "world_size 3 cannot hold the base replicas' workers" in answer["error"]["message"]
    assert "GET /get_world_size gives that sum" in answer["error"]["message"]
    assert not fake_theta.calls["/init_weight_transfer_engine"] and not second_theta.calls["/init_weight_transfer_engine"]


async def test_a_non_nccl_init_goes_to_every_replica_as_it_is(fake_theta, second_theta, fake_t):
    async with running(fake_theta, fake_t, {"theta_urls": [fake_theta.url, second_theta.url]},
                       dev_mode=True) as (url, _):
        assert (await post(url, "/init_weight_transfer_engine", {"init_info": {"segment": "s"}}))[0] == 200
    assert fake_theta.calls["/init_weight_transfer_engine"] == second_theta.calls["/init_weight_transfer_engine"] \
        == [{"init_info": {"segment": "s"}}]


async def test_a_tied_base_takes_no_weight_push_and_the_answer_gives_the_untie_command(fake_theta, fake_t, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    fake_theta.root = str(tmp_path)
    async with running(fake_theta, fake_t, dev_mode=True) as (url, _):
        for path in ("/init_weight_transfer_engine", "/start_weight_update"):
            status, answer = await post(url, path, {"init_info": NCCL_INIT} if "init" in path else {})
            assert status == 409 and answer["error"]["code"] == "tied_embeddings", (path, answer)
            assert f"`{UNTIE_COMMAND} {tmp_path} {tmp_path}-untied`" in answer["error"]["message"]
        status, _ = await post(url, "/v1/completions", {"model": "fake-base+fake-teacher", "prompt": "abc",
                                                        "max_tokens": 2})
        assert status == 200  # still served and sampled: only pushes are refused
    assert not fake_theta.calls["/init_weight_transfer_engine"] and not fake_theta.calls["/pause"]


def test_tied_embeddings_are_read_from_the_model_directory_else_from_the_servers_own_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    tied_repr = {"model_config": {"hf_config": 'Qwen3Config {\n  "tie_word_embeddings": true,\n  "vocab_size": 9\n}'}}
    assert ties_embeddings(str(tmp_path), tied_repr) is False  # the directory the server loaded says
    assert ties_embeddings("Qwen/Qwen3-0.6B", tied_repr) is True  # a hub name: the server's config says
    assert ties_embeddings("Qwen/Qwen3-0.6B", {"model_config": {"hf_config": '"tie_word_embeddings": false'}}) is False
    assert ties_embeddings("/nonexistent", None) is False
