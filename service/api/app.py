"""The FastAPI app: :func:`create_app` wires settings, the store, the jobs backend, the
routes (the dashboard's pages and its static files among them), the limits, the metrics and
the error handlers.

On start (lifespan) the tables are created, the calibrator's thread starts (it refits the
clusters whose runs arrived since their last fit, :mod:`service.api.calibration`; the fits
run in a child process, ended on shutdown), and every unfinished job is reconciled with the
backend (API.md, "Delivery and restarts"): still running -> keep waiting; finished without a
``result`` event -> ``failed`` with the backend's message and the log tail, unless its work
was lost (a dead driver or node) and it has ``retries`` left: then it is handed to the
backend again (:mod:`service.api.retries`). The same reconcile runs every
``reconcile_every_s`` while the service is up, so a job whose driver dies is retried or ends
``failed`` without a restart. The backend the routes see is asked for a job's current
attempt (:class:`~service.api.backend.AttemptsBackend`). Every error is JSON ``{"detail":
"..."}``.

Given a planner pool (:mod:`service.api.pool`), the backend the routes see routes each job
between the pool and the backend given; the pool's workers start with the service and end
when it stops. A job that ran in the pool of an earlier service process was lost with it:
the reconcile on start ends it ``failed`` saying so (:mod:`service.api.pool.routing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from enum import StrEnum
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from pipeplan.core.errors import PipeplanError
from pipeplan.service.api.backend import BackendState, JobsBackend, by_attempts
from pipeplan.service.api.calibration import Calibrator
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.deps import AppContext
from pipeplan.service.api.metrics import Metrics, MetricsMiddleware
from pipeplan.service.api.pool import PlannerPool, route_jobs
from pipeplan.service.api.pool.profiles import PoolProfiles
from pipeplan.service.api.queue import dispatch, held
from pipeplan.service.api.ray_jobs import RayJobsBackend
from pipeplan.service.api.retries import Forget, retries_left, retry, was_lost
from pipeplan.service.api.routes import (
    artifacts,
    catalog,
    dashboard,
    events,
    health,
    jobs,
    metrics,
    plan,
    queue,
    simulate,
    tokens,
)
from pipeplan.service.api.schemas import Job, JobState, result_schemas
from pipeplan.service.api.settings import Settings, get_settings, resolve_token
from pipeplan.service.api.store import BadCursor, JobFinished, JobNotFound, Store, now
from pipeplan.service.api.validation import BodyLimit, one_line
from pipeplan.service.web import STATIC_DIR

log = logging.getLogger("pipeplan.service")

UNKNOWN_GRACE = timedelta(seconds=60)
"""A job the backend does not know is lost only when it is older than this (a submission
may take a moment to show)."""


def _failure(state: BackendState, message: str) -> str:
    reason = f"the job's work ended ({state.value}) without a result"
    return f"{reason}: {message.strip()}" if message.strip() else reason


def _with_tail(reason: str, tail: str) -> str:
    return f"{reason}\n--- log tail ---\n{tail}" if tail else reason


class Reconciled(StrEnum):
    """What the reconcile did with one job."""

    KEPT = "kept"  # still running, or it has its result: nothing to do
    FAILED = "failed"  # ended failed: its work is over without a result
    RETRIED = "retried"  # its work was lost: handed to the backend again


def reconcile_job(
    job: Job,
    store: Store,
    backend: JobsBackend,
    tail_chars: int,
    server_url: str | None = None,
    forget: Forget = None,
) -> Reconciled:
    """When the backend says the job's work is over (or it never began) and no result came:
    hand it over again if its work was lost and it has retries left
    (:mod:`service.api.retries`; only with the service's ``server_url``, which the new
    attempt reports to; ``forget`` drops what the process remembers of the job's old
    token), else end it ``failed`` with the backend's message and the log tail (and, after
    retries, how many attempts it had)."""
    status = backend.status(job.id)
    since = store.attempted_at(job.id) or job.created_at
    unknown = status.state is BackendState.UNKNOWN and now() - since > UNKNOWN_GRACE
    if not (status.state.finished or unknown) or store.has_result(job.id):
        return Reconciled.KEPT
    try:
        text = backend.logs(job.id) if status.state.finished else ""
    except Exception as e:  # a log we cannot read is named, not fatal
        text = f"(no log: {e})"
    tail = text[-tail_chars:] if tail_chars else ""
    message = status.message or ("the backend has no such job" if unknown else "")
    reason = _failure(status.state, message)
    if was_lost(status.state, unknown) and job.retries > 0:
        if not retries_left(job):
            reason += f" (attempt {job.attempt} of {job.retries + 1}: no retries left)"
        elif server_url is not None:
            done = retry(job, store, backend, server_url, reason, forget)
            return Reconciled.RETRIED if done else Reconciled.KEPT
    try:
        store.finish(job.id, JobState.FAILED, error=_with_tail(reason, tail))
    except JobFinished:  # it ended meanwhile
        return Reconciled.KEPT
    return Reconciled.FAILED


def reconcile(
    store: Store,
    backend: JobsBackend,
    tail_chars: int = 2000,
    server_url: str | None = None,
    forget: Forget = None,
) -> list[str]:
    """Reconcile every unfinished job with the backend (:func:`reconcile_job`); the ids of
    the jobs it failed."""
    failed = []
    for job in store.unfinished_jobs():
        if held(job):  # never handed to the backend: the queue starts it in its turn
            continue
        try:
            done = reconcile_job(job, store, backend, tail_chars, server_url, forget)
        except Exception:  # one job's backend trouble does not stop the others
            log.exception("reconcile: job %s", job.id)
            continue
        if done is Reconciled.FAILED:
            failed.append(job.id)
    return failed


def reconcile_context(context: AppContext) -> list[str]:
    """The service's reconcile (at start and every ``reconcile_every_s``): its store and
    backend, its URL for the attempts it hands over, and its cache of job token hashes,
    which forgets a retried job's old token."""
    s = context.settings

    def forget(job_id: str) -> None:  # a retried job's token is a new one
        context.token_hashes.pop(job_id, None)

    return reconcile(context.store, context.backend, s.log_tail_chars, s.public_url, forget)


def _dispatch(context: AppContext) -> None:
    """Start the held jobs whose turn it is (:mod:`service.api.queue`); a failure is
    logged, and tried again on the next round."""
    try:
        dispatch(context.store, context.backend, context.settings.public_url)
    except Exception:
        log.exception("queue: dispatch")


async def _keep_dispatching(context: AppContext) -> None:
    every = context.settings.queue_every_s
    while True:
        await asyncio.sleep(every)
        await run_in_threadpool(_dispatch, context)


async def _keep_reconciling(context: AppContext) -> None:
    every = context.settings.reconcile_every_s
    while True:
        await asyncio.sleep(every)
        await run_in_threadpool(reconcile_context, context)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    context: AppContext = app.state.context
    await run_in_threadpool(context.store.create_tables)
    await run_in_threadpool(context.calibrator.start)
    if context.pool is not None:
        context.pool.start()
    s = context.settings
    await run_in_threadpool(reconcile_context, context)
    await run_in_threadpool(_dispatch, context)
    tasks = []
    if s.reconcile_every_s > 0:
        tasks.append(asyncio.create_task(_keep_reconciling(context)))
    if s.queue_every_s > 0:
        tasks.append(asyncio.create_task(_keep_dispatching(context)))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await run_in_threadpool(context.calibrator.stop)
        if context.pool is not None:
            await run_in_threadpool(context.pool.close)


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


async def _request_invalid(_: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError | ValidationError)
    return _error(422, one_line(list(e.errors())))


async def _domain_error(_: Request, e: Exception) -> JSONResponse:
    return _error(422, str(e))


async def _not_found(_: Request, e: Exception) -> JSONResponse:
    return _error(404, str(e))


async def _finished(_: Request, e: Exception) -> JSONResponse:
    return _error(409, str(e))


async def _internal(_: Request, e: Exception) -> JSONResponse:
    log.exception("internal error", exc_info=e)
    return _error(500, f"internal error: {type(e).__name__}")


def _add_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _request_invalid)
    app.add_exception_handler(ValidationError, _request_invalid)
    app.add_exception_handler(PipeplanError, _domain_error)
    app.add_exception_handler(BadCursor, _domain_error)
    app.add_exception_handler(ValueError, _domain_error)
    app.add_exception_handler(JobNotFound, _not_found)
    app.add_exception_handler(JobFinished, _finished)
    app.add_exception_handler(Exception, _internal)


def default_backend(settings: Settings) -> JobsBackend:
    """Without a backend given, jobs go to the Ray cluster at ``ray_address``."""
    if settings.ray_address is None:
        raise ValueError("backend: none given and no ray_address (PIPEPLAN_RAY_ADDRESS) set")
    return RayJobsBackend(settings.ray_address)


def _document_results(app: FastAPI) -> None:
    """Put each kind's result model in the document's components, where ``Job.result``
    refers to them (no route names them, so FastAPI would leave them out)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        doc = build()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(result_schemas())
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: Settings | None = None,
    store: Store | None = None,
    backend: JobsBackend | None = None,
    fit_worker: FitWorker | None = None,
    pool: PlannerPool | None = None,
) -> FastAPI:
    """The service's app (tests pass their own store, a fake backend, and a calibration fit
    worker shared by their apps). With a planner ``pool`` (started and closed with the app),
    the jobs that need no device run in it, ``POST /v1/plan`` answers from it, and the
    dashboard's plan panel takes zoo models' profiles from it."""
    settings = settings or get_settings()
    store = store or Store(settings.database_url)
    backend = by_attempts(backend or default_backend(settings), store.get_job)
    if pool is not None:
        backend = route_jobs(backend, pool, store.get_job)
    context = AppContext(
        settings=settings,
        token=resolve_token(settings),
        store=store,
        backend=backend,
        metrics=Metrics(store.counts),
        calibrator=Calibrator(store, worker=fit_worker),
        pool=pool,
        profiles=PoolProfiles(pool) if pool is not None else None,
    )
    app = FastAPI(
        title="pipeplan",
        summary="Plan and run pipeline-parallel training on heterogeneous clusters",
        version="1",
        lifespan=lifespan,
    )
    app.state.context = context
    for module in (
        jobs,
        artifacts,
        queue,
        events,
        simulate,
        catalog,
        health,
        metrics,
        tokens,
        plan,
        dashboard,
    ):
        app.include_router(module.router)
    _document_results(app)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    _add_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=lambda: context.metrics)
    return app
