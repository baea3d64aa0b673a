"""The lockstep plugin probe (coordinator/lockstep/probe.py) against fake lockstep servers, and the
stop token the wire format reserves (see test_lockstep.py for the fakes)."""

from __future__ import annotations

import asyncio

import pytest

from dualvllm.coordinator.lockstep.probe import lockstep_stop_token, probe_servers
from dualvllm.engines.lockstep_channel import LockstepChannel
from dualvllm.engines.protocol import ModelInfo
from dualvllm.engines.vllm_plugin import wire
from tests.fake_lockstep import EOS_ID, FakeLockstepServer, FakeModel

# A hang is a failure, not a 900 s wait.
pytestmark = pytest.mark.timeout(60)


async def test_the_probe_tells_servers_with_and_without_the_plugin_and_their_capacity(rig):
    with_plugin = FakeLockstepServer("theta", FakeModel(1), capacity=48)
    smaller = FakeLockstepServer("t", FakeModel(2), capacity=20)
    without = FakeLockstepServer("t", FakeModel(2), plugin=False)
    chunked = FakeLockstepServer("t", FakeModel(2), flags=wire.FLAG_CHUNKED_PREFILL)
    rig.fakes.extend([with_plugin, smaller, without, chunked])
    channel = LockstepChannel()
    try:
        probe = await probe_servers(channel, [with_plugin, smaller], [1, 2, 3], EOS_ID, 10.0)
        assert probe.unavailable is None and probe.capacity == 20  # the smaller server's
        (request,) = with_plugin.requests
        assert request.answers == [(0, wire.END)] and request.finish == "stop" and request.max_tokens == 2
        # One server in both roles (a self-teacher) is probed once and holds two requests per sequence.
        probe = await probe_servers(channel, [with_plugin, with_plugin], [1, 2, 3], EOS_ID, 10.0)
        assert probe.unavailable is None and probe.capacity == 24 and len(with_plugin.requests) == 2

        probe = await probe_servers(channel, [with_plugin, without], [1, 2, 3], EOS_ID, 10.0)
        assert probe.unavailable is not None and "no dualvllm lockstep plugin" in probe.unavailable
        assert probe.unavailable.startswith(f"t server at {without.url}")

        probe = await probe_servers(channel, [chunked], [1, 2, 3], EOS_ID, 10.0)
        assert probe.unavailable is not None and "chunked prefill" in probe.unavailable
        assert chunked.idle and with_plugin.idle
    finally:
        channel.close()


async def test_the_probe_names_a_plugin_of_another_dualvllm_version(rig):
    """A server whose plugin speaks another wire version (another dualvllm installed there) is
    refused at once, with the reason, instead of waiting out the probe as a server without one."""
    older = FakeLockstepServer("t", FakeModel(2), wire_version=wire.VERSION - 1)
    rig.fakes.append(older)
    channel = LockstepChannel()
    try:
        probe = await asyncio.wait_for(probe_servers(channel, [older], [1, 2, 3], EOS_ID, 30.0), 20.0)
    finally:
        channel.close()
    assert probe.unavailable is not None and probe.unavailable.startswith(f"t server at {older.url}")
    assert "could not be read" in probe.unavailable and "different dualvllm versions" in probe.unavailable


async def test_the_probe_reports_a_refused_request(rig):
    refusing = FakeLockstepServer("theta", FakeModel(1), fail_when=lambda r: True)
    rig.fakes.append(refusing)
    channel = LockstepChannel()
    try:
        probe = await probe_servers(channel, [refusing], [1, 2, 3], EOS_ID, 10.0)
    finally:
        channel.close()
    assert probe.unavailable is not None
    assert "probe request failed" in probe.unavailable and "connection reset" in probe.unavailable


@pytest.mark.parametrize(("pads", "eos", "expected"), [
    ((0, 0), {1}, 0),  # the shared padding token: never sampled, so no stream ends early
    ((0, 5), {1}, 1),  # the models disagree on padding: an EOS
    ((None, None), {3, 2}, 2),  # unknown padding: the smallest EOS
    ((2, 2), {2, 3}, 2),  # padding that is an EOS: that EOS
])
def test_the_lockstep_stop_token_is_the_shared_padding_token_else_an_eos(pads, eos, expected):
    infos = tuple(ModelInfo(name="m", root="/m", max_model_len=64, pad_token_id=pad) for pad in pads)
    assert lockstep_stop_token(infos, frozenset(eos)) == expected
