"""Where a job's work runs: the :class:`JobsBackend` protocol the routes talk to.

The service stores a job, then hands it to the backend: Ray's Jobs API in production
(:mod:`service.api.ray_jobs`), behind the router that sends cost-model jobs to the planner
pool (:mod:`service.api.pool`), and a fake in the API's unit tests. The pipeplan job id is the
backend's submission id, so a retried submission cannot start a job twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable


class BackendState(StrEnum):
    """What the backend knows of a submitted job (Ray's ``JobStatus``, spelled as ours)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    UNKNOWN = "unknown"  # the backend has no job of that id

    @property
    def finished(self) -> bool:
        return self in (BackendState.SUCCEEDED, BackendState.FAILED, BackendState.STOPPED)


@dataclass(frozen=True)
class BackendStatus:
    state: BackendState
    message: str = ""


@dataclass(frozen=True)
class Submission:
    """What the backend runs for one job: the pipeplan job entrypoint, told where the
    service is and given the job's own token (never the API token)."""

    job_id: str
    server_url: str
    job_token: str


class JobsBackend(Protocol):
    def submit(self, submission: Submission) -> str:
        """Start the job's entrypoint; returns the Ray job id (= ``job_id``; ``""`` where
        the work is not a Ray Job, e.g. in the planner pool). Submitting an id that exists
        already starts nothing."""
        ...

    def stop(self, job_id: str) -> None:
        """Stop the job (no error if it has finished)."""
        ...

    def status(self, job_id: str) -> BackendStatus: ...

    def logs(self, job_id: str) -> str:
        """The job's log text ("" when there is none yet)."""
        ...

    def ready(self) -> str | None:
        """None when the backend answers, else why not (for ``/readyz``)."""
        ...


@dataclass(frozen=True)
class NodeState:
    """One node of the cluster the jobs run on, as Ray sees it: its pipeplan name (the
    ``pipeplan_node:NAME`` marker, else ``node-<id prefix>``), Ray's node id, whether it is
    alive, and its ``device:TYPE`` resources: how many it has and how many are in use
    (``None``: Ray did not say)."""

    name: str
    node_id: str
    alive: bool
    address: str = ""
    head: bool = False
    devices: Mapping[str, float] = field(default_factory=dict)
    devices_in_use: Mapping[str, float] | None = None
    cpus: float = 0.0
    cpus_in_use: float | None = None


@dataclass(frozen=True)
class ClusterState:
    """What the backend can tell of its cluster for the dashboard: the nodes (empty when
    there is no live cluster), and why it could not tell (``error``)."""

    nodes: tuple[NodeState, ...] = ()
    error: str | None = None


@runtime_checkable
class ClusterSource(Protocol):
    """A backend that can describe its cluster (the Ray Jobs backend does; a backend that
    is not one, a test's or a benchmark's, shows no live cluster on the dashboard)."""

    def cluster_state(self) -> ClusterState:
        """The nodes and their devices now; never raises (a failure is ``error``)."""
        ...

    def dashboard_url(self) -> str | None:
        """The Ray dashboard's URL (for links), known without asking the cluster."""
        ...
