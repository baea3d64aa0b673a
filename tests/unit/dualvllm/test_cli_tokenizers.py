"""Where the CLI's coordinator tokenizes: here when it started the servers itself, over HTTP otherwise."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from dualvllm import cli


@pytest.fixture
def configs(monkeypatch) -> list:
    """The CoordinatorConfig of every coordinator the CLI opens; no server starts."""
    seen: list = []

    @contextlib.asynccontextmanager
    async def launch(pairs):
        yield [(SimpleNamespace(url="http://127.0.0.1:1"), SimpleNamespace(url="http://127.0.0.1:2")) for _ in pairs]

    class Coordinator:
        def __init__(self, config, **_):
            seen.append(config)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *_):
            return None

    monkeypatch.setattr(cli, "launch_replicas", launch)
    monkeypatch.setattr(cli, "DualVLLMCoordinator", Coordinator)
    return seen


@pytest.mark.parametrize(("flags", "local"), [
    ([], True),  # the model directories are here: no /tokenize request per text per server
    (["--no-local-tokenizers"], False),
    (["--theta-url", "http://127.0.0.1:3", "--t-url", "http://127.0.0.1:4"], False),  # given servers: over HTTP
    (["--theta-url", "http://127.0.0.1:3", "--t-url", "http://127.0.0.1:4", "--local-tokenizers"], True),
])
async def test_servers_started_here_are_tokenized_here_unless_told(configs, flags, local):
    args = cli._parser().parse_args(["serve", *flags])
    async with cli._coordinator(args, default_local=True):
        pass
    assert configs[-1].local_tokenizers is local
