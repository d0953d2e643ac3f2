"""``GET /v1/queue``: the queued jobs in start order (:mod:`service.api.queue`)."""

from __future__ import annotations

from fastapi import APIRouter

from pipeplan.service.api.auth import ApiAuth
from pipeplan.service.api.deps import StoreDep
from pipeplan.service.api.queue import start_order
from pipeplan.service.api.schemas import Job, error_responses

router = APIRouter(prefix="/v1/queue", tags=["jobs"], responses=error_responses(401, 403))


@router.get("")
def list_queue(who: ApiAuth, store: StoreDep) -> list[Job]:
    """Every queued job in start order: those handed to the backend already, then the held
    ones by ``priority`` (higher first), then age. Each
    says in ``waiting_for`` what it waits for (its devices, or the jobs before it). A
    submitter's token lists its own jobs only."""
    return [j for j in start_order(store.queued_jobs()) if who.may_see(j.created_by)]
