"""Which backend runs a job: the planner pool for cost-model work, Ray Jobs for the rest.

:func:`runs_in_pool` reads the job's kind and spec: a ``plan`` whose rewards come from the
cost model in the worker (``reward: simulated``, a planner that needs no Ray), a ``compare``
of such planners, and a ``profile`` without ``measure`` need no device, so they run in the
pool. Runs, training, measured searches and profiles, and every search that uses Ray's
workers stay Ray Jobs, on the devices they reserve. So does a job whose ``model`` or
``example`` names code: code is only ever imported inside the job's own Ray Job, never in a
worker that later serves other jobs.

:class:`RoutingBackend` is the :class:`~service.api.backend.JobsBackend` the routes see. A
pool job's backend id (the job's ``ray_job_id``) is empty, :data:`POOL_JOB_ID`: there is no
Ray Job to link to, and a service started later can tell that the job ran in a pool.

**After a restart.** A pool lives and dies with the service process that started it, so a
pool job that had not ended when that process stopped was lost with it. The new service
cannot run it again: the job's token, which its work needs to fetch the spec and post
events, is kept only as a hash. The reconcile on start therefore ends such a job
``failed``, at once and saying why (:data:`LOST_MESSAGE`); a pool job is cheap to submit
again. A Ray Job, by contrast, outlives the service, and is reconciled with Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from pipeplan.agents.registry import planner_class
from pipeplan.core.errors import PipeplanError
from pipeplan.core.model_refs import names_code
from pipeplan.service.api.backend import (
    BackendState,
    BackendStatus,
    ClusterSource,
    ClusterState,
    JobsBackend,
    Submission,
)
from pipeplan.service.api.pool.planner_pool import PlannerPool
from pipeplan.service.api.schemas import Job, JobKind
from pipeplan.service.tasks.requests import (
    CompareRequest,
    PlanRequest,
    ProfileRequest,
    planner_names,
    uses_ray,
)

log = logging.getLogger("pipeplan.service.pool")

POOL_JOB_ID = ""
"""The backend id of a job the pool runs (no Ray Job)."""
LOST_MESSAGE = (
    "lost: it ran in the planner pool of a service process that has stopped (its workers "
    "end with it); submit it again"
)
POOL_KINDS: dict[JobKind, type[BaseModel]] = {
    JobKind.PLAN: PlanRequest,
    JobKind.COMPARE: CompareRequest,
    JobKind.PROFILE: ProfileRequest,
}
"""The kinds that may run in the pool, and the request their spec is."""
CODE_FIELDS = ("model", "example")


def _needs_devices(request: BaseModel) -> bool:
    if isinstance(request, PlanRequest):
        return uses_ray(request)
    if isinstance(request, CompareRequest):
        return any(planner_class(n).needs_ray for n in planner_names(request.planners))
    if isinstance(request, ProfileRequest):
        return request.measure
    return True


def needs_devices(kind: JobKind, spec: dict[str, Any]) -> bool:
    """Whether a job of ``kind`` and ``spec`` runs on the cluster's devices (``run``,
    ``train``, a measured profile or search); a spec that does not read as its request
    counts as one that does."""
    model = POOL_KINDS.get(kind)
    if model is None:
        return True
    try:
        return _needs_devices(model.model_validate(spec))
    except (ValidationError, PipeplanError):
        return True


def runs_in_pool(kind: JobKind, spec: dict[str, Any]) -> bool:
    """Whether a job of ``kind`` and ``spec`` runs in the planner pool (module docstring).
    A spec that does not read as its request goes to a Ray Job, which reports why."""
    model = POOL_KINDS.get(kind)
    if model is None:
        return False
    try:
        request = model.model_validate(spec)
        if any(
            isinstance(v := getattr(request, f, None), str) and names_code(v) for f in CODE_FIELDS
        ):
            return False
        return not _needs_devices(request)
    except (ValidationError, PipeplanError):
        return False


class RoutingBackend:
    """Jobs to ``pool`` or to ``ray_jobs`` by :func:`runs_in_pool`; ``jobs`` reads a job
    (kind, spec, ``ray_job_id``) from the service's store."""

    def __init__(
        self, ray_jobs: JobsBackend, pool: PlannerPool, jobs: Callable[[str], Job]
    ) -> None:
        self.ray_jobs, self.pool, self.jobs = ray_jobs, pool, jobs

    def submit(self, submission: Submission) -> str:
        job = self.jobs(submission.job_id)
        if runs_in_pool(job.kind, job.spec):
            self.pool.submit(submission)
            return POOL_JOB_ID
        return self.ray_jobs.submit(submission)

    def _lost_in_pool(self, job_id: str) -> bool:
        """A job that ran in a pool this one does not know (a pool of an earlier process)."""
        if self.pool.knows(job_id):
            return False
        try:
            return self.jobs(job_id).ray_job_id == POOL_JOB_ID
        except Exception:  # no such job: not ours to say
            return False

    def stop(self, job_id: str) -> None:
        if self.pool.knows(job_id):
            self.pool.stop(job_id)
        elif not self._lost_in_pool(job_id):
            self.ray_jobs.stop(job_id)

    def status(self, job_id: str) -> BackendStatus:
        found = self.pool.status(job_id)
        if found is not None:
            return found
        if self._lost_in_pool(job_id):
            return BackendStatus(BackendState.FAILED, LOST_MESSAGE)
        return self.ray_jobs.status(job_id)

    def logs(self, job_id: str) -> str:
        found = self.pool.logs(job_id)
        if found is not None:
            return found
        if self._lost_in_pool(job_id):
            return ""
        return self.ray_jobs.logs(job_id)

    def ready(self) -> str | None:
        return self.ray_jobs.ready() or self.pool.ready()


class RoutingClusterBackend(RoutingBackend):
    """A :class:`RoutingBackend` whose Ray Jobs backend can describe its cluster."""

    ray_jobs: Any

    def cluster_state(self) -> ClusterState:
        state: ClusterState = self.ray_jobs.cluster_state()
        return state

    def dashboard_url(self) -> str | None:
        url: str | None = self.ray_jobs.dashboard_url()
        return url


def route_jobs(
    ray_jobs: JobsBackend, pool: PlannerPool, jobs: Callable[[str], Job]
) -> RoutingBackend:
    """The routing backend over ``ray_jobs`` and ``pool``; one that describes the cluster
    (the dashboard's cluster page) when ``ray_jobs`` does."""
    if isinstance(ray_jobs, ClusterSource):
        return RoutingClusterBackend(ray_jobs, pool, jobs)
    return RoutingBackend(ray_jobs, pool, jobs)
