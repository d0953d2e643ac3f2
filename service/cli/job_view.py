"""How the job commands (:mod:`service.cli.jobs`) show jobs: a progress bar while one runs,
a table of jobs, one line per event, and a job's result as the local command shows it.

A result is the use-case's ``to_dict()`` document (API.md), so the tables are drawn from its
fields: a plan's estimate is rebuilt and drawn by :func:`service.render.estimate_table`; a
comparison and a run get the local command's columns from the document's figures, a
training run the local command's lines. A train job's progress is its latest step: the
steps trained, the loss and the samples per second.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Literal

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeplan.agents.problem import Objective
from pipeplan.core.costmodel import Estimate, StageEstimate
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.service.api.schemas import Event, EventType, Job, JobKind, JobPage
from pipeplan.service.cli.console import err, out
from pipeplan.service.client import EventCallback
from pipeplan.service.render import (
    NOTE_WIDTH,
    bound_lines,
    estimate_table,
    format_value,
    measured_lines,
    pct,
    shorten,
    totals_lines,
)
from pipeplan.service.web.format import waiting

Document = dict[str, Any]


# --- while a job runs -------------------------------------------------------------------------


def objective_of(spec: Document) -> Objective:
    try:
        return Objective(spec.get("objective", Objective.TIME))
    except ValueError:
        return Objective.TIME


def budget_of(spec: Document) -> int | None:
    budget = spec.get("budget") or {}
    n = budget.get("evaluations") if isinstance(budget, dict) else None
    return n if isinstance(n, int) else None


def _best(value: Any, objective: Objective) -> str:
    if not isinstance(value, int | float):
        return "-"
    return format_value(float(value), objective)


def _number(value: Any, form: str) -> str:
    return format(value, form) if isinstance(value, int | float) else "-"


def step_text(progress: Document) -> str:
    """``step 3, loss 0.5123, 1,234.5 samples/s`` (a train job's latest step)."""
    if progress.get("step") is None:
        return "no step trained yet"
    return (
        f"step {progress['step']}, loss {_number(progress.get('loss'), '.4f')}, "
        f"{_number(progress.get('samples_per_s'), ',.1f')} samples/s"
    )


@contextmanager
def train_progress(job: Job) -> Iterator[EventCallback]:
    """A transient bar on stderr (steps, loss, samples/s) fed by a train job's events."""
    total = job.spec.get("steps")
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} samples/s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        label = f"{job.kind.value} {job.id}"
        steps = total if isinstance(total, int) else None
        task = bar.add_task(label, total=steps, loss="-", rate="-")

        def on_event(event: Event) -> None:
            d = event.data
            if event.type is EventType.PROGRESS and isinstance(d.get("step"), int):
                bar.update(
                    task,
                    completed=d["step"],
                    loss=_number(d.get("loss"), ".4f"),
                    rate=_number(d.get("samples_per_s"), ",.1f"),
                )
            elif event.type is EventType.CHECKPOINT:
                bar.update(task, description=f"{label} (checkpoint at step {d.get('step')})")

        yield on_event


@contextmanager
def job_progress(job: Job) -> Iterator[EventCallback]:
    """A transient bar on stderr (evaluations, best value; a train job's steps, loss and
    samples/s) fed by the job's events; only on a terminal, as the local commands draw
    theirs."""
    if job.kind is JobKind.TRAIN:
        with train_progress(job) as on_train_event:
            yield on_train_event
        return
    objective = objective_of(job.spec)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed} evaluations"),
        TextColumn("best {task.fields[best]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        label = f"{job.kind.value} {job.id}"
        task = bar.add_task(label, total=budget_of(job.spec), best="-")

        def on_event(event: Event) -> None:
            if event.type is EventType.PROGRESS:
                bar.update(
                    task,
                    completed=event.data.get("evaluations", 0),
                    best=_best(event.data.get("best_value"), objective),
                )
            elif event.type is EventType.EVALUATION:
                bar.update(task, description=f"{label} ({event.data.get('source', 'simulated')})")

        yield on_event


# --- lists and events ---------------------------------------------------------------------------


def _when(job: Job) -> str:
    return job.created_at.strftime("%Y-%m-%d %H:%M:%S")


def _progress_cell(job: Job) -> str:
    p = job.progress or {}
    if job.kind is JobKind.TRAIN and "step" in p:
        return step_text(p)
    if "evaluations" not in p:
        return "-"
    return f"{p['evaluations']} evals, best {_best(p.get('best_value'), objective_of(job.spec))}"


PREDICTING_KINDS = frozenset({JobKind.PLAN, JobKind.COMPARE, JobKind.RUN, JobKind.TRAIN})
"""The job kinds whose results hold the cost model's predictions."""


Calibrated = Literal["none", "uncalibrated", "service", "own"]


def _calibration(job: Job) -> tuple[Calibrated, Document]:
    """Whether the job's predictions are calibrated, from its stored spec (the service puts
    the calibrated cluster document there, :mod:`service.api.calibration`): ``none`` (not a
    predicting kind), ``uncalibrated``, ``service`` (the service's calibration from use) or
    ``own`` (the request's own ``calibration:`` block); and the calibration's ``fit`` record."""
    if job.kind not in PREDICTING_KINDS:
        return "none", {}
    cluster = job.spec.get("cluster")
    calibration = cluster.get("calibration") if isinstance(cluster, dict) else None
    if not isinstance(calibration, dict):
        return "uncalibrated", {}
    fit = calibration.get("fit")
    fit = fit if isinstance(fit, dict) else {}
    return ("service" if fit.get("source") == "service" else "own"), fit


def predictions_line(job: Job) -> str:
    """``calibrated from 11 runs (fitted 2026-11-25T04:10:00+00:00)``, ``calibrated (the
    request's own)``, ``uncalibrated spec`` or ``-`` (as the dashboard's job facts say it)."""
    how, fit = _calibration(job)
    if how == "service":
        return f"calibrated from {fit.get('runs', '?')} runs (fitted {fit.get('fitted_at', '?')})"
    if how == "own":
        return "calibrated (the request's own)"
    return "uncalibrated spec" if how == "uncalibrated" else "-"


def _calibrated_cell(job: Job) -> str:
    how, fit = _calibration(job)
    if how == "service":
        return f"{fit.get('runs', '?')} runs"
    if how == "own":
        return "own"
    return "no" if how == "uncalibrated" else "-"


STATE_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "running": "cyan"}


def jobs_table(page: JobPage) -> Table:
    """One row per job, newest first."""
    table = Table(title="jobs (newest first)", title_justify="left")
    for col in ("id", "kind", "state", "name", "created", "progress", "calibrated"):
        wraps = col in ("name", "progress")
        table.add_column(col, no_wrap=not wraps, min_width=8 if wraps else None)
    for job in page.items:
        style = STATE_STYLE.get(job.state.value)
        state = f"[{style}]{job.state.value}[/{style}]" if style else job.state.value
        if job.waiting_for and job.waiting_for.get("devices"):
            state += " (devices held)"
        elif job.waiting_for and job.waiting_for.get("behind"):
            state += f" ({len(job.waiting_for['behind'])} ahead)"
        table.add_row(
            job.id,
            job.kind.value,
            state,
            job.name or "",
            _when(job),
            _progress_cell(job),
            _calibrated_cell(job),
        )
    return table


def event_line(event: Event) -> str:
    """``   3  progress     12 evaluations, best 0.0123`` (a summary of the data)."""
    d = event.data
    if event.type is EventType.PROGRESS and "step" in d:
        what = step_text(d)
    elif event.type is EventType.PROGRESS:
        what = f"{d.get('evaluations')} evaluations, best {d.get('best_value')}"
    elif event.type is EventType.CHECKPOINT:
        what = f"after step {d.get('step')}: {d.get('path')}"
    elif event.type is EventType.EVALUATION:
        what = f"value {d.get('value')}, batch {d.get('batch_time_s')} s ({d.get('source')})"
    elif event.type is EventType.ERROR:
        what = str(d.get("message", d.get("error", json.dumps(d))))
    elif event.type is EventType.RESULT:
        what = "the result (see `pipeplan jobs show ID`)"
    else:
        what = json.dumps(d)
    return f"{event.seq:>6}  {event.type.value:<11}  {what}"


def job_lines(job: Job) -> list[str]:
    """What ``jobs show`` prints above the result."""
    lines = [
        f"job             {job.id} ({job.kind.value}{', ' + job.name if job.name else ''})",
        f"state           {job.state.value}",
        f"created         {job.created_at.isoformat()}",
    ]
    for label, when in (("started", job.started_at), ("finished", job.finished_at)):
        if when is not None:
            lines.append(f"{label:<16}{when.isoformat()}")
    if job.kind in PREDICTING_KINDS:
        lines.append(f"predictions     {predictions_line(job)}")
    if job.waiting_for and job.waiting_for.get("devices"):
        lines.append(f"waiting for     {waiting(job.waiting_for)}")
    elif job.waiting_for and job.waiting_for.get("behind"):
        lines.append(f"waiting for     its turn, behind {', '.join(job.waiting_for['behind'])}")
    if job.priority or job.deadline_s:
        deadline = f", deadline {job.deadline_s:g} s" if job.deadline_s else ""
        lines.append(f"priority        {job.priority}{deadline}")
    if job.ray_job_id:
        lines.append(f"ray job         {job.ray_job_id}")
    if job.progress and ("evaluations" in job.progress or "step" in job.progress):
        lines.append(f"progress        {_progress_cell(job)}")
    if job.error:
        lines.append(f"error           {job.error}")
    return lines


# --- results, as the local commands print them ------------------------------------------------


def estimate_of(doc: Document) -> Estimate:
    """The :class:`Estimate` an estimate document (``Estimate.to_dict``) was written from."""
    stage_names = {f.name for f in fields(StageEstimate)}
    stages = tuple(
        StageEstimate(**{
            **{k: v for k, v in s.items() if k in stage_names},
            "layers": tuple(s["layers"]),
            "devices": tuple(s["devices"]),
        })
        for s in doc["stages"]
    )  # fmt: skip
    names = {f.name for f in fields(Estimate)} - {"schedule", "not_fitting", "stages", "timeline"}
    return Estimate(
        **{k: v for k, v in doc.items() if k in names},
        schedule=Schedule(doc["schedule"]),
        not_fitting=tuple(doc["not_fitting"]),
        stages=stages,
        timeline=(),
    )


def describe_spec(spec: Document) -> str:
    """``alexnet on local-hetero, batch 64, time`` (as :func:`agents.compare.describe`)."""
    profile = spec.get("profile")
    model = spec.get("model") or (profile.get("name") if isinstance(profile, dict) else "?")
    cluster = spec.get("cluster")
    where = cluster.get("name", "?") if isinstance(cluster, dict) else cluster
    goal = str(spec.get("objective", "time"))
    if goal == "cost":
        goal += f" at >= {spec.get('min_throughput', 0):g} samples/s"
    return f"{model} on {where}, batch {spec.get('batch', 64)}, {goal}"


def _render_plan(spec: Document, doc: Document) -> None:
    est = estimate_of(doc["estimate"])
    out().print(estimate_table(est, f"{doc['planner']}: {describe_spec(spec)} (cost model)"))
    how = ", measured reward" if "measured" in doc else ""
    search = (
        f"search          {doc['evaluations']} evaluations in {doc['wall_time_s']:.2f} s "
        f"({doc['planner']}{how})"
    )
    bound = doc.get("bound")
    bounds = bound_lines(bound, est.batch_time_s) if isinstance(bound, dict) else []
    for line in [*totals_lines(est), *bounds, search]:
        typer.echo(line)
    measured = doc.get("measured")
    if isinstance(measured, dict):
        for line in measured_lines(measured, est.batch_time_s):
            typer.echo(line)


def _ratio(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) and math.isfinite(value) else "-"


def comparison_table(doc: Document) -> Table:
    """``pipeplan compare``'s table, from its document."""
    ref = doc.get("exact_reference")
    table = Table(title=f"{doc.get('problem', '')} (cost model)", title_justify="left")
    for col in ("planner", "batch ms", "samples/s", "$/sample", "memory ok", "search s",
                "evaluations", "vs best", f"vs {ref or 'exact'}"):  # fmt: skip
        table.add_column(col, justify="left" if col == "planner" else "right", no_wrap=True)
    table.add_column("note", max_width=NOTE_WIDTH)
    for r in doc.get("results", []):
        if not r.get("ok"):
            note = "failed: " + shorten(str(r.get("error", "")), 2 * NOTE_WIDTH)
            table.add_row(r["planner"], *["-"] * 4, f"{r['search_s']:.2f}", *["-"] * 3, note)
            continue
        table.add_row(
            r["planner"],
            f"{r['batch_time_s'] * 1e3:.3f}",
            f"{r['throughput']:,.1f}",
            f"{r['cost_per_sample']:.3e}",
            "yes" if r["fits"] else "[red]NO[/red]",
            f"{r['search_s']:.2f}",
            str(r["evaluations"]),
            _ratio(r.get("ratio_to_best")),
            _ratio(r.get("ratio_to_exact")),
            "best" if r.get("ratio_to_best") == 1.0 else "",
        )
    return table


def _render_compare(doc: Document) -> None:
    out().print(comparison_table(doc))
    ref = doc.get("exact_reference")
    typer.echo(
        f"vs {ref}: ratio to {ref}'s plan"
        if ref
        else "no exact reference: neither brute nor dp produced a plan"
    )
    for r in doc.get("results", []):
        if not r.get("ok"):
            typer.echo(f"{r['planner']} failed: {r.get('error')}")


def run_table(doc: Document) -> Table:
    """``pipeplan run``'s table (predicted, measured, error), from its document."""
    est, m = doc["predicted"], doc["measured"]
    title = f"{doc['model']} on {doc['cluster']}: measured vs cost model ({doc['profile']})"
    table = Table(title=title + (" [EMULATED]" if doc.get("emulated") else ""))
    for col in ("quantity", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "quantity" else "right")

    def ms(label: str, p: float, q: float) -> None:
        table.add_row(label, f"{p * 1e3:.2f}", f"{q * 1e3:.2f}", pct(p, q))

    ms("batch time ms", est["batch_time_s"], m["batch_time_s"])
    table.add_row("throughput samples/s", f"{est['throughput']:,.1f}",
                  f"{m['throughput']:,.1f}", pct(est["throughput"], m["throughput"]))  # fmt: skip
    for p, q in zip(est["stages"], m["stages"], strict=False):
        where = f"stage {p['index']} [{p['layers'][0]}, {p['layers'][1]}) {', '.join(p['devices'])}"
        ms(f"{where}: compute ms", p["compute_s"], q["compute_s"])
        ms(f"{where}: transfer ms", p["transfer_s"], q["transfer_s"])
    return table


def train_lines(doc: Document) -> list[str]:
    """What ``pipeplan train`` prints of a training run, from its document."""
    steps = [s for s in doc.get("steps", []) if isinstance(s, dict)]
    lines = []
    if steps:
        first, last = steps[0], steps[-1]
        predicted = doc.get("predicted_step_s")
        lines.append(
            f"trained steps {first['step'] + 1}..{last['step'] + 1}: loss "
            f"{_number(first.get('loss'), '.4f')} -> {_number(last.get('loss'), '.4f')}; "
            f"median step {_number(doc.get('measured_step_s'), '.3f')} s"
            + (f" (cost model {predicted:.3f} s)" if isinstance(predicted, int | float) else "")
        )
    if doc.get("resumed_from"):
        lines.append(f"resumed from {doc['resumed_from']}")
    if doc.get("checkpoint"):
        lines.append(f"last checkpoint: {doc['checkpoint']}")
    return lines


def render_result(job: Job) -> None:
    """A succeeded job's result as the local command prints it (stdout)."""
    doc = job.result
    if not isinstance(doc, dict):
        typer.echo(json.dumps(doc, indent=2))
    elif job.kind is JobKind.PLAN:
        _render_plan(job.spec, doc)
    elif job.kind is JobKind.COMPARE:
        _render_compare(doc)
    elif job.kind is JobKind.RUN:
        out().print(run_table(doc))
    elif job.kind is JobKind.TRAIN:
        for line in train_lines(doc):
            typer.echo(line)
    else:
        typer.echo(ModelProfile.from_dict(doc).text_library())
