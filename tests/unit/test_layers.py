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


# service/'s own layers, bottom to top: a module imports only from layers below its own, so
# none needs TYPE_CHECKING or an import order to load (an errors <-> responses <-> scoring
# circle once made `import service.errors` fail on its own).
SERVICE_LAYERS = [{"errors", "schema", "config", "tokens", "batching"}, {"scoring"}, {"responses"}, {"formats"}, {"jobs"},
                  {"metrics", "streaming", "dev_routes", "generate"}, {"app"}]


def test_service_modules_import_one_way():
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "service"
    layer = {name: level for level, names in enumerate(SERVICE_LAYERS) for name in names}
    assert set(layer) == {p.stem for p in package.glob("*.py")} - {"__init__"}, "a service module without a layer"
    for name, level in layer.items():
        tree = ast.parse((package / f"{name}.py").read_text())
        used = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "service"
                for alias in node.names}
        used |= {node.module.split(".")[1] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("service.")}
        used |= {alias.name.split(".")[1] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names if alias.name.startswith("service.")}
        above = {u for u in used if layer[u] >= level and u != name}
        assert not above, f"service.{name} imports {sorted(above)}, which are not below it"
