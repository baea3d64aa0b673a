"""The import layers of STYLE.md: theory <- engines, coordinator (no torch) <- training <- CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    return set(subprocess.check_output([sys.executable, "-c", code], text=True).split())


@pytest.mark.parametrize("module", ["theory", "engines", "coordinator", "service.app", "dualvllm.cli",
                                    "tinymodels.task"])
def test_sampling_side_never_imports_torch_or_transformers(module):
    loaded = imported_after(module)
    assert not {"torch", "transformers", "vllm"} & loaded, f"importing {module} pulled in heavy packages"


def test_common_is_the_bottom_layer():
    loaded = imported_after("common.errors") | imported_after("common.validation")
    assert not {"theory", "engines", "coordinator", "training", "dualvllm", "numpy", "aiohttp"} & loaded


def test_theory_has_no_io_dependencies():
    loaded = imported_after("theory")
    assert not {"aiohttp", "asyncio", "coordinator", "engines"} & loaded
