"""``/healthz`` (the process is up; no auth) and ``/readyz`` (the database and the backend
answer; 503 naming which does not)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from pipeplan.service.api.auth import ApiAuth
from pipeplan.service.api.deps import BackendDep, StoreDep
from pipeplan.service.api.schemas import Health, error_responses

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> Health:
    """200 while the process is up."""
    return Health(status="ok")


@router.get("/readyz", responses=error_responses(401, 403, 503))
def readyz(_: ApiAuth, store: StoreDep, backend: BackendDep) -> Health:
    """200 when the database and the Ray cluster answer, else 503 naming which."""
    problems = {"database": store.ping(), "backend": backend.ready()}
    down = [f"{part}: {why}" for part, why in problems.items() if why is not None]
    if down:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "not ready: " + "; ".join(down))
    return Health(status="ready", database="ok", backend="ok")
