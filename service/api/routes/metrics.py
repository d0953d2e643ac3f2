"""``GET /metrics``: the service's metrics in Prometheus' text format."""

from __future__ import annotations

from fastapi import APIRouter, Response

from service.api.auth import ApiAuth
from service.api.deps import MetricsDep
from service.api.metrics import CONTENT_TYPE
from service.api.schemas import error_responses

router = APIRouter(tags=["metrics"], responses=error_responses(401, 403))


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
)
def metrics(_: ApiAuth, registry: MetricsDep) -> Response:
    """HTTP requests by route and status with latency, jobs by state and kind, events
    ingested by type."""
    return Response(registry.render(), media_type=CONTENT_TYPE)
