"""``pipeplan plan`` (one planner) and ``pipeplan compare`` (several, against the exact
answer) on one problem.

``plan`` draws a progress bar on stderr (so ``--json`` keeps stdout clean) and prints the
plan's per-stage estimate; ``compare`` prints one table, with each plan's ratio to the best
and to the exact optimum when ``brute`` (preferred) or ``dp`` ran. ``plan --planner tapp
--reward measured`` trains TAPP on batch times measured on the cluster
(:mod:`service.tasks.search`: small default budgets, each evaluation is a run); ``--policy
FILE`` starts TAPP from a saved policy (its ``pretrained`` option).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeplan.agents.compare import describe
from pipeplan.agents.registry import PLANNERS
from pipeplan.core.bounds import lower_bound
from pipeplan.service.charts import draw_comparison, draw_curve
from pipeplan.service.cli.console import ConsoleReporter, clean_errors, debug, echo_json, out, say
from pipeplan.service.cli.options import (
    IterationsOpt,
    JsonOpt,
    OptionOpt,
    PlannersOpt,
    PolicyOpt,
    ProblemFlags,
    RepeatsOpt,
    RewardOpt,
    WorkersOpt,
    check_policy,
    parse_options,
    problem_options,
    reward_for_workers,
)
from pipeplan.service.render import (
    bound_lines,
    comparison_table,
    estimate_table,
    failure_lines,
    measured_lines,
    reference_note,
    rental_lines,
    search_line,
    totals_lines,
)
from pipeplan.service.tasks.compare import CompareRequest, compare
from pipeplan.service.tasks.plan import Planned, PlanRequest, Reward, plan

PlannerOpt = Annotated[str, typer.Option("--planner", help=f"one of {', '.join(PLANNERS)}")]
OutputOpt = Annotated[Path | None, typer.Option("-o", "--output", help="write plan.json")]
CurveOpt = Annotated[
    Path | None, typer.Option(help="write the learning curve (best value vs evaluations) PNG here")
]
AddressOpt = Annotated[
    str | None,
    typer.Option(
        help="--reward measured: run on this Ray cluster (HOST:PORT, or 'auto' for "
        "`pipeplan cluster up`'s) instead of starting one for --cluster"
    ),
]
ChartOpt = Annotated[Path | None, typer.Option(help="write a bar chart PNG here")]


def _render_plan(done: Planned) -> None:
    est = done.result.estimate
    out().print(
        estimate_table(est, f"{done.result.planner}: {describe(done.problem)} (cost model)")
    )
    p = done.problem
    bound = lower_bound(p.profile, p.cluster, p.global_batch, p.schedule).to_dict()
    bounds = bound_lines(bound, est.batch_time_s)
    for line in [*totals_lines(est), *bounds, *rental_lines(done), search_line(done)]:
        typer.echo(line)
    if done.measured is not None:
        for line in measured_lines(done.measured.to_dict(), est.batch_time_s):
            typer.echo(line)


@clean_errors
@problem_options()
def plan_command(
    planner: PlannerOpt,
    problem: ProblemFlags,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
    option: OptionOpt = None,
    workers: WorkersOpt = None,
    iterations: IterationsOpt = None,
    curve: CurveOpt = None,
    reward: RewardOpt = Reward.SIMULATED,
    repeats: RepeatsOpt = 3,
    address: AddressOpt = None,
    policy: PolicyOpt = None,
) -> None:
    """Search a plan with one planner; print its per-stage estimate."""
    if policy is not None:
        check_policy(planner, policy)
    options = parse_options(planner, option or [], workers, iterations, policy)
    reward = reward_for_workers(planner, reward, workers)
    request = PlanRequest(
        **problem.fields(), planner=planner, options=options, reward=reward, repeats=repeats,
        address=address, workers=workers if reward is Reward.PARALLEL else None,
    )  # fmt: skip
    done = plan(request, ConsoleReporter(problem.objective))
    if curve is not None:
        draw_curve(done.result, done.problem, curve)
        say(f"wrote {curve}")
    if output is not None:
        done.result.plan.save(output)
        say(f"wrote {output}")
    if as_json:
        echo_json(done.to_dict())
    else:
        _render_plan(done)


@clean_errors
@problem_options()
def compare_command(
    problem: ProblemFlags,
    planners: PlannersOpt = None,
    as_json: JsonOpt = False,
    chart: ChartOpt = None,
) -> None:
    """Run several planners on one problem; one table of their plans side by side."""
    names = None if planners is None else planners.split(",")
    request = CompareRequest(**problem.fields(), planners=names)
    done = compare(request, ConsoleReporter(problem.objective), catch_bugs=not debug())
    if chart is not None:
        draw_comparison(done.problem, done.rows, chart)
        say(f"wrote {chart}")
    if as_json:
        echo_json(done.to_dict())
        return
    out().print(comparison_table(done.problem, done.rows))
    for line in [reference_note(done.rows), *failure_lines(done.rows)]:
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
    app.command("compare")(compare_command)
