"""``/v1/jobs/{id}/events``: a job's events, as a list or a live stream, and the control
endpoint the job posts them to (with its own token)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Body, Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from pipeplan.service.api.auth import JobAuth, JobUserAuth
from pipeplan.service.api.calibration import parse_observations
from pipeplan.service.api.deps import CalibratorDep, MetricsDep, SettingsDep, StoreDep
from pipeplan.service.api.routes.jobs import JobId, refuse_other_methods
from pipeplan.service.api.schemas import SEQ_MAX, Event, EventAck, EventPost, error_responses
from pipeplan.service.api.store import Store
from pipeplan.service.api.validation import check_event_data

MAX_EVENTS = 10_000
STREAM = "text/event-stream"

router = APIRouter(
    prefix="/v1/jobs/{job_id}/events",
    tags=["events"],
    responses=error_responses(401, 403, 404, 422),
)


def sse(event: Event) -> str:
    """One server-sent event: ``id`` the seq, ``event`` the type, ``data`` the event."""
    return f"id: {event.seq}\nevent: {event.type.value}\ndata: {event.model_dump_json()}\n\n"


async def stream(
    request: Request, store: Store, job_id: str, after: int, poll_s: float
) -> AsyncIterator[str]:
    """The job's events after ``after`` as they arrive; ends (``event: end``) once the job
    is terminal and every event has been sent."""
    while not await request.is_disconnected():
        job = await run_in_threadpool(store.get_job, job_id)
        events = await run_in_threadpool(store.events_after, job_id, after, 1000)
        for event in events:
            yield sse(event)
            after = event.seq
        if not events and job.state.terminal:
            yield f"event: end\ndata: {json.dumps({'state': job.state.value})}\n\n"
            return
        if not events:
            yield ": waiting\n\n"
            await asyncio.sleep(poll_s)


@router.get(
    "",
    operation_id="list_events",
    response_model=list[Event],
    responses={200: {"content": {STREAM: {"schema": {"type": "string"}}}}},
)
def list_events(
    job_id: JobId,
    request: Request,
    _: JobUserAuth,
    store: StoreDep,
    settings: SettingsDep,
    after: Annotated[int, Query(ge=-1, le=SEQ_MAX)] = -1,
    limit: Annotated[int, Query(ge=1, le=MAX_EVENTS)] = MAX_EVENTS,
    last_event_id: Annotated[int, Header(ge=-1, le=SEQ_MAX)] = -1,
) -> list[Event] | StreamingResponse:
    """The events after seq ``after``, oldest first; with ``Accept: text/event-stream`` a
    live stream (resumed after ``Last-Event-ID``) that ends when the job does."""
    store.get_job(job_id)
    if STREAM in request.headers.get("accept", ""):
        start = max(after, last_event_id)
        body = stream(request, store, job_id, start, settings.sse_poll_s)
        return StreamingResponse(body, media_type=STREAM, headers={"Cache-Control": "no-cache"})
    return store.events_after(job_id, after, limit)


@router.post("", operation_id="post_events", responses=error_responses(400, 409, 413))
def post_event(
    job_id: JobId,
    posted: Annotated[EventPost, Body()],
    _: JobAuth,
    store: StoreDep,
    metrics: MetricsDep,
    calibrator: CalibratorDep,
) -> EventAck | list[EventAck]:
    """The control endpoint: store each event once (a repeated seq is acknowledged with
    ``stored: false``); ``result`` and ``error`` end the job; 409 once it has ended.

    The body is one event, or a batch of up to ``MAX_BATCH`` events (a JSON array; each seq
    once, an ending event last), stored in one transaction and answered with one
    acknowledgement per event, in order: a job whose search outruns the network sends what
    has queued in one request.

    Each event's ``data`` is checked as its type's model (the document states them), and
    a measured plan's ``observation`` (in an ``evaluation`` event), before anything is
    stored (422 naming the field); the observation is stored with its event, and its
    cluster's calibration refitted in the background (:mod:`service.api.calibration`)."""
    batch = posted if isinstance(posted, list) else [posted]
    check_event_data(batch, isinstance(posted, list))
    observations = parse_observations(batch, store)
    stored = store.add_events(job_id, batch, observations)
    new_seqs = {e.seq for e, new in zip(batch, stored, strict=True) if new}
    calibrator.observed({o.key for seq, o in observations.items() if seq in new_seqs})
    for event, new in zip(batch, stored, strict=True):
        if new:
            metrics.events.labels(event.type.value).inc()
    acks = [EventAck(seq=e.seq, stored=new) for e, new in zip(batch, stored, strict=True)]
    return acks if isinstance(posted, list) else acks[0]


refuse_other_methods(router, "", ("GET", "POST"))
