"""Fixtures of every test package.

**Ray leaks.** A module that starts Ray must stop it: after each module,
:func:`no_ray_left_behind` fails (an error at the module's last test's teardown) when this
process is still connected to a Ray cluster it was not connected to before the module, when
actors the module started are still alive on a cluster that outlives it, or when a Ray
process this test session started (a node of an in-process cluster, a ``ray start`` node,
the node of a ``pipeplan serve`` subprocess) is still alive a while after the module ended.
Such processes are told apart from other sessions' by :data:`SESSION_ENV`, which this
session's children inherit. The fixture then stops what was left, so that the next module
starts clean: no test has to skip "because another test left Ray connected".

``ray_local``: a single-node Ray in this process (``executor.runtime.start_local``) for a
module's tests, stopped after the module.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SESSION_ENV = "PIPEPLAN_TEST_SESSION"
"""Set in this process's environment to a value of its own: every process the tests start
(and every process those start) carries it, so their Ray processes can be found."""
os.environ[SESSION_ENV] = f"{os.getpid()}-{uuid.uuid4().hex}"

LEAK_GRACE_S = 20.0
"""How long a Ray process may take to exit after its cluster was stopped (a raylet's
workers notice their raylet's end within a few seconds)."""


def _ray_dir() -> str | None:
    spec = importlib.util.find_spec("ray")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(next(iter(spec.submodule_search_locations))).resolve())


RAY_DIR = _ray_dir()


def _is_ray_process(cmdline: list[str]) -> bool:
    """A Ray node's process: its binaries (raylet, gcs_server) and Python scripts (dashboard,
    agents, log monitor) live in Ray's package; its workers are named ``ray::...``."""
    if cmdline and cmdline[0].startswith("ray::"):
        return True
    return RAY_DIR is not None and any(arg.startswith(RAY_DIR) for arg in cmdline)


def session_ray_processes() -> dict[int, str]:
    """The live Ray processes this test session started, by pid: their command lines."""
    mark = f"{SESSION_ENV}={os.environ[SESSION_ENV]}".encode()
    found: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            if not _is_ray_process(cmdline):
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found[int(entry.name)] = " ".join(cmdline)[:200]
    return found


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")  # a module that never imported Ray cannot have started it
    return ray is not None and bool(ray.is_initialized())


def _alive_actors() -> set[str]:
    from pipeplan.executor import runtime

    return {str(a["ActorID"]) for a in runtime.actors() if a.get("State") != "DEAD"}


def _stop(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(autouse=True, scope="module")
def no_ray_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the module that leaves Ray behind (see the module's docstring), then clean up."""
    connected = _ray_connected()
    actors = _alive_actors() if connected else set()
    before = set(session_ray_processes())
    yield
    problems: list[str] = []
    if _ray_connected():
        if not connected:
            from pipeplan.executor import runtime

            runtime.shutdown()
            problems.append("this process is still connected to the Ray cluster it started")
        else:
            left = _alive_actors() - actors
            if left:
                problems.append(f"{len(left)} actor(s) it started are still alive")
    leaked = {p: c for p, c in session_ray_processes().items() if p not in before}
    deadline = time.monotonic() + LEAK_GRACE_S
    while leaked and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = session_ray_processes()
        leaked = {p: c for p, c in leaked.items() if p in alive}
    if leaked:
        _stop(set(leaked))
        shown = "\n".join(f"  {pid}: {cmd}" for pid, cmd in sorted(leaked.items())[:10])
        problems.append(
            f"{len(leaked)} Ray process(es) it started were still alive {LEAK_GRACE_S:g} s "
            f"after its last test (now killed):\n{shown}"
        )
    if problems:
        pytest.fail(f"{request.module.__name__} left Ray behind: " + "; ".join(problems))


@pytest.fixture(scope="module")
def ray_local() -> Iterator[Any]:
    """A single-node Ray started in this process for the module (2 CPUs), then stopped."""
    from pipeplan.executor import runtime

    runtime.start_local(num_cpus=2)
    try:
        yield runtime
    finally:
        runtime.shutdown()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every object alive once the tests are collected (the imported modules: torch, Ray,
    RLlib, the API, ...; the test items) is moved out of the garbage collector's sight: it
    would otherwise walk them all at each full collection, and a test that makes many
    objects (Optuna's trials) then runs 2-5x slower late in a session than alone."""
    gc.freeze()
