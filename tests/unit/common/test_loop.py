"""common/loop.py: the event loop of dualvllm's entry points."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
import uvloop

from dualvllm.common import loop
from dualvllm.common.errors import InvalidInputError
from dualvllm import cli


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_uvloop_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv(loop.LOOP_ENV, raising=False)
    assert loop.chosen() == "uvloop"
    assert issubclass(loop.run(_loop_type()), uvloop.Loop)
    monkeypatch.setenv(loop.LOOP_ENV, "asyncio")
    assert not issubclass(loop.run(_loop_type()), uvloop.Loop)
    monkeypatch.setenv(loop.LOOP_ENV, " UVloop ")
    assert issubclass(loop.run(_loop_type()), uvloop.Loop)


def test_uvloop_asked_for_but_missing_names_the_fix(monkeypatch):
    monkeypatch.setattr(loop.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv(loop.LOOP_ENV, raising=False)
    assert loop.chosen() == "asyncio"  # not asked for: the standard loop, silently
    monkeypatch.setenv(loop.LOOP_ENV, "uvloop")
    with pytest.raises(InvalidInputError, match=r"uvloop is not installed: `pip install uvloop`, or set "
                                                r"DUALVLLM_EVENT_LOOP=asyncio"):
        loop.chosen()


def test_an_unknown_loop_is_refused_and_its_coroutine_closed(monkeypatch):
    monkeypatch.setenv(loop.LOOP_ENV, "trio")
    coroutine = _loop_type()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would be a RuntimeWarning
        with pytest.raises(InvalidInputError, match=r"DUALVLLM_EVENT_LOOP='trio' is not an event loop dualvllm "
                                                    r"knows; set it to one of uvloop, asyncio"):
            loop.run(coroutine)
        del coroutine
        gc.collect()


def test_the_command_refuses_an_unknown_loop_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv(loop.LOOP_ENV, "trio")
    assert cli.main(["generate", "--input", "missing.jsonl", "--output", "out.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dualvllm: error: DUALVLLM_EVENT_LOOP='trio'") and err.count("\n") == 1, err


def test_a_background_loop_is_of_the_chosen_kind(monkeypatch):
    monkeypatch.delenv(loop.LOOP_ENV, raising=False)
    background = loop.new_event_loop()
    try:
        assert isinstance(background, uvloop.Loop)
        assert background.run_until_complete(_loop_type()) is type(background)
    finally:
        background.close()
    monkeypatch.setenv(loop.LOOP_ENV, "asyncio")
    background = loop.new_event_loop()
    try:
        assert not isinstance(background, uvloop.Loop)
    finally:
        background.close()
