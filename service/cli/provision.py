"""``pipeplan provision``: what to rent from a catalogue for a throughput target -- the rental
table (nodes by kind, devices by type, prices) and the Pareto front of $/hour against
throughput over a sweep of targets (a table, and a PNG with ``--out``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from matplotlib.figure import Figure
from rich.table import Table

from pipeplan.agents.problem import Objective
from pipeplan.service.cli.console import ConsoleReporter, clean_errors, echo_json, out, say
from pipeplan.service.cli.options import (
    REQUIRED,
    JsonOpt,
    OptionOpt,
    ProblemFlags,
    parse_options,
    problem_options,
)
from pipeplan.service.render import estimate_table, rental_lines, totals_lines
from pipeplan.service.tasks.provision import FrontPoint, Provisioned, ProvisionRequest, provision

TargetOpt = Annotated[float, typer.Option("--min-throughput", help="samples/s to reach")]
PlannerOpt = Annotated[str, typer.Option("--planner", help="the planner answering each target")]
TargetsOpt = Annotated[int, typer.Option(help="targets in the sweep (the front)")]
SpreadOpt = Annotated[
    float, typer.Option(help="the sweep runs from min-throughput / spread to x spread")
]
OutOpt = Annotated[Path | None, typer.Option("--out", help="write the front as a PNG here")]


def rental_table(done: Provisioned) -> Table:
    hired = done.planned.rental
    table = Table(title="rental", title_justify="left")
    for col in ("node kind", "nodes", "devices each", "$/h each"):
        table.add_column(col, justify="left" if col == "node kind" else "right")
    cluster = done.planned.problem.cluster
    first = {n.kind or n.name: n for n in reversed(cluster.nodes)}
    for kind, count in (hired.nodes if hired else {}).items():
        node = first[kind]
        price = sum(c * cluster.device_types[t].price_per_hour for t, c in node.devices.items())
        devices = ", ".join(f"{t} x{c}" for t, c in node.devices.items())
        table.add_row(kind, str(count), devices, f"{price:.3f}")
    return table


def front_table(points: tuple[FrontPoint, ...]) -> Table:
    table = Table(title="Pareto front: $/hour against throughput", title_justify="left")
    for col in ("target /s", "throughput /s", "$/hour", "$/sample", "rental", "front"):
        table.add_column(col, justify="left" if col == "rental" else "right")
    for p in points:
        r = p.rental
        if r is None:
            table.add_row(f"{p.target:,.1f}", "-", "-", "-", "no plan reaches it", "")
            continue
        kinds = ", ".join(f"{k} x{n}" for k, n in r.nodes.items())
        table.add_row(
            f"{p.target:,.1f}", f"{r.throughput:,.1f}", f"{r.price_per_hour:.3f}",
            f"{r.cost_per_sample:.3e}", kinds, "*" if p.on_front else "",
        )  # fmt: skip
    return table


def draw_front(points: tuple[FrontPoint, ...], path: Path) -> None:
    """$/hour against throughput: every answer as a dot, the front as a step line."""
    got = [p.rental for p in points if p.rental is not None]
    front = sorted(
        (p.rental.throughput, p.rental.price_per_hour)
        for p in points
        if p.rental is not None and p.on_front
    )
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.scatter([r.throughput for r in got], [r.price_per_hour for r in got], label="answers")
    if front:
        ax.step([x for x, _ in front], [y for _, y in front], where="post", label="Pareto front")
    ax.set_xlabel("throughput (samples/s)")
    ax.set_ylabel("$ per hour")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


@clean_errors
@problem_options(
    declare={"min_throughput": (TargetOpt, REQUIRED)}, fixed={"objective": Objective.COST}
)
def provision_command(
    problem: ProblemFlags,
    planner: PlannerOpt = "provision_dp",
    targets: TargetsOpt = 8,
    spread: SpreadOpt = 4.0,
    option: OptionOpt = None,
    out_png: OutOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """What to rent from a catalogue to reach a throughput, and the price/throughput front."""
    request = ProvisionRequest(
        **problem.fields(), planner=planner,
        options=parse_options(planner, option or [], None, None), targets=targets, spread=spread,
    )  # fmt: skip
    done = provision(request, ConsoleReporter(Objective.COST))
    if out_png is not None:
        draw_front(done.front, out_png)
        say(f"wrote {out_png}")
    if as_json:
        echo_json(done.to_dict())
        return
    est = done.planned.result.estimate
    out().print(
        estimate_table(est, f"{planner}: plan at >= {problem.min_throughput:,.1f} samples/s")
    )
    out().print(rental_table(done))
    for line in [*totals_lines(est), *rental_lines(done.planned)]:
        typer.echo(line)
    out().print(front_table(done.front))


def register(app: typer.Typer) -> None:
    app.command("provision")(provision_command)
