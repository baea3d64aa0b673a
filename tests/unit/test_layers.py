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


MAX_METHODS = 20  # issue 45: no class of the sampling side has more, dunders and properties included


@pytest.mark.parametrize("package", ["engines", "coordinator"])
def test_no_class_has_more_than_twenty_methods(package):
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / package
    sizes = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(root.parent)}:{node.name}"] = sum(
                    isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
    assert sizes, f"found no class under {root}: the check would say nothing"
    assert {name: n for name, n in sizes.items() if n > MAX_METHODS} == {}


def test_no_lock_is_held_across_an_await_that_does_io():
    """Issue 45's check: inside `async with <a lock>:` the only await allowed is compute handed to a
    thread (asyncio.to_thread: the in-process engine's forward pass). A lock held across a server
    call would let one slow server stall everything that waits on it."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    held, found = [], 0
    for package in ("engines", "coordinator", "service", "training", "common"):
        for path in (repo / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.AsyncWith):
                    continue
                if not any("lock" in ast.unparse(item.context_expr).lower() for item in node.items):
                    continue
                found += 1
                for inner in (n for statement in node.body for n in ast.walk(statement)):
                    if isinstance(inner, ast.Await) and not ast.unparse(inner.value).startswith("asyncio.to_thread("):
                        held.append(f"{path.relative_to(repo)}:{inner.lineno}: {ast.unparse(inner)}")
    assert found >= 5, f"found {found} lock blocks: the check would say nothing"
    assert held == []
