"""``pipeplan simulate`` (cost a plan) and ``pipeplan validate`` (check a document)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeplan.core._io import read_document
from pipeplan.core.plan import Schedule
from pipeplan.service.cli.console import clean_errors, cluster_ref, document, echo_json, out
from pipeplan.service.gantt import draw_gantt
from pipeplan.service.render import estimate_table, totals_lines
from pipeplan.service.tasks.simulate import (
    Kind,
    Simulated,
    SimulateRequest,
    UniformPlan,
    ValidateRequest,
    simulate,
    validate,
)


def _render(done: Simulated, gantt: Path | None) -> None:
    est = done.estimate
    title = f"{done.model} on {done.cluster}"
    out().print(estimate_table(est, f"{title} (cost model)"))
    for line in totals_lines(est):
        typer.echo(line)
    if gantt is not None:
        typer.echo(f"Gantt chart: {gantt}")


@clean_errors
def simulate_command(
    profile: Annotated[Path, typer.Option("--profile", help="profile.json")],
    cluster: Annotated[str, typer.Option("--cluster", help="cluster.yaml or a preset name")],
    plan: Annotated[Path | None, typer.Option("--plan", help="plan.json")] = None,
    uniform: Annotated[
        int | None,
        typer.Option(help="instead of --plan: equal layer counts over the first N devices"),
    ] = None,
    batch: Annotated[int, typer.Option(help="global batch for --uniform")] = 64,
    microbatches: Annotated[int, typer.Option(help="microbatches for --uniform")] = 8,
    schedule: Annotated[Schedule, typer.Option(help="schedule for --uniform")] = Schedule.GPIPE,
    as_json: Annotated[bool, typer.Option("--json", help="print the Estimate as JSON")] = False,
    gantt: Annotated[Path | None, typer.Option(help="draw the schedule to this PNG")] = None,
    save_plan: Annotated[Path | None, typer.Option(help="write the --uniform plan here")] = None,
) -> None:
    """Cost a plan with the cost model: per-stage table, totals, optional Gantt chart."""
    request = SimulateRequest(
        profile=read_document(profile),
        cluster=cluster_ref(cluster),
        plan=document(plan),
        uniform=None
        if uniform is None
        else UniformPlan(
            devices=uniform, batch=batch, microbatches=microbatches, schedule=schedule
        ),
    )
    done = simulate(request)
    if save_plan is not None:
        done.plan.save(save_plan)
    if gantt is not None:
        cost = f"{done.estimate.batch_time_s * 1e3:.2f} ms per batch (cost model)"
        draw_gantt(done.estimate, gantt, title=f"{done.model} on {done.cluster}: {cost}")
    if as_json:
        echo_json(done.to_dict())
        return
    _render(done, gantt)


@clean_errors
def validate_command(
    file: Annotated[Path, typer.Argument(help="a profile, cluster or plan file")],
    kind: Annotated[Kind, typer.Option(help="what the file is")] = Kind.AUTO,
    profile: Annotated[Path | None, typer.Option(help="check a plan against this")] = None,
    cluster: Annotated[str | None, typer.Option(help="check a plan against this")] = None,
) -> None:
    """Check a profile, cluster or plan file; with --profile/--cluster, a plan against them."""
    request = ValidateRequest(
        document=read_document(file),
        kind=kind,
        profile=document(profile),
        cluster=cluster_ref(cluster) if cluster is not None else None,
    )
    typer.echo(f"ok: {file}: {validate(request).summary}")


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_command)
    app.command("validate")(validate_command)
