"""The planner pool: long-lived workers on the cluster for the jobs that need no devices.

:class:`PlannerPool` keeps a few workers warm (torch, the planners and the use-cases imported
once) and runs jobs on them through the same entrypoint a Ray Job runs
(:func:`service.cli.job.run_in_process`). :class:`RoutingBackend` sends each job where it
belongs (:func:`runs_in_pool`): cost-model work to the pool, work on devices to Ray Jobs.
"""

from pipeplan.service.api.pool.planner_pool import (
    JOB_TARGET,
    PLAN_TARGET,
    PROFILE_TARGET,
    WARM_MODULES,
    PlannerPool,
    PoolClosed,
    PoolTimeout,
    Worker,
    Workers,
)
from pipeplan.service.api.pool.routing import (
    LOST_MESSAGE,
    POOL_JOB_ID,
    RoutingBackend,
    route_jobs,
    runs_in_pool,
)

__all__ = [
    "JOB_TARGET",
    "LOST_MESSAGE",
    "PLAN_TARGET",
    "PROFILE_TARGET",
    "POOL_JOB_ID",
    "WARM_MODULES",
    "PlannerPool",
    "PoolClosed",
    "PoolTimeout",
    "RoutingBackend",
    "Worker",
    "Workers",
    "route_jobs",
    "runs_in_pool",
]
