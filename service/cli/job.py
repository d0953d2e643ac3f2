"""``pipeplan job run --job ID --server URL``: the entrypoint of a service job's Ray Job.

The service submits this command as the job's Ray Job (:mod:`service.api.ray_jobs`), with
the job's own token in ``PIPEPLAN_JOB_TOKEN``; its planner pool runs the same work in a warm
worker (:func:`run_in_process`, :mod:`service.api.pool`). It fetches the job's spec with
that token, runs the kind's use-case with an :class:`~service.tasks.events.EventReporter` (every
evaluation, progress, measurements as events), then posts ``result`` (the result's
``to_dict()``) and exits 0, or posts ``error`` (``{"message": one line}``) and exits 1.

A ``train`` job reports each step as ``progress`` (its loss and samples per second) and
each checkpoint as a ``checkpoint`` event; the service gave it its checkpoint folder.

Where the use-case needs Ray (a measured, parallel or PPO search, ``run``, ``train``, a
measured ``profile``), it joins the cluster the job runs in (``RAY_ADDRESS``, set by Ray's job
supervisor) through the request's ``address``, never a cluster of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Annotated, Any

import httpx
import typer
from pydantic import BaseModel, ValidationError

from pipeplan.agents.problem import ProblemError
from pipeplan.agents.registry import planner_class
from pipeplan.core.errors import PipeplanError
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.reservation import Claimant, claiming
from pipeplan.service.api.backend import first_seq
from pipeplan.service.api.ray_jobs import JOB_TOKEN_ENV
from pipeplan.service.api.schemas import ERROR_KEY, SPEC_MODELS, EventType, JobKind, JobState
from pipeplan.service.cli.console import say, validation_message
from pipeplan.service.tasks.common import ProblemRequest, cluster_spec
from pipeplan.service.tasks.compare import CompareRequest, compare, planner_names
from pipeplan.service.tasks.events import (
    EventChannel,
    EventDeliveryError,
    EventReporter,
    PlanContext,
    with_retries,
)
from pipeplan.service.tasks.plan import PlanRequest, Reward, plan, uses_ray
from pipeplan.service.tasks.profile import ProfileRequest, profile
from pipeplan.service.tasks.run import RunRequest, run
from pipeplan.service.tasks.train import TrainRequest, train

Result = Any
"""A use-case's result: anything with ``to_dict()``."""


def fetch_job(client: httpx.Client, job_id: str, token: str) -> dict[str, Any]:
    """The job as the service holds it (its kind and spec), fetched with the job token."""
    headers = {"Authorization": f"Bearer {token}"}
    send = partial(client.get, f"/v1/jobs/{job_id}", headers=headers)
    doc: dict[str, Any] = with_retries(send, f"fetching job {job_id}").json()
    return doc


def in_job_cluster(request: BaseModel) -> BaseModel:
    """``request`` joined to the job's own cluster (``RAY_ADDRESS``) where its use-case
    would otherwise start a cluster of its own (module docstring)."""
    address = os.environ.get("RAY_ADDRESS")
    if not address or getattr(request, "address", "set") is not None:
        return request
    joins = (
        (isinstance(request, PlanRequest) and uses_ray(request))
        or (isinstance(request, ProfileRequest) and request.measure)
        or isinstance(request, RunRequest | TrainRequest)
    )
    return request.model_copy(update={"address": address}) if joins else request


def _compare_needs_ray(request: CompareRequest) -> bool:
    try:
        return any(planner_class(n).needs_ray for n in planner_names(request.planners))
    except (PipeplanError, ProblemError):
        return False  # the use-case names the bad planner


@contextmanager
def ray_for_compare(request: BaseModel) -> Iterator[None]:
    """A comparison with a Ray planner runs on the job's cluster: joined for its time."""
    joined = (
        isinstance(request, CompareRequest)
        and bool(os.environ.get("RAY_ADDRESS"))
        and _compare_needs_ray(request)
    )
    if joined:
        runtime.connect_in_job()
    try:
        yield
    finally:
        if joined:
            runtime.shutdown()


def plan_context(request: BaseModel) -> PlanContext | None:
    """What decodes the populations of the request's searches (None: not a search)."""
    if not isinstance(request, ProblemRequest):
        return None
    try:
        spec = cluster_spec(request.cluster)
    except PipeplanError:
        return None  # the use-case reports the bad cluster
    return PlanContext(spec, request.batch, request.schedule, request.objective)


def run_use_case(kind: JobKind, request: BaseModel, reporter: EventReporter) -> Result:
    if isinstance(request, TrainRequest):
        return train(request, reporter)
    if isinstance(request, PlanRequest):
        return plan(request, reporter)
    if isinstance(request, CompareRequest):
        with ray_for_compare(request):
            return compare(request, reporter)
    if isinstance(request, ProfileRequest):
        return profile(request, reporter)
    if isinstance(request, RunRequest):
        return run(request, reporter)
    raise ValueError(f"kind: no use-case for {kind.value!r}")


def measurements(kind: JobKind, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs measured on the cluster, from the result document: a ``run`` job's one run,
    a measured search's every run."""
    if kind is JobKind.RUN:
        return [
            {
                "plan": doc["plan"],
                "batch_time_s": doc["measured"]["batch_time_s"],
                "predicted_batch_time_s": doc["predicted"]["batch_time_s"],
                "emulated": doc["emulated"],
            }
        ]
    if kind is JobKind.PLAN and isinstance(doc.get("measured"), dict):
        return list(doc["measured"].get("evaluated", []))
    return []


def one_line(e: BaseException) -> str:
    """An error as the CLI would print it, on one line."""
    if isinstance(e, ValidationError):
        return validation_message(e)
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    if isinstance(e, PipeplanError | ExecutorError):
        return first
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


ENDED = frozenset(s.value for s in JobState if s.terminal)
"""The states of a job that has ended."""
NOTHING_DONE: dict[str, Any] = {"evaluations": 0, "best_value": None, "elapsed_s": 0.0}
"""The first ``progress`` of a job (of a ``train`` job: :data:`NO_STEP_DONE`)."""
NO_STEP_DONE: dict[str, Any] = {"step": None, "loss": None, "samples_per_s": None}


def execute(job: dict[str, Any], channel: EventChannel) -> int:
    """Run the job's use-case, its reports and its end as events; the exit code. The first
    event, sent before any work, is a ``progress`` of nothing done yet: it marks the job
    ``running`` even for kinds that report nothing until they end (``run``, ``profile``)."""
    first = NO_STEP_DONE if job.get("kind") == JobKind.TRAIN.value else NOTHING_DONE
    channel.emit(EventType.PROGRESS.value, first)
    try:
        kind = JobKind(job["kind"])
        request = in_job_cluster(SPEC_MODELS[kind].model_validate(job["spec"]))
        measured = isinstance(request, PlanRequest) and request.reward is Reward.MEASURED
        source = "measured" if measured else "simulated"
        reporter = EventReporter(channel, plan_context(request), source)
        claimant = Claimant(str(job["id"]), None, reporter.waiting, reporter.granted)
        with claiming(claimant):
            doc = run_use_case(kind, request, reporter).to_dict()
        if isinstance(request, ProblemRequest) and request.devices == "free":
            doc["assumed_devices"] = list(cluster_spec(request.cluster).device_ids)
        for m in measurements(kind, doc):
            reporter.measurement(m)
        channel.emit(EventType.RESULT.value, doc)
        return 0
    except EventDeliveryError:
        raise
    except Exception as e:  # the job's failure, whatever it is, ends the job as an event
        say(f"error: {one_line(e)}")
        channel.emit(EventType.ERROR.value, {ERROR_KEY: one_line(e)})
        return 1


def run_job(
    job_id: str, server: str, token: str, transport: httpx.BaseTransport | None = None
) -> int:
    """Fetch job ``job_id`` from ``server``, run it, deliver every event; the exit code.
    A job that has ended (cancelled meanwhile, or finished by an earlier attempt that was
    cut short) is not run again. (``transport``: httpx's, for tests.)"""
    with httpx.Client(base_url=server, timeout=30.0, transport=transport) as client:
        job = fetch_job(client, job_id, token)
        if job.get("state") in ENDED:
            say(f"job {job_id} is {job['state']} already: nothing to run")
            return 0
        channel = EventChannel(client, job_id, token)
        channel.next_seq = first_seq(int(job.get("attempt") or 1))  # a retry's own seqs
        try:
            code = execute(job, channel)
        finally:
            channel.close()
    return code


def run_in_process(job_id: str, server: str, token: str) -> int:
    """Run job ``job_id`` in this process; the exit code (1 when its events could not be
    delivered, said on stderr). The Ray Job's command and the service's planner pool
    (:mod:`service.api.pool`) both run a job through here."""
    try:
        return run_job(job_id, server, token)
    except EventDeliveryError as e:
        say(f"error: {e}")
        return 1


def run_command(
    job: Annotated[str, typer.Option("--job", help="the pipeplan job id")],
    server: Annotated[str, typer.Option("--server", help="the service's URL")],
) -> None:
    """Run one service job (the entrypoint of its Ray Job; token in PIPEPLAN_JOB_TOKEN)."""
    token = os.environ.get(JOB_TOKEN_ENV, "")
    if not token:
        say(f"error: {JOB_TOKEN_ENV}: not set (the service passes the job's token there)")
        raise typer.Exit(2)
    raise typer.Exit(run_in_process(job, server, token))


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Service jobs (the entrypoint their Ray Jobs run).")
    group.command("run")(run_command)
    app.add_typer(group, name="job")
