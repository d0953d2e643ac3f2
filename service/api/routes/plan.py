"""``POST /v1/plan``: a small cost-model plan, answered synchronously within a time limit.

The body is a ``plan`` job's spec plus ``timeout_s``. It is validated as ``POST /v1/jobs``
validates a plan job's spec, and must be one the planner pool runs (rewards from the cost
model, a planner that needs no Ray, no code named): a search on devices is a job. The
search runs on a pool worker, through the same use-case as the job, and the answer is the
document a plan job's ``result`` holds. Nothing is stored and no event is sent.

The limit counts from the request's arrival, waiting for a worker included. Past it the
answer is 422 naming ``timeout_s``, and a search still running has its worker killed and
replaced, so no request ties up a worker beyond its limit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, status
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from pipeplan.executor.worker_calls import WorkerLost
from pipeplan.service.api.auth import ApiAuth
from pipeplan.service.api.deps import PoolDep, SettingsDep
from pipeplan.service.api.pool import PLAN_TARGET, PlannerPool, PoolClosed, PoolTimeout
from pipeplan.service.api.pool.routing import runs_in_pool
from pipeplan.service.api.schemas import JobCreate, JobKind, error_responses
from pipeplan.service.api.validation import validate_job
from pipeplan.service.tasks.requests import PlanRequest, RequestError

MAX_TIMEOUT_S = 60.0
"""The longest limit a request may ask for: a longer search is a job."""
DEFAULT_TIMEOUT_S = 10.0
GRACE_S = 1.0
"""How much longer than ``timeout_s`` the route waits for the pool's own verdict."""

router = APIRouter(prefix="/v1", tags=["plan"], responses=error_responses(400, 401, 403, 413, 422))


class PlanNow(PlanRequest):
    """A ``plan`` job's spec, and how long the service may take to answer it."""

    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S)
    """Seconds from the request's arrival to the answer (waiting for a worker included)."""


def plan_spec(body: PlanNow, allow_code: bool) -> dict[str, Any]:
    """The body as a plan job's spec, validated as ``POST /v1/jobs`` does; a spec that the
    pool would not run is refused naming the field that sends it to the devices."""
    spec = body.model_dump(mode="json", exclude={"timeout_s"}, exclude_unset=True)
    validate_job(JobCreate.model_validate({"kind": "plan", "spec": spec}), allow_code=allow_code)
    if not runs_in_pool(JobKind.PLAN, spec):
        if ":" in (body.model or "") or body.example is not None:
            field = "model" if ":" in (body.model or "") else "example"
        else:
            field = "reward" if body.reward.value != "simulated" else "planner"
        raise RequestError(
            f"{field}: this plan needs a Ray cluster or code of its own, not the cost model in "
            "a planner worker; submit it as a job (POST /v1/jobs)"
        )
    return spec


async def run_plan(pool: PlannerPool, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """The plan document of ``spec`` from a pool worker, within ``timeout_s``."""
    try:
        future = pool.call(PLAN_TARGET, (spec,), timeout_s)
    except PoolClosed as e:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(e)) from None
    try:
        outcome = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s + GRACE_S)
    except (PoolTimeout, TimeoutError):
        future.cancel()  # withdrawn if it still waits; a running one is past its own limit
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"timeout_s: the plan was not found within the limit of {timeout_s:g} s; allow "
            f"more (at most {MAX_TIMEOUT_S:g}), give a smaller budget, or submit a plan job",
        ) from None
    except (WorkerLost, PoolClosed) as e:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"planner pool: {e}") from None
    if not outcome.ok:
        raise RequestError(outcome.error or "the plan failed")
    doc: dict[str, Any] = outcome.value
    return doc


@router.post("/plan", responses=error_responses(503))
async def plan_now(
    body: PlanNow, _: ApiAuth, pool: PoolDep, settings: SettingsDep
) -> dict[str, Any]:
    """The plan (``pipeplan plan --json``, a plan job's ``result``) of a small cost-model
    search, within ``timeout_s``; 422 naming ``timeout_s`` past it, 503 without a pool."""
    if pool is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "planner pool: off (pool_size 0, PIPEPLAN_POOL_SIZE); submit a plan job instead",
        )
    spec = await run_in_threadpool(plan_spec, body, settings.allow_code)
    return await run_plan(pool, spec, body.timeout_s)
