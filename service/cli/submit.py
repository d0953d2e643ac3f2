"""``pipeplan submit plan|compare|profile|run|train``: a job for the service, built from the
local command's flags.

Each command builds the request the local command builds, from the same flags (or takes the
whole request with ``--spec FILE``, ``-`` for stdin), sends it to the service
(:class:`service.client.Client`) and prints the job id; ``--wait`` follows the job with a
progress bar and ends with the local command's table (``--json``: its document). A job that
failed or was cancelled exits 1; see :mod:`service.cli.jobs` for the other exit codes.

``submit train`` takes ``pipeplan train``'s flags but those of a local run (``--address``,
``--resume``): the job runs on the service's cluster, writes its checkpoints into its own
folder unless ``--checkpoint-dir`` names one there, and ``--resume-from`` names a checkpoint
there or an earlier train job by its id. (``pipeplan train``'s own flag declarations import
torch with their module, which a client command does not load: they are declared here.)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from typer._click.core import ParameterSource

from pipeplan.core._io import read_document
from pipeplan.service.api.schemas import JobKind, JobState
from pipeplan.service.cli import options as opts
from pipeplan.service.cli.console import CliError, cluster_ref, document, echo_json, say
from pipeplan.service.cli.job_view import job_progress, render_result
from pipeplan.service.cli.jobs import JsonOpt, NameOpt, ServerOpt, TokenOpt, connect, served
from pipeplan.service.cli.options import ProblemFlags
from pipeplan.service.tasks.requests import (
    CompareRequest,
    DataKind,
    PlanRequest,
    ProfileRequest,
    Reward,
    RunRequest,
    TrainRequest,
)

Document = dict[str, Any]

SpecOpt = Annotated[
    str | None,
    typer.Option("--spec", help="the whole request as JSON/YAML (FILE, or - for stdin)"),
]
WaitOpt = Annotated[
    bool, typer.Option("--wait", help="follow the job to its end and print its result")
]
# flags the local commands require, optional here (--spec may give the request instead)
ClusterOpt = Annotated[str | None, typer.Option("--cluster", help="cluster.yaml or a preset name")]
PlannerOpt = Annotated[str | None, typer.Option("--planner", help="planner name")]

PriorityOpt = Annotated[
    int,
    typer.Option(
        "--priority", help="the queue's order: higher first, then older first (job field)"
    ),
]
DeadlineOpt = Annotated[
    float | None,
    typer.Option("--deadline-s", help="fail the job if it has not started after this many seconds"),
]
RetriesOpt = Annotated[
    int,
    typer.Option("--retries", help="resubmit the search this many times if its Ray Job is lost"),
]

COMMON = frozenset(
    {"spec", "name", "server", "token", "wait", "as_json", "priority", "deadline_s", "retries"}
)
"""The parameters of every ``submit`` command (``retries``: of ``plan`` and ``compare``): how
the job is queued and followed; the others describe the request."""


@dataclass(frozen=True)
class Submitting:
    """The flags every ``submit`` command has: where, under which name, and what to show."""

    server: str | None
    token: str | None
    name: str | None
    wait: bool
    as_json: bool
    priority: int = 0
    deadline_s: float | None = None
    retries: int = 0

    def fields(self) -> dict[str, Any]:
        """The job's queue fields the service takes beside its spec (defaults left out)."""
        given = {"priority": self.priority, "deadline_s": self.deadline_s, "retries": self.retries}
        return {k: v for k, v in given.items() if v}


def read_spec(text: str) -> Document:
    """``--spec``: a JSON/YAML file's document, or JSON on stdin (``-``)."""
    if text != "-":
        return read_document(Path(text))
    try:
        doc = json.loads(sys.stdin.read())
    except json.JSONDecodeError as e:
        raise CliError(f"--spec: stdin is not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise CliError(f"--spec: expected a JSON object, got {type(doc).__name__}")
    return doc


def request_spec(ctx: typer.Context, spec: str | None, build: Callable[[], BaseModel]) -> Document:
    """The job's spec: ``--spec``'s document as it is, or the request the flags build (the
    service fills in the defaults left out)."""
    if spec is None:
        return build().model_dump(mode="json", exclude_defaults=True)
    given = [
        p.opts[0]
        for p in ctx.command.params
        if p.name not in COMMON
        and p.name is not None
        and ctx.get_parameter_source(p.name) is ParameterSource.COMMANDLINE
    ]
    if given:
        raise CliError(f"--spec: not with {', '.join(given)} (the spec is the whole request)")
    return read_spec(spec)


def require(flag: str, value: str | None) -> str:
    if value is None:
        raise CliError(f"{flag}: required (or give the whole request with --spec)")
    return value


def submit_job(kind: JobKind, spec: Document, how: Submitting) -> None:
    """Submit; print the job id (``--json``: the job), or with ``--wait`` follow it and
    print its result as the local command does (``--json``: the result document)."""
    with connect(how.server, how.token) as client:
        job = client.submit(kind, spec, how.name, **how.fields())
        if not how.wait:
            if how.as_json:
                echo_json(job.model_dump(mode="json"))
            else:
                typer.echo(job.id)
            return
        say(f"submitted {job.kind.value} job {job.id}")
        with job_progress(job) as on_event:
            done = client.wait(job.id, on_event)
    if done.state is not JobState.SUCCEEDED:
        why = f": {done.error}" if done.error else ""
        say(f"error: job {done.id} {done.state.value}{why}")
        raise typer.Exit(1)
    if how.as_json:
        echo_json(done.result)
    else:
        render_result(done)


submit_app = typer.Typer(
    name="submit",
    help="Submit a job to the pipeplan service (prints its id; --wait follows it).",
    no_args_is_help=True,
)


# --cluster optional here: --spec may give the whole request instead
OPTIONAL_CLUSTER = {"cluster": (ClusterOpt, None)}


def problem_fields(problem: ProblemFlags) -> dict[str, Any]:
    """The problem's fields of a request; ``--cluster`` is required without ``--spec``."""
    return replace(problem, cluster=require("--cluster", problem.cluster)).fields()


@submit_app.command("plan")
@served
@opts.problem_options(declare=OPTIONAL_CLUSTER)
def submit_plan(
    ctx: typer.Context,
    *,
    planner: PlannerOpt = None,
    problem: ProblemFlags,
    option: opts.OptionOpt = None,
    workers: opts.WorkersOpt = None,
    iterations: opts.IterationsOpt = None,
    reward: opts.RewardOpt = Reward.SIMULATED,
    repeats: opts.RepeatsOpt = 3,
    policy: opts.PolicyOpt = None,
    spec: SpecOpt = None,
    name: NameOpt = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    wait: WaitOpt = False,
    as_json: JsonOpt = False,
    priority: PriorityOpt = 0,
    deadline_s: DeadlineOpt = None,
    retries: RetriesOpt = 0,
) -> None:
    """A `pipeplan plan` job: one planner on one problem."""

    def build() -> PlanRequest:
        who = require("--planner", planner)
        fields = problem_fields(problem)
        options = opts.parse_options(who, option or [], workers, iterations, policy)
        how = opts.reward_for_workers(who, reward, workers)
        return PlanRequest(
            **fields, planner=who, options=options, reward=how, repeats=repeats,
            workers=workers if how is Reward.PARALLEL else None,
        )  # fmt: skip

    doc = request_spec(ctx, spec, build)
    how = Submitting(server, token, name, wait, as_json, priority, deadline_s, retries)
    submit_job(JobKind.PLAN, doc, how)


@submit_app.command("compare")
@served
@opts.problem_options(declare=OPTIONAL_CLUSTER)
def submit_compare(
    ctx: typer.Context,
    *,
    planners: opts.PlannersOpt = None,
    problem: ProblemFlags,
    spec: SpecOpt = None,
    name: NameOpt = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    wait: WaitOpt = False,
    as_json: JsonOpt = False,
    priority: PriorityOpt = 0,
    deadline_s: DeadlineOpt = None,
    retries: RetriesOpt = 0,
) -> None:
    """A `pipeplan compare` job: several planners on one problem."""

    def build() -> CompareRequest:
        names = None if planners is None else planners.split(",")
        return CompareRequest(**problem_fields(problem), planners=names)

    doc = request_spec(ctx, spec, build)
    how = Submitting(server, token, name, wait, as_json, priority, deadline_s, retries)
    submit_job(JobKind.COMPARE, doc, how)


@submit_app.command("profile")
@served
@opts.model_flag_options()
def submit_profile(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Argument(help=f"the model: {opts.MODEL_FORMS}")] = None,
    input_size: opts.InputSizeOpt = None,
    cluster: opts.EmulatedClusterOpt = None,
    measure: opts.MeasureOpt = False,
    model_flags: opts.ModelFlags = opts.NO_MODEL_FLAGS,
    spec: SpecOpt = None,
    name: NameOpt = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    wait: WaitOpt = False,
    as_json: JsonOpt = False,
    priority: PriorityOpt = 0,
    deadline_s: DeadlineOpt = None,
) -> None:
    """A `pipeplan profile` job: a zoo model into a profile document."""

    def build() -> ProfileRequest:
        return ProfileRequest(
            model=require("MODEL", model),
            **model_flags.fields(),
            input_size=input_size,
            cluster=cluster_ref(cluster) if cluster is not None else None,
            measure=measure,
        )

    doc = request_spec(ctx, spec, build)
    how = Submitting(server, token, name, wait, as_json, priority, deadline_s)
    submit_job(JobKind.PROFILE, doc, how)


@submit_app.command("run")
@served
@opts.model_flag_options()
def submit_run(
    ctx: typer.Context,
    plan: Annotated[Path | None, typer.Option("--plan", help="plan.json to run")] = None,
    cluster: ClusterOpt = None,
    model: opts.ModelOpt = None,
    input_size: opts.InputSizeOpt = None,
    profile: opts.RunProfileOpt = None,
    steps: Annotated[int, typer.Option(help="measured training steps")] = 5,
    warmup: Annotated[int, typer.Option(help="steps run first and not timed")] = 1,
    data: opts.DataOpt = DataKind.SYNTHETIC,
    seed: Annotated[int, typer.Option(help="seed of the weights and the data")] = 0,
    model_flags: opts.ModelFlags = opts.NO_MODEL_FLAGS,
    spec: SpecOpt = None,
    name: NameOpt = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    wait: WaitOpt = False,
    as_json: JsonOpt = False,
    priority: PriorityOpt = 0,
    deadline_s: DeadlineOpt = None,
) -> None:
    """A `pipeplan run` job: a plan trained on the service's Ray cluster."""

    def build() -> RunRequest:
        if plan is None:
            raise CliError("--plan: required (or give the whole request with --spec)")
        return RunRequest(
            plan=read_document(plan),
            cluster=cluster_ref(cluster) if cluster is not None else None,
            model=model, input_size=input_size, profile=document(profile),
            **model_flags.fields(), steps=steps, warmup=warmup, data=data, seed=seed,
        )  # fmt: skip

    doc = request_spec(ctx, spec, build)
    how = Submitting(server, token, name, wait, as_json, priority, deadline_s)
    submit_job(JobKind.RUN, doc, how)


TrainDataOpt = Annotated[
    str,
    typer.Option(
        "--data",
        help="synthetic, digits, imagefolder:PATH, tokens:PATH (absolute paths on the "
        "service's cluster) or package.module:callable (where the service allows code)",
    ),
]
CheckpointDirOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoint-dir",
        help="where checkpoints go on the service's cluster (absolute; default: the job's "
        "own folder)",
    ),
]
ResumeFromOpt = Annotated[
    str | None,
    typer.Option(
        "--resume-from", help="continue from an earlier train job (its id) or a checkpoint"
    ),
]


@submit_app.command("train")
@served
@opts.problem_options(declare=OPTIONAL_CLUSTER)
@opts.train_flag_options()
def submit_train(
    ctx: typer.Context,
    *,
    problem: ProblemFlags,
    training: opts.TrainFlags = opts.NO_TRAIN_FLAGS,
    data: TrainDataOpt = "synthetic",
    checkpoint_dir: CheckpointDirOpt = None,
    resume_from: ResumeFromOpt = None,
    spec: SpecOpt = None,
    name: NameOpt = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    wait: WaitOpt = False,
    as_json: JsonOpt = False,
    priority: PriorityOpt = 0,
    deadline_s: DeadlineOpt = None,
) -> None:
    """A `pipeplan train` job: a model trained on a plan on the service's Ray cluster."""

    def build() -> TrainRequest:
        return TrainRequest(
            **problem_fields(problem), **training.fields(), data=data,
            checkpoint_dir=checkpoint_dir, resume_from=resume_from,
        )  # fmt: skip

    doc = request_spec(ctx, spec, build)
    how = Submitting(server, token, name, wait, as_json, priority, deadline_s)
    submit_job(JobKind.TRAIN, doc, how)


def register(app: typer.Typer) -> None:
    app.add_typer(submit_app)
