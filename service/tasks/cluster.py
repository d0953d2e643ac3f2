"""The ``cluster`` use-cases: a local Ray cluster that outlives one command (``up``,
``down``, ``status``), recorded in :func:`service.tasks.live.state_dir`; and this machine
joining a running cluster over the network as one node of a spec (``join``, ``leave``),
recorded in :func:`executor.join.default_join_dir`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeplan.executor.emulation import is_emulated
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.join import JoinedNode, default_join_dir, join, leave
from pipeplan.executor.local.persistent_cluster import (
    PersistentCluster,
    is_running,
    ray_status,
    read_state,
    start_persistent,
    stop_persistent,
)
from pipeplan.service.tasks.common import ClusterRef, Request, cluster_spec
from pipeplan.service.tasks.live import SPEC_FILE, quiet_ray_logs, state_dir
from pipeplan.service.tasks.progress import QUIET, Reporter


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


class ClusterJoinRequest(Request):
    """Join the cluster whose head is at ``address`` (``HOST:PORT``) as spec node ``node``.

    ``node_ip``: the address this machine is reached at (None: the one it routes to the head
    from); ``num_cpus``: Ray's CPU count of the node (None: this machine's)."""

    address: str
    node: str
    spec: ClusterRef
    node_ip: str | None = None
    object_store_mb: int = 500
    num_cpus: int | None = None


def cluster_join(request: ClusterJoinRequest, reporter: Reporter = QUIET) -> JoinedNode:
    """Start this machine's Ray node for the spec node and join it to the cluster."""
    spec = cluster_spec(request.spec)
    quiet_ray_logs()
    with reporter.step(f"joining {request.address} as node {request.node!r}"):
        return join(
            request.address,
            spec,
            request.node,
            node_ip=request.node_ip,
            object_store_mb=request.object_store_mb,
            num_cpus=request.num_cpus,
        )


def join_dir() -> Path:
    """Where ``cluster join`` records the nodes it started on this machine."""
    return default_join_dir()


def cluster_leave(node: str | None = None) -> list[tuple[JoinedNode, int]]:
    """Stop the node(s) ``cluster_join`` started on this machine (only their processes):
    each with how many of its processes were running; empty when none had joined."""
    return leave(node)
