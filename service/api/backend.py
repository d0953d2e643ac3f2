"""Where a job's work runs: the :class:`JobsBackend` protocol the routes talk to.

The service stores a job, then hands it to the backend: Ray's Jobs API in production
(:mod:`service.api.ray_jobs`), behind the router that sends cost-model jobs to the planner
pool (:mod:`service.api.pool`), and a fake in the API's unit tests. The pipeplan job id is the
backend's submission id of its first attempt, so a retried submission cannot start a job
twice; a job handed over again after its work was lost (``retries``) gets one id per attempt
(:func:`attempt_id`) and posts its events from a seq of its own (:func:`first_seq`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable


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


SEQS_PER_ATTEMPT = 2**32
"""Event seqs each attempt of a job has to itself: attempt ``a`` > 1 posts from
:func:`first_seq` on, after the service's ``attempt`` event at ``first_seq(a) - 1``, so that
no event of a retry repeats a seq of the attempt before it (a repeated seq is dropped)."""


def attempt_id(job_id: str, attempt: int) -> str:
    """The backend's submission id of a job's ``attempt``: the job id for the first, then
    ``JOBID-a2``, ``JOBID-a3`` ... (Ray keeps a submission id for good: a retry needs its
    own)."""
    if attempt < 1:
        raise ValueError(f"attempt: must be >= 1, got {attempt}")
    return job_id if attempt == 1 else f"{job_id}-a{attempt}"


def first_seq(attempt: int) -> int:
    """The first seq the job's work posts in its ``attempt`` (:data:`SEQS_PER_ATTEMPT`)."""
    if attempt < 1:
        raise ValueError(f"attempt: must be >= 1, got {attempt}")
    return 0 if attempt == 1 else (attempt - 1) * SEQS_PER_ATTEMPT + 1


@dataclass(frozen=True)
class Submission:
    """What the backend runs for one job: the pipeplan job entrypoint, told where the
    service is and given the job's own token (never the API token); ``attempt``: which
    hand-over of the job this is (:func:`attempt_id` names it to the backend)."""

    job_id: str
    server_url: str
    job_token: str
    attempt: int = 1

    @property
    def submission_id(self) -> str:
        return attempt_id(self.job_id, self.attempt)


class JobsBackend(Protocol):
    """What the routes, the queue and the reconcile ask of the backend. ``job_id`` is the
    pipeplan job id; a backend whose submissions carry their own ids (the Ray Jobs backend,
    one per attempt) is wrapped in :class:`AttemptsBackend`, which reads the current one
    from the store."""

    def submit(self, submission: Submission) -> str:
        """Start the job's entrypoint; returns the Ray job id (``submission.submission_id``;
        ``""`` where the work is not a Ray Job, e.g. in the planner pool). Submitting an id
        that exists already starts nothing."""
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


class AttemptsBackend:
    """``inner``, keyed by submission id, seen by job id: :meth:`stop`, :meth:`status` and
    :meth:`logs` of a job go to the submission of its current attempt (its ``ray_job_id``,
    read through ``jobs``: ``JOBID``, then ``JOBID-a2`` ... after a retry). A job the store
    does not know, or one not handed over yet, is asked for by its own id."""

    def __init__(self, inner: JobsBackend, jobs: Callable[[str], Any]) -> None:
        self.inner, self.jobs = inner, jobs

    def current(self, job_id: str) -> str:
        """The submission id of the job's current attempt."""
        try:
            ray_job_id = self.jobs(job_id).ray_job_id
        except Exception:  # no such job (or the store cannot say): its own id
            return job_id
        return ray_job_id or job_id

    def submit(self, submission: Submission) -> str:
        return self.inner.submit(submission)

    def stop(self, job_id: str) -> None:
        self.inner.stop(self.current(job_id))

    def status(self, job_id: str) -> BackendStatus:
        return self.inner.status(self.current(job_id))

    def logs(self, job_id: str) -> str:
        return self.inner.logs(self.current(job_id))

    def ready(self) -> str | None:
        return self.inner.ready()


class AttemptsClusterBackend(AttemptsBackend):
    """An :class:`AttemptsBackend` whose backend can describe its cluster."""

    inner: Any

    def cluster_state(self) -> ClusterState:
        state: ClusterState = self.inner.cluster_state()
        return state

    def dashboard_url(self) -> str | None:
        url: str | None = self.inner.dashboard_url()
        return url


def by_attempts(inner: JobsBackend, jobs: Callable[[str], Any]) -> AttemptsBackend:
    """``inner`` seen by job id (:class:`AttemptsBackend`); one that describes the cluster
    when ``inner`` does."""
    if isinstance(inner, ClusterSource):
        return AttemptsClusterBackend(inner, jobs)
    return AttemptsBackend(inner, jobs)
