"""``pipeplan provision``: what to rent from a catalogue -- the cheapest per sample at a
throughput target (``--objective cost``) or the fastest within a budget (``--objective
throughput``) -- as the rental table (nodes by kind, devices by type, prices) and the Pareto
front of $/hour against throughput (a table, and a PNG with ``--out``). With ``--apply``, the
rental's deployment is written into ``--out`` instead (:mod:`service.tasks.apply`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from matplotlib.figure import Figure
from rich.table import Table

from pipeplan.agents.problem import Objective
from pipeplan.service.cli.console import (
    CliError,
    ConsoleReporter,
    clean_errors,
    cluster_ref,
    echo_json,
    out,
    say,
)
from pipeplan.service.cli.options import (
    JsonOpt,
    OptionOpt,
    ProblemFlags,
    parse_options,
    problem_options,
)
from pipeplan.service.render import estimate_table, rental_lines, totals_lines
from pipeplan.service.tasks.apply import RentalRenderRequest
from pipeplan.service.tasks.deploy import DeployTarget
from pipeplan.service.tasks.provision import FrontPoint, Provisioned, ProvisionRequest, provision

ObjectiveOpt = Annotated[
    Objective,
    typer.Option(
        help="cost: cheapest $/sample at --min-throughput; throughput: most samples/s within "
        "--max-price"
    ),
]
TargetOpt = Annotated[
    float | None, typer.Option("--min-throughput", help="cost: samples/s to reach")
]
MaxPriceOpt = Annotated[
    float | None,
    typer.Option("--max-price", help="throughput: most $/hour for the rented nodes in full"),
]
PlannerOpt = Annotated[str, typer.Option("--planner", help="the planner answering each target")]
TargetsOpt = Annotated[
    int,
    typer.Option(
        help="cost: targets in the sweep (the front); throughput: most targets the budget "
        "search asks about"
    ),
]
SpreadOpt = Annotated[
    float, typer.Option(help="the sweep runs from min-throughput / spread to x spread")
]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out", help="the front as a PNG here; with --apply, the folder the deployment goes into"
    ),
]
ApplyOpt = Annotated[
    DeployTarget | None,
    typer.Option(
        "--apply",
        help="write the rental's deployment into --out: k8s (RayCluster + spec), compose "
        "(Ray nodes + spec) or all (OUT/k8s and OUT/compose)",
    ),
]
AutoscaleOpt = Annotated[
    bool,
    typer.Option(
        "--autoscale",
        help="with --apply k8s: in-tree autoscaling, each group from its rented count up to "
        "the catalogue's count",
    ),
]
ScaleToZeroOpt = Annotated[
    bool,
    typer.Option("--scale-to-zero", help="with --autoscale: each group's minReplicas is 0"),
]


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


def apply_request(
    cluster: str, apply: DeployTarget | None, folder: Path | None, autoscale: bool, zero: bool
) -> RentalRenderRequest | None:
    """``--apply`` and its flags as the request's ``apply``, checked before any search."""
    if apply is None:
        for flag, given in (("--autoscale", autoscale), ("--scale-to-zero", zero)):
            if given:
                raise CliError(f"{flag}: only applies with --apply k8s (or all)")
        return None
    if folder is None:
        raise CliError(f"--apply {apply.value}: needs --out, the folder to write into")
    if folder.exists() and not folder.is_dir():
        raise CliError(f"--out: {str(folder)!r} is a file; --apply writes a folder")
    fields = {"spec": cluster_ref(cluster), "target": apply, "autoscale": autoscale}
    return RentalRenderRequest.model_validate(fields | {"scale_to_zero": zero})


def write_rendered(done: Provisioned, folder: Path) -> None:
    """Write the rendered deployment under ``folder``; say what, then each path."""
    if done.rendered is None or done.planned.rental is None:
        return
    written = done.rendered.write(folder)
    kinds = ", ".join(f"{k} x{n}" for k, n in done.planned.rental.nodes.items())
    say(f"rental {kinds}: wrote {len(written)} files under {folder}")
    for path in written:
        say(str(path))


@clean_errors
@problem_options(
    declare={"objective": (ObjectiveOpt, Objective.COST), "min_throughput": (TargetOpt, None)}
)
def provision_command(
    problem: ProblemFlags,
    max_price: MaxPriceOpt = None,
    planner: PlannerOpt = "provision_dp",
    targets: TargetsOpt = 8,
    spread: SpreadOpt = 4.0,
    option: OptionOpt = None,
    out_path: OutOpt = None,
    apply: ApplyOpt = None,
    autoscale: AutoscaleOpt = False,
    scale_to_zero: ScaleToZeroOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """What to rent for a throughput or a budget, the price front; --apply deploys it.

    The cheapest rental per sample at --min-throughput (cost), or the fastest within
    --max-price (throughput); the price/throughput front; with --apply, the rental's
    KubeRay or Compose deployment written into --out."""
    deploy = apply_request(problem.cluster, apply, out_path, autoscale, scale_to_zero)
    request = ProvisionRequest(
        **problem.fields(), planner=planner, max_price_per_hour=max_price,
        options=parse_options(planner, option or [], None, None), targets=targets, spread=spread,
        apply=deploy,
    )  # fmt: skip
    done = provision(request, ConsoleReporter(Objective.COST))  # every answer is a cost search
    if out_path is not None and deploy is not None:
        write_rendered(done, out_path)
    elif out_path is not None:
        draw_front(done.front, out_path)
        say(f"wrote {out_path}")
    if as_json:
        echo_json(done.to_dict())
        return
    est = done.planned.result.estimate
    out().print(estimate_table(est, f"{planner}: {goal(request)}"))
    out().print(rental_table(done))
    for line in [*totals_lines(est), *rental_lines(done.planned)]:
        typer.echo(line)
    out().print(front_table(done.front))


def goal(request: ProvisionRequest) -> str:
    """What the rental answers, for a table's title."""
    if request.objective is Objective.THROUGHPUT:
        return f"fastest plan within ${request.max_price_per_hour:,.2f}/h"
    return f"plan at >= {request.min_throughput:,.1f} samples/s"


def register(app: typer.Typer) -> None:
    app.command("provision")(provision_command)
