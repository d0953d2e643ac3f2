"""``POST /v1/simulate``: the cost model's estimate of one plan, synchronously."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from pipeplan.service.api.auth import ApiAuth
from pipeplan.service.api.schemas import error_responses
from pipeplan.service.api.validation import validate_simulate
from pipeplan.service.tasks.simulate import SimulateRequest, simulate

router = APIRouter(
    prefix="/v1", tags=["simulate"], responses=error_responses(400, 401, 403, 413, 422)
)


@router.post("/simulate")
def simulate_plan(request: SimulateRequest, _: ApiAuth) -> dict[str, Any]:
    """The estimate (``pipeplan simulate --json``) of ``plan`` (or a ``uniform`` plan) for
    ``profile`` on ``cluster``; the limits are checked before the cost model runs."""
    validate_simulate(request)
    doc: dict[str, Any] = simulate(request).to_dict()
    return doc
