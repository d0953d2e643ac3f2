"""The ``cluster`` use-cases: a local Ray cluster that outlives one command (``up``,
``down``, ``status``), recorded in :func:`service.tasks.live.state_dir`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from executor.emulation import is_emulated
from executor.errors import ExecutorError
from executor.local.persistent_cluster import (
    PersistentCluster,
    is_running,
    ray_status,
    read_state,
    start_persistent,
    stop_persistent,
)
from service.tasks.common import ClusterRef, Request, cluster_spec
from service.tasks.live import SPEC_FILE, quiet_ray_logs, state_dir
from service.tasks.progress import QUIET, Reporter


class ClusterUpRequest(Request):
    """The spec to start, and the object store of each of its nodes."""

    spec: ClusterRef
    object_store_mb: int = 500


@dataclass(frozen=True)
class ClusterUp:
    """A started cluster: its record, and whether its device speeds are emulated."""

    state: PersistentCluster
    emulated: bool

    def to_dict(self) -> dict[str, Any]:
        return {**self.state.to_dict(), "emulated": self.emulated}


def cluster_up(request: ClusterUpRequest, reporter: Reporter = QUIET) -> ClusterUp:
    """Start the spec's cluster, record it and the spec."""
    spec = cluster_spec(request.spec)
    quiet_ray_logs()
    with reporter.step(f"starting {spec.name!r}: {len(spec.nodes)} Ray nodes"):
        state = start_persistent(spec, state_dir(), object_store_mb=request.object_store_mb)
    spec.save(state_dir() / SPEC_FILE)
    return ClusterUp(state, is_emulated(spec))


@dataclass(frozen=True)
class ClusterStopped:
    """The cluster that was stopped, and how many of its processes were running."""

    state: PersistentCluster
    stopped: int


def cluster_down() -> ClusterStopped | None:
    """Stop the recorded cluster (only its processes); None when none is recorded."""
    try:
        state = read_state(state_dir())
    except ExecutorError:
        return None
    stopped = stop_persistent(state_dir())
    (state_dir() / SPEC_FILE).unlink(missing_ok=True)
    return ClusterStopped(state, stopped)


@dataclass(frozen=True)
class ClusterStatus:
    """The recorded cluster (None: none), whether it runs, and ``ray status`` of it."""

    state: PersistentCluster | None
    running: bool = False
    ray_status: str = ""


def cluster_status() -> ClusterStatus:
    """What ``cluster up`` recorded, and whether it still runs."""
    try:
        state = read_state(state_dir())
    except ExecutorError:
        return ClusterStatus(None)
    if not is_running(state):
        return ClusterStatus(state)
    return ClusterStatus(state, True, ray_status(state.address).rstrip())
