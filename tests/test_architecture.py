"""The layout's rules (DESIGN.md, "Layout"), read off the source with ``ast``.

- ``core`` imports neither torch nor Ray, nor any other package of the project;
- Ray is imported only in ``executor/`` and the RLlib adapter ``agents/rllib_ppo.py``;
- arrows point one way: ``service -> agents, executor, envs -> core``, ``models`` beside core;
- no import cycle between files; an import placed inside a function only for torch
  (torchvision), Ray or RLlib, the heavy libraries a light command or the API process must
  not load (DESIGN.md, "Import name and start-up"): every other import is at the top;
- so ``pipeplan``'s light commands start without torch or Ray, and the API process starts
  and serves without either (checked in a fresh interpreter).
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "models", "envs", "agents", "executor", "service")
RAY_ALLOWED = ("executor/", "agents/rllib_ppo.py")
HEAVY = ("torch", "torchvision", "ray", "transformers")
"""The libraries a function may import (``ray.rllib`` is RLlib; ``transformers`` is the
optional ``hf`` extra): every other import is at the top of its file."""
MAY_IMPORT = {  # package -> the project packages it may import
    "core": set(),
    "models": {"core"},
    "envs": {"core"},
    "agents": {"core", "envs", "models"},
    "executor": {"core", "models", "agents"},
    "service": {"core", "models", "envs", "agents", "executor"},
}


def _files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    """The installed name: ``core/costmodel.py`` is ``pipeplan.core.costmodel``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pipeplan", *parts])


@functools.cache
def _imports(path: Path) -> tuple[tuple[str, ast.AST, bool], ...]:
    """(imported module, node, inside a function) for every import of the file; relative
    imports resolved; ``if TYPE_CHECKING:`` blocks skipped. Each file is parsed once for
    all the rules."""
    package = (
        _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    )
    return tuple(_imports_in(path.read_text(), package, str(path)))


def _imports_in(
    source: str, package: str, filename: str = "<source>"
) -> Iterator[tuple[str, ast.AST, bool]]:
    """:func:`_imports` of ``source``, a module of ``package``."""
    tree = ast.parse(source, filename)

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[str, ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child, in_function
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                yield base, child, in_function
                for alias in child.names:  # `from pkg import module`
                    yield f"{base}.{alias.name}", child, in_function
            yield from walk(child, inner)

    yield from walk(tree, False)


def _top(module: str) -> str:
    """The top-level name, with the project's packages by their folder: ``pipeplan.core.x``
    is ``core``."""
    parts = module.split(".")
    if parts[0] == "pipeplan" and len(parts) > 1:
        return parts[1]
    return parts[0]


def test_core_imports_neither_torch_nor_ray_nor_the_project() -> None:
    bad = [
        f"{p.relative_to(ROOT)}:{node.lineno} imports {name}"  # type: ignore[attr-defined]
        for p in (ROOT / "core").rglob("*.py")
        for name, node, _ in _imports(p)
        if _top(name) in {"torch", "torchvision", "ray", *PACKAGES} - {"core"}
    ]
    assert not bad, "\n".join(bad)


def test_ray_is_imported_only_by_the_executor_and_the_rllib_adapter() -> None:
    bad = [
        f"{p.relative_to(ROOT)}:{node.lineno} imports {name}"  # type: ignore[attr-defined]
        for p in _files()
        for name, node, _ in _imports(p)
        if _top(name) == "ray" and not str(p.relative_to(ROOT)).startswith(RAY_ALLOWED)
    ]
    assert not bad, "\n".join(bad)


def test_packages_import_only_downwards() -> None:
    bad = []
    for p in _files():
        own = p.relative_to(ROOT).parts[0]
        for name, node, _ in _imports(p):
            top = _top(name)
            if top in PACKAGES and top != own and top not in MAY_IMPORT[own]:
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {name}")  # type: ignore[attr-defined]
    assert not bad, "\n".join(bad)


def test_only_torch_ray_and_rllib_are_imported_inside_a_function() -> None:
    bad = sorted(
        {
            f"{p.relative_to(ROOT)}:{node.lineno} imports {name}"  # type: ignore[attr-defined]
            for p in _files()
            for name, node, inside in _imports(p)
            if inside and _top(name) not in HEAVY
        }
    )
    assert not bad, f"{len(bad)} imports inside functions:\n" + "\n".join(bad)


def test_the_function_level_import_rule_reads_the_source() -> None:
    source = (
        "import json\n"
        "def f():\n"
        "    import torch\n"
        "    from ray.rllib.algorithms.ppo import PPOConfig\n"
        "    import yaml\n"
        "    from pipeplan.models import zoo\n"
    )
    imports = list(_imports_in(source, "pipeplan.service"))
    assert {name for name, _, inside in imports if inside and _top(name) not in HEAVY} == {
        "yaml",
        "pipeplan.models",
        "pipeplan.models.zoo",
    }
    assert {name for name, _, inside in imports if not inside} == {"json"}


_PROBE = """
import json, sys
heavy = set({heavy!r})
added = {{}}
for label, code in {steps!r}:
    before = heavy & set(sys.modules)
    exec(compile(code, label, "exec"), {{"__name__": "__probe__"}})
    added[label] = sorted((heavy & set(sys.modules)) - before)
print("PROBE " + json.dumps(added))
"""


def _loaded(
    *steps: tuple[str, str], heavy: tuple[str, ...] = (*HEAVY, "ray.rllib")
) -> dict[str, set[str]]:
    """The heavy libraries each step (a label and its code) adds to ``sys.modules``, the
    steps run one after the other in one fresh interpreter: a library an earlier step
    loaded is charged to that step only (the first step named is the one to fix). One
    interpreter for several steps, as each start imports the project's base again."""
    probe = _PROBE.format(heavy=sorted(heavy), steps=list(steps))
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith("PROBE "))
    return {label: set(found) for label, found in json.loads(line[len("PROBE ") :]).items()}


def test_the_probe_charges_each_library_to_the_step_that_loaded_it() -> None:
    steps = [("a", "import json"), ("b", "import xml.dom"), ("c", "import xml.dom, html")]
    assert _loaded(*steps, heavy=("xml.dom", "html")) == {
        "a": set(),
        "b": {"xml.dom"},
        "c": {"html"},
    }


LIGHT_COMMANDS = (
    "pipeplan.service.cli",
    "pipeplan.service.cli.simulate",  # simulate, validate
    "pipeplan.service.cli.submit",
    "pipeplan.service.cli.jobs",
)
"""What ``pipeplan`` imports to start, and the light commands."""


API_DEFINITIONS = (
    "pipeplan.executor.config",  # run and train settings; the engine's limits
    "pipeplan.executor.data_spec",
    "pipeplan.executor.loss_spec",
    "pipeplan.executor.resources",  # the Ray resources a node advertises, by name
    "pipeplan.executor.worker_calls",  # what a pool worker's call gives back
    "pipeplan.models.reference",  # a model reference's form and input fields
    "pipeplan.models.zoo_names",  # the zoo's names and input sizes
)
"""What the API checks a job with and names, apart from the torch- and Ray-using code that
imports it."""


def test_the_light_commands_and_the_api_definitions_import_neither_torch_nor_ray() -> None:
    steps = [(m, f"import {m}") for m in (*LIGHT_COMMANDS, *API_DEFINITIONS)]
    assert _loaded(*steps) == {label: set() for label, _ in steps}


SERVE = """
import tempfile
from pathlib import Path

from fastapi.testclient import TestClient

from pipeplan.service.api.app import create_app
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

STAGE = {"layers": [0, 2], "devices": ["n0/fast:0"], "microbatch": 4}
PLAN = {"global_batch": 8, "stages": [STAGE]}
SPECS = {
    "plan": {"model": "digits_cnn", "input_size": 8, "cluster": "local-hetero", "planner": "dp"},
    "run": {"plan": PLAN, "model": "digits_cnn", "data": "digits", "engine": "torch-pipelining"},
    "train": {"plan": PLAN, "model": "digits_cnn", "cluster": "local-hetero", "data": "digits",
              "loss": "cross-entropy", "optimizer": "adam", "checkpoint_dir": "/ckpt"},
    "profile": {"model": "gpt", "input_size": 16},
}
with tempfile.TemporaryDirectory() as tmp:
    app = create_app(make_settings(Path(tmp)), backend=FakeBackend())
    with TestClient(app, headers=AUTH) as client:
        assert client.get("/healthz").status_code == 200
        ids = []
        for kind, spec in SPECS.items():
            r = client.post("/v1/jobs", json={"kind": kind, "spec": spec})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        r = client.post("/v1/jobs", json={"kind": "profile", "spec": {"model": "alexnet",
                                                                        "input_size": 8}})
        assert r.status_code == 422 and "must be >= 63" in r.text, r.text
        assert len(client.get("/v1/jobs").json()["items"]) == len(SPECS)
        for path in ("/", "/cluster", *(f"/jobs/{i}" for i in ids),
                     *(f"/jobs/{i}/plan" for i in ids), f"/v1/jobs/{ids[0]}/artifacts"):
            assert client.get(path).status_code == 200, path
"""
"""Serve the API in this process: health, jobs of every kind checked and listed, the
dashboard's pages (a zoo model's plan panel included) and a job's artifacts."""


@pytest.mark.slow
def test_the_api_process_starts_and_serves_the_dashboard_without_torch_or_ray() -> None:
    steps = [("start", "import pipeplan.service.api.app"), ("serve", SERVE)]
    assert _loaded(*steps) == {"start": set(), "serve": set()}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in _files()}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for name, _, _ in _imports(path):
            target = name
            while target and target not in files:  # `pkg.mod.attr` -> `pkg.mod`
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                graph[module].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_between_files() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [({"a": {"b"}, "b": {"c"}, "c": set()}, False), ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True)],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], has_cycle: bool) -> None:
    assert (_cycle(graph) is not None) is has_cycle


def test_every_package_folder_is_installed_under_pipeplan() -> None:
    """``pyproject.toml`` lists the packages by their ``pipeplan.`` names (setuptools'
    package-dir maps them onto the top-level folders): a new folder must be listed, or an
    installed pipeplan would lack it."""

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        _module_name(p.parent / "__init__.py")
        for package in PACKAGES
        for p in (ROOT / package).rglob("__init__.py")
    }
    assert folders | {"pipeplan"} == listed
