"""``GET /metrics``: the service's metrics in Prometheus' text format."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Response

from pipeplan.service.api.auth import ApiAuth
from pipeplan.service.api.deps import MetricsDep, StoreDep
from pipeplan.service.api.metrics import CONTENT_TYPE, JobProgressCollector, progress_window
from pipeplan.service.api.schemas import error_responses

router = APIRouter(tags=["metrics"], responses=error_responses(401, 403))


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
)
def metrics(_: ApiAuth, registry: MetricsDep, store: StoreDep) -> Response:
    """HTTP requests by route and status with latency, jobs by state and kind, events
    ingested by type, and the best value and evaluation count of each recent or running
    job (a training job's steps, last loss and samples per second)."""
    progress = JobProgressCollector(partial(progress_window, store))
    return Response(registry.render(progress), media_type=CONTENT_TYPE)
