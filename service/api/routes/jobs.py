"""``/v1/jobs``: submit a job, list jobs, read one (waiting for its end if asked), cancel
it, read its log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import APIRouter, Body, HTTPException, Path, Query, Response, status
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from pipeplan.service.api.auth import (
    ApiAuth,
    JobAuth,
    JobUserAuth,
    SubmitAuth,
    hash_token,
    new_job_token,
)
from pipeplan.service.api.backend import JobsBackend
from pipeplan.service.api.calibration import calibrated_job
from pipeplan.service.api.deps import BackendDep, SettingsDep, StoreDep
from pipeplan.service.api.free_devices import narrowed
from pipeplan.service.api.queue import dispatch, held
from pipeplan.service.api.retries import search_spec
from pipeplan.service.api.schemas import (
    JOB_ID_PATTERN,
    Job,
    JobCreate,
    JobKind,
    JobPage,
    JobRequest,
    JobState,
    error_responses,
    job_create,
)
from pipeplan.service.api.store import Store, new_job_id
from pipeplan.service.api.training import train_spec
from pipeplan.service.api.validation import validate_job

MAX_PAGE = 1000
MAX_WAIT_S = 60.0
"""The longest ``GET /v1/jobs/{id}?wait=S`` holds the request open."""
JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="The job's id")]

_DIGIT_PAIR = "(?:M[DTjz]|N[DTjz]|O[DT])"
_DIGIT_LAST = "(?:M[AQgw]|N[AQgw]|O[AQ])"
_MID, _END = "[AEIMQUYcgk]", "[w-z0-5]"
CURSOR_PATTERN = (
    f"^(?:aj(?:{_MID}|{_MID}{_END}(?:{_DIGIT_PAIR}{_MID}{_END}){{0,5}}"
    f"(?:{_DIGIT_LAST}|{_DIGIT_PAIR}{_MID})?))?$"
)
"""The cursors the store issues: ``j`` and the last job's number (1 to 19 digits) in
unpadded URL-safe base64. Written out character by character (three bytes make four
characters), so that the document admits exactly the cursors the service reads. Empty, as
absent: the first page."""

OTHER_METHODS = ("OPTIONS", "PUT", "PATCH", "DELETE", "TRACE")
"""Methods no route of the API takes."""

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 403, 422))


def refuse_other_methods(target: APIRouter, path: str, allowed: Iterable[str]) -> None:
    """Answer 405 to any method but ``allowed`` on ``path``, with an ``Allow`` header that
    names all of them. Starlette's own 405 names only the methods of the first route that
    matched the path, so on a path with a route per method it leaves the others out."""
    allow = ", ".join(sorted(allowed))
    methods = [m for m in OTHER_METHODS if m not in allow.split(", ")]

    def method_not_allowed() -> Response:
        body = b'{"detail":"Method Not Allowed"}'
        headers = {"Allow": allow}
        return Response(body, status.HTTP_405_METHOD_NOT_ALLOWED, headers, "application/json")

    target.add_api_route(path, method_not_allowed, methods=methods, include_in_schema=False)


JOB_EXAMPLES: dict[str, Any] = {
    "plan": {
        "summary": "Plan AlexNet on a preset with dynamic programming",
        "value": {
            "kind": "plan",
            "name": "first",
            "spec": {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"},
        },
    },
    "compare": {
        "summary": "Compare planners on GPT for the cheapest plan at 500 samples/s",
        "value": {
            "kind": "compare",
            "spec": {
                "cluster": "cloud-mix",
                "model": "gpt",
                "objective": "cost",
                "min_throughput": 500,
                "planners": ["dp", "greedy"],
            },
        },
    },
    "profile": {
        "summary": "Profile ResNet-50 with the cost model",
        "value": {"kind": "profile", "spec": {"model": "resnet50"}},
    },
}
"""Requests of ``POST /v1/jobs`` the service takes, shown in the document (and tried by
schemathesis)."""


JOB_LINKS: dict[str, Any] = {
    name: {
        "operationId": operation,
        "parameters": {"job_id": "$response.body#/id"},
        "description": f"The created job's `id` is `job_id` of `{operation}`.",
    }
    for name, operation in (
        ("GetJob", "get_job"),
        ("CancelJob", "cancel_job"),
        ("JobLogs", "job_logs"),
        ("JobEvents", "list_events"),
    )
}
"""OpenAPI links from a created job to the operations on it (clients and schemathesis
follow them)."""


def submit(
    create: JobCreate,
    store: Store,
    backend: JobsBackend,
    server_url: str,
    job_id: str | None = None,
    created_by: str | None = None,
) -> Job:
    """Store the job (queued; ``job_id``: its id, drawn before; ``created_by``: the
    submitting token's id), then start it in its turn (:mod:`service.api.queue`): at once,
    unless it needs devices and a device job before it in start order is still queued."""
    job = store.create_job(
        create.kind,
        create.spec,
        create.name,
        hash_token(new_job_token()),  # replaced when it starts: no one holds this one
        job_id,
        created_by,
        create.priority,
        create.deadline_s,
        create.retries,
    )
    dispatch(store, backend, server_url)
    return store.get_job(job.id)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    operation_id="create_job",
    responses={
        201: {"description": "The job, queued", "links": JOB_LINKS},
        **error_responses(400, 413, 429),
    },
)
def create_job(
    request: Annotated[JobRequest, Body(openapi_examples=JOB_EXAMPLES)],
    who: SubmitAuth,
    store: StoreDep,
    backend: BackendDep,
    settings: SettingsDep,
) -> Job:
    """Validate the spec completely, store the job and submit it (API.md, "Jobs"). Its
    ``cluster`` becomes the calibrated spec where the service has a calibration for it that
    applies, unless ``calibration`` is false (:mod:`service.api.calibration`). A train
    job's checkpoint folders are resolved first (:mod:`service.api.training`), a spec
    with ``devices: free`` is narrowed to the devices free now
    (:mod:`service.api.free_devices`), and a learned search's checkpoint folder is the
    job's own unless it names one (:mod:`service.api.retries`; before the checks, which
    then see the options the search runs with)."""
    create = job_create(request)
    job_id = new_job_id()
    if create.kind is JobKind.PLAN:
        spec = search_spec(create.spec, job_id, settings.jobs_root)
        create = create.model_copy(update={"spec": spec})
    validate_job(create, allow_code=settings.allow_code)
    create = create.model_copy(update={"spec": narrowed(create.spec, backend)})
    if create.kind is JobKind.TRAIN:
        spec = train_spec(create.spec, job_id, store, settings.jobs_root)
        create = create.model_copy(update={"spec": spec})
    return submit(
        calibrated_job(create, store), store, backend, settings.public_url, job_id, who.token_id
    )


@router.get("", operation_id="list_jobs")
def list_jobs(
    who: ApiAuth,
    store: StoreDep,
    state: JobState | None = None,
    kind: JobKind | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    cursor: Annotated[
        str, Query(pattern=CURSOR_PATTERN, description="`next` of the page before")
    ] = "",
) -> JobPage:
    """Newest first; ``next`` is the cursor of the following page (null: the last). A
    submitter's token lists its own jobs only."""
    page = store.list_jobs(state, kind, limit, cursor or None, who.owned())
    return JobPage(items=page.jobs, next=page.next)


refuse_other_methods(router, "", ("GET", "POST"))


@router.get("/{job_id}", operation_id="get_job", responses=error_responses(404))
async def get_job(
    job_id: JobId,
    _: JobAuth,
    store: StoreDep,
    settings: SettingsDep,
    wait: Annotated[
        float,
        Query(
            ge=0,
            le=MAX_WAIT_S,
            description="Seconds to wait for the job to end before answering (long poll)",
        ),
    ] = 0,
) -> Job:
    """The job (its own token may read it too). With ``wait``, the answer comes as soon as
    the job is terminal, or after ``wait`` seconds with the job as it is then."""
    return await wait_for_end(store, job_id, wait, settings.sse_poll_s)


async def wait_for_end(store: Store, job_id: str, wait_s: float, poll_s: float) -> Job:
    """The job once it is terminal, or as it is after ``wait_s`` seconds. It reads the
    store every ``poll_s`` seconds, as the live event stream does, and sleeps on the event
    loop in between: a waiting request holds no worker thread."""
    deadline = time.monotonic() + wait_s
    job = await run_in_threadpool(store.get_job, job_id)
    while not job.state.terminal and (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(poll_s, left))
        job = await run_in_threadpool(store.get_job, job_id)
    return job


@router.post(
    "/{job_id}/cancel", operation_id="cancel_job", responses=error_responses(404, 409, 502)
)
def cancel_job(job_id: JobId, _: JobUserAuth, store: StoreDep, backend: BackendDep) -> Job:
    """Stop the job's work and end it ``cancelled``; 409 when it had ended. A job the
    queue held back never starts."""
    job = store.get_job(job_id)
    if job.state.terminal:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id!r} is {job.state.value}")
    try:
        if not held(job):
            backend.stop(job_id)
    except Exception as e:  # the backend's failure, named; the job is left as it was
        raise HTTPException(
            status.HTTP_502_BAD_GATEWAY, f"backend: cannot stop job {job_id!r}: {e}"
        ) from None
    return store.finish(job_id, JobState.CANCELLED)


@router.get(
    "/{job_id}/logs",
    operation_id="job_logs",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses(404, 502),
    },
)
def job_logs(job_id: JobId, _: JobUserAuth, store: StoreDep, backend: BackendDep) -> str:
    """The log text of the job's work ("" before it has any)."""
    store.get_job(job_id)
    try:
        return backend.logs(job_id)
    except Exception as e:  # the backend's failure, named
        raise HTTPException(
            status.HTTP_502_BAD_GATEWAY, f"backend: no log for job {job_id!r}: {e}"
        ) from None
