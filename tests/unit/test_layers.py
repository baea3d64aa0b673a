"""The import layers of STYLE.md: theory <- engines, coordinator (no torch) <- training <- CLI,
each installed as dualvllm.<name> and imported by that name only."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The folders at the top of the repository, each installed as dualvllm.<name> through its
# symlink dualvllm/<name> -> ../<name> (pyproject's packages.find takes only dualvllm*).
PACKAGES = ("common", "theory", "engines", "coordinator", "service", "training", "tinymodels")


def imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    return set(subprocess.check_output([sys.executable, "-c", code], text=True).split())


@pytest.mark.parametrize("module", ["dualvllm.theory", "dualvllm.engines", "dualvllm.coordinator", "dualvllm.service.app",
                                    "dualvllm.cli", "dualvllm.tinymodels.task"])
def test_sampling_side_never_imports_torch_or_transformers(module):
    loaded = imported_after(module)
    assert not {"torch", "transformers", "vllm"} & loaded, f"importing {module} pulled in heavy packages"


def test_the_command_line_and_the_training_config_load_without_torch():
    """Every `dualvllm` command builds its parser from the training config: torch (2-5 s to
    import) loads only once a run resolves its learner's device, not for `--help` or a refused recipe."""
    loaded = imported_after("dualvllm.cli; dualvllm.cli._parser(); import dualvllm.training.config")
    assert not {"torch", "transformers"} & loaded


def test_common_is_the_bottom_layer():
    loaded = imported_after("dualvllm.common.errors") | imported_after("dualvllm.common.validation")
    above = {m for m in loaded if m.startswith("dualvllm.") and m.split(".")[1] != "common"}
    assert not above and not {"numpy", "aiohttp"} & loaded, sorted(above | {"numpy", "aiohttp"} & loaded)


def test_theory_has_no_io_dependencies():
    loaded = imported_after("dualvllm.theory")
    assert not {"aiohttp", "asyncio", "dualvllm.coordinator", "dualvllm.engines"} & loaded


# service/'s own layers, bottom to top: a module imports only from layers below its own, so
# none needs TYPE_CHECKING or an import order to load (an errors <-> responses <-> scoring
# circle once made `import dualvllm.service.errors` fail on its own).
SERVICE_LAYERS = [{"errors", "schema", "config", "tokens", "batching"}, {"scoring"}, {"responses"}, {"formats"}, {"jobs"},
                  {"metrics", "streaming", "dev_routes", "generate", "worker_metrics", "building"}, {"running"}, {"app"},
                  {"workers"}]


def test_service_modules_import_one_way():
    package = REPO / "service"
    layer = {name: level for level, names in enumerate(SERVICE_LAYERS) for name in names}
    seen = 0
    assert set(layer) == {p.stem for p in package.glob("*.py")} - {"__init__"}, "a service module without a layer"
    for name, level in layer.items():
        tree = ast.parse((package / f"{name}.py").read_text())
        used = {alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "dualvllm.service" for alias in node.names}
        used |= {node.module.split(".")[2] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dualvllm.service.")}
        used |= {alias.name.split(".")[2] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names if alias.name.startswith("dualvllm.service.")}
        seen += len(used)
        above = {u for u in used if layer[u] >= level and u != name}
        assert not above, f"service.{name} imports {sorted(above)}, which are not below it"
    assert seen > 10, "found almost no imports of service/ modules: is the check reading them by their names?"


def test_every_package_is_installed_as_dualvllm_name_and_nothing_else():
    for name in PACKAGES:
        link = REPO / "dualvllm" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", f"{link} is not a symlink to ../{name}"
    top_level = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file() and not p.name.startswith(".")}
    assert top_level == {*PACKAGES, "dualvllm", "tests"}, "a new top-level package: link it from dualvllm/ too"
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["dualvllm*"]
    assert set(setuptools["package-data"]) == {"dualvllm.tinymodels"}


def python_files():
    """Every Python file of the repository (packages, tests, benchmarks, examples, scripts): its
    own folders only, not the dualvllm/<name> links to them, nor a venv or build output."""
    for folder, subfolders, files in os.walk(REPO):  # os.walk does not follow the links
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in {"build", "runs", "__pycache__"}]
        yield from (Path(folder) / f for f in files if f.endswith(".py"))


OLD_NAME = re.compile(rf"(?<![\w./-])(?:{'|'.join(PACKAGES)})(?:\.\w+)+")


def names_a_module(dotted: str) -> bool:
    """Whether `<package>.<module>[.attribute...]` names a module of the repository by its old,
    bare name (a package and at least one module or subpackage below it)."""
    parts = dotted.split(".")
    return any((REPO.joinpath(*parts[:n]).with_suffix(".py")).is_file() or (REPO.joinpath(*parts[:n]) / "__init__.py").is_file()
               for n in range(2, len(parts) + 1))


def test_nothing_imports_or_names_a_package_by_its_bare_name():
    """Installed, only dualvllm.<name> exists; in a checkout a bare `training` would still import,
    as a second copy of every module it loads. Strings count: monkeypatch targets, vLLM's
    --logits-processors and `python -m` commands name modules too."""
    found, checked = [], 0
    for path in python_files():
        checked += 1
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [m.group(0) for m in OLD_NAME.finditer(node.value) if names_a_module(m.group(0))]
                found += [f"{where}:{node.lineno}: {name!r} in a string" for name in names]
                continue
            else:
                continue
            found += [f"{where}:{node.lineno}: import {name}" for name in names if name.split(".")[0] in PACKAGES]
    assert checked > 200, f"read {checked} Python files: the check would say nothing"
    assert found == []


MAX_METHODS = 20  # issues 45 and 57: no class has more, dunders and properties included


@pytest.mark.parametrize("package", ["engines", "coordinator", "service", "training"])
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
