"""``/v1/jobs``: submit a job, list jobs, read one, cancel it, read its log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, status
from fastapi.responses import PlainTextResponse

from pipeplan.service.api.auth import (
    ApiAuth,
    JobAuth,
    JobUserAuth,
    SubmitAuth,
    hash_token,
    new_job_token,
)
from pipeplan.service.api.backend import JobsBackend, Submission
from pipeplan.service.api.calibration import calibrated_job
from pipeplan.service.api.deps import BackendDep, SettingsDep, StoreDep
from pipeplan.service.api.schemas import Job, JobCreate, JobKind, JobPage, JobState, error_responses
from pipeplan.service.api.store import Store, new_job_id
from pipeplan.service.api.training import train_spec
from pipeplan.service.api.validation import validate_job

MAX_PAGE = 1000
JOB_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="The job's id")]

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 403, 422))


def submit(
    create: JobCreate,
    store: Store,
    backend: JobsBackend,
    server_url: str,
    job_id: str | None = None,
    created_by: str | None = None,
) -> Job:
    """Store the job (queued, with a token of its own; ``job_id``: its id, drawn before;
    ``created_by``: the submitting token's id), then hand it to the backend; a backend that
    refuses it ends it ``failed`` with the reason."""
    token = new_job_token()
    job = store.create_job(
        create.kind, create.spec, create.name, hash_token(token), job_id, created_by
    )
    try:
        ray_job_id = backend.submit(Submission(job.id, server_url, token))
    except Exception as e:  # whatever the backend raises, the job fails with its reason
        return store.finish(job.id, JobState.FAILED, error=f"submit: {type(e).__name__}: {e}")
    store.set_ray_job_id(job.id, ray_job_id)
    return store.get_job(job.id)


@router.post("", status_code=status.HTTP_201_CREATED, responses=error_responses(400, 413, 429))
def create_job(
    create: JobCreate,
    who: SubmitAuth,
    store: StoreDep,
    backend: BackendDep,
    settings: SettingsDep,
) -> Job:
    """Validate the spec completely, store the job and submit it (API.md, "Jobs"). Its
    ``cluster`` becomes the calibrated spec where the service has a calibration for it that
    applies, unless ``calibration`` is false (:mod:`service.api.calibration`). A train
    job's checkpoint folders are resolved first (:mod:`service.api.training`)."""
    validate_job(create, allow_code=settings.allow_code)
    job_id = new_job_id()
    if create.kind is JobKind.TRAIN:
        spec = train_spec(create.spec, job_id, store, settings.jobs_root)
        create = create.model_copy(update={"spec": spec})
    return submit(
        calibrated_job(create, store), store, backend, settings.public_url, job_id, who.token_id
    )


@router.get("")
def list_jobs(
    who: ApiAuth,
    store: StoreDep,
    state: JobState | None = None,
    kind: JobKind | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    cursor: Annotated[str | None, Query(max_length=64)] = None,
) -> JobPage:
    """Newest first; ``next`` is the cursor of the following page (null: the last). A
    submitter's token lists its own jobs only."""
    page = store.list_jobs(state, kind, limit, cursor, who.owned())
    return JobPage(items=page.jobs, next=page.next)


@router.get("/{job_id}", responses=error_responses(404))
def get_job(job_id: JobId, _: JobAuth, store: StoreDep) -> Job:
    """The job (its own token may read it too)."""
    return store.get_job(job_id)


@router.post("/{job_id}/cancel", responses=error_responses(404, 409, 502))
def cancel_job(job_id: JobId, _: JobUserAuth, store: StoreDep, backend: BackendDep) -> Job:
    """Stop the job's work and end it ``cancelled``; 409 when it had ended."""
    job = store.get_job(job_id)
    if job.state.terminal:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id!r} is {job.state.value}")
    try:
        backend.stop(job_id)
    except Exception as e:  # the backend's failure, named; the job is left as it was
        raise HTTPException(
            status.HTTP_502_BAD_GATEWAY, f"backend: cannot stop job {job_id!r}: {e}"
        ) from None
    return store.finish(job_id, JobState.CANCELLED)


@router.get(
    "/{job_id}/logs",
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
