"""``pipeplan plan`` (one planner) and ``pipeplan compare`` (several, against the exact
answer) on one problem.

``plan`` draws a progress bar on stderr (so ``--json`` keeps stdout clean) and prints the
plan's per-stage estimate; ``compare`` prints one table, with each plan's ratio to the best
and to the exact optimum when ``brute`` (preferred) or ``dp`` ran. ``plan --planner tapp
--reward measured`` trains TAPP on batch times measured on the cluster
(:mod:`service.tasks.search`: small default budgets, each evaluation is a run).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeplan.agents.compare import describe
from pipeplan.agents.problem import Budget, Objective
from pipeplan.agents.registry import PLANNERS
from pipeplan.core.plan import Schedule
from pipeplan.service.charts import draw_comparison, draw_curve
from pipeplan.service.cli.console import (
    CliError,
    ConsoleReporter,
    clean_errors,
    cluster_ref,
    debug,
    document,
    echo_json,
    out,
    say,
)
from pipeplan.service.render import (
    comparison_table,
    estimate_table,
    failure_lines,
    reference_note,
    rental_lines,
    search_line,
    totals_lines,
)
from pipeplan.service.render_runs import measured_lines
from pipeplan.service.tasks.compare import CompareRequest, compare
from pipeplan.service.tasks.plan import Planned, PlanRequest, Reward, plan

# --- options shared by both commands ----------------------------------------------------------

ClusterOpt = Annotated[str, typer.Option("--cluster", help="cluster.yaml or a preset name")]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help="zoo model name, profiled analytically")
]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="profile.json")]
InputSizeOpt = Annotated[
    int | None, typer.Option(help="input height/width (or tokens) for --model")
]
ObjectiveOpt = Annotated[
    Objective, typer.Option(help="time: fastest batch; cost: cheapest $/sample at a target")
]
MinThroughputOpt = Annotated[
    float | None,
    typer.Option(help="samples/s the cost objective must reach (required with cost)"),
]
BatchOpt = Annotated[int, typer.Option(help="global batch (samples per training step)")]
ScheduleOpt = Annotated[Schedule, typer.Option(help="pipeline schedule")]
MicrobatchesOpt = Annotated[
    int | None, typer.Option(help="fix the number of microbatches (default: planner chooses)")
]
SeedOpt = Annotated[int, typer.Option(help="planner seed")]
BudgetOpt = Annotated[
    int | None, typer.Option(help=f"most plan evaluations (default {Budget().evaluations})")
]
SecondsOpt = Annotated[
    float | None, typer.Option(help=f"most search seconds (default {Budget().seconds:g})")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]
PlannerOpt = Annotated[str, typer.Option("--planner", help=f"one of {', '.join(PLANNERS)}")]
OutputOpt = Annotated[Path | None, typer.Option("-o", "--output", help="write plan.json")]
OptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--option", "-O", help="planner option KEY=VALUE (repeatable), e.g. -O unequal=false"
    ),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        help="ppo: RLlib env runners; any other planner: cost its plans on this many Ray "
        "workers (reward parallel)"
    ),
]
IterationsOpt = Annotated[int | None, typer.Option(help="tapp/ppo: training iterations")]
CurveOpt = Annotated[
    Path | None, typer.Option(help="write the learning curve (best value vs evaluations) PNG here")
]
RewardOpt = Annotated[
    Reward,
    typer.Option(
        help="rewards from the cost model (parallel: on --workers Ray workers), or, for tapp "
        "and ppo, from real runs on the cluster (small default budget: each evaluation is a run)"
    ),
]
RepeatsOpt = Annotated[
    int, typer.Option(help="--reward measured: timed steps per plan (after 1 warm-up)")
]
AddressOpt = Annotated[
    str | None,
    typer.Option(
        help="--reward measured: run on this Ray cluster (HOST:PORT, or 'auto' for "
        "`pipeplan cluster up`'s) instead of starting one for --cluster"
    ),
]
PlannersOpt = Annotated[
    str | None,
    typer.Option(help="comma-separated planner names (default: every classical baseline)"),
]
ChartOpt = Annotated[Path | None, typer.Option(help="write a bar chart PNG here")]

# planner-specific spellings of the generic --workers / --iterations flags (--workers for
# any other planner asks for a parallel reward: reward_for_workers)
WORKERS_OPTION = {"ppo": "num_env_runners"}
ITERATIONS_OPTION = {"tapp": "iterations", "ppo": "iterations"}


@dataclass(frozen=True)
class ProblemFlags:
    """The flags both commands describe a problem with, as a request's fields."""

    cluster: str
    model: str | None
    profile: Path | None
    input_size: int | None
    objective: Objective
    min_throughput: float | None
    batch: int
    schedule: Schedule
    microbatches: int | None
    seed: int
    budget: int | None
    seconds: float | None

    def fields(self) -> dict[str, Any]:
        return {
            "cluster": cluster_ref(self.cluster),
            "model": self.model,
            "profile": document(self.profile),
            "input_size": self.input_size,
            "objective": self.objective,
            "min_throughput": self.min_throughput,
            "batch": self.batch,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "seed": self.seed,
            "budget": {"evaluations": self.budget, "seconds": self.seconds},
        }


def parse_options(
    planner: str, pairs: Sequence[str], workers: int | None, iterations: int | None
) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (values read as JSON when they parse, else as strings) plus the
    RL flags mapped to the planner's own option names."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--option: expected KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    for flag, value, table in (
        ("--workers", workers if planner in WORKERS_OPTION else None, WORKERS_OPTION),
        ("--iterations", iterations, ITERATIONS_OPTION),
    ):
        if value is None:
            continue
        if planner not in table:
            raise CliError(f"{flag}: only applies to {' and '.join(table)}, not {planner!r}")
        options[table[planner]] = value
    return options


def reward_for_workers(planner: str, reward: Reward, workers: int | None) -> Reward:
    """``--workers N`` with a planner other than ppo: its plans are costed on N Ray workers."""
    if workers is None or planner in WORKERS_OPTION:
        return reward
    if reward is Reward.MEASURED:
        raise CliError("--workers: not with --reward measured (plans run one at a time)")
    return Reward.PARALLEL


def _render_plan(done: Planned) -> None:
    est = done.result.estimate
    out().print(
        estimate_table(est, f"{done.result.planner}: {describe(done.problem)} (cost model)")
    )
    for line in [*totals_lines(est), *rental_lines(done), search_line(done)]:
        typer.echo(line)
    if done.measured is not None:
        for line in measured_lines(done.measured.to_dict(), est.batch_time_s):
            typer.echo(line)


@clean_errors
def plan_command(
    cluster: ClusterOpt,
    planner: PlannerOpt,
    model: ModelOpt = None,
    profile: ProfileOpt = None,
    input_size: InputSizeOpt = None,
    objective: ObjectiveOpt = Objective.TIME,
    min_throughput: MinThroughputOpt = None,
    batch: BatchOpt = 64,
    schedule: ScheduleOpt = Schedule.GPIPE,
    microbatches: MicrobatchesOpt = None,
    seed: SeedOpt = 0,
    budget: BudgetOpt = None,
    seconds: SecondsOpt = None,
    output: OutputOpt = None,
    as_json: JsonOpt = False,
    option: OptionOpt = None,
    workers: WorkersOpt = None,
    iterations: IterationsOpt = None,
    curve: CurveOpt = None,
    reward: RewardOpt = Reward.SIMULATED,
    repeats: RepeatsOpt = 3,
    address: AddressOpt = None,
) -> None:
    """Search a plan with one planner; print its per-stage estimate."""
    flags = ProblemFlags(cluster, model, profile, input_size, objective, min_throughput,
                         batch, schedule, microbatches, seed, budget, seconds)  # fmt: skip
    options = parse_options(planner, option or [], workers, iterations)
    reward = reward_for_workers(planner, reward, workers)
    request = PlanRequest(
        **flags.fields(), planner=planner, options=options, reward=reward, repeats=repeats,
        address=address, workers=workers if reward is Reward.PARALLEL else None,
    )  # fmt: skip
    done = plan(request, ConsoleReporter(objective))
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
def compare_command(
    cluster: ClusterOpt,
    planners: PlannersOpt = None,
    model: ModelOpt = None,
    profile: ProfileOpt = None,
    input_size: InputSizeOpt = None,
    objective: ObjectiveOpt = Objective.TIME,
    min_throughput: MinThroughputOpt = None,
    batch: BatchOpt = 64,
    schedule: ScheduleOpt = Schedule.GPIPE,
    microbatches: MicrobatchesOpt = None,
    seed: SeedOpt = 0,
    budget: BudgetOpt = None,
    seconds: SecondsOpt = None,
    as_json: JsonOpt = False,
    chart: ChartOpt = None,
) -> None:
    """Run several planners on one problem; one table of their plans side by side."""
    flags = ProblemFlags(cluster, model, profile, input_size, objective, min_throughput,
                         batch, schedule, microbatches, seed, budget, seconds)  # fmt: skip
    names = None if planners is None else planners.split(",")
    request = CompareRequest(**flags.fields(), planners=names)
    done = compare(request, ConsoleReporter(objective), catch_bugs=not debug())
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
