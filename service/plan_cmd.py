"""``pipeplan plan`` and ``pipeplan compare``: run planners on one problem.

``plan`` runs one planner with a progress bar (on stderr, so ``--json`` keeps stdout clean)
and prints the plan's per-stage estimate; ``compare`` runs several on the same problem and
prints one table, with each plan's ratio to the best and to the exact optimum when ``brute``
(preferred) or ``dp`` ran. A planner that fails in ``compare`` gets a row with its reason.

``plan --planner tapp --reward measured`` trains TAPP on measured batch times: every plan it
samples runs on a local cluster for ``--cluster`` (or ``--address``), ``--repeats`` steps
after one warm-up, averaged (:mod:`executor.reward`). Each evaluation takes seconds, so the
defaults are small (:mod:`service.run_cmd`: 3 iterations of 4 plans, at most 16 evaluations
or 900 s; ``--iterations``, ``-O batch_size=N``, ``--budget`` and ``--seconds`` change them).

``--objective cost`` needs ``--min-throughput``: without a target the cheapest plan per
sample is usually one cheap device, seldom what anyone means to rent; give
``--min-throughput 0`` to ask for exactly that.

This module imports :mod:`service.cli` only inside functions, so either module may be
imported first; :func:`register` adds the commands to the CLI's app.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from agents.problem import Budget, Objective, PlanResult, Problem
from agents.registry import PLANNERS, make_planner
from agents.search import Progress
from core.errors import PipeplanError
from core.plan import Schedule
from core.profile import ModelProfile

EXACT_PLANNERS = ("brute", "dp")  # in order of preference as the exact reference
NOTE_WIDTH = 48  # of the table's note column

# --- options shared by both commands ----------------------------------------------------------

ModelOpt = Annotated[
    str | None, typer.Option("--model", help="zoo model name, profiled analytically")
]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="profile.json")]
InputSizeOpt = Annotated[
    int | None, typer.Option(help="input height/width (or tokens) for --model")
]
ClusterOpt = Annotated[str, typer.Option("--cluster", help="cluster.yaml or a preset name")]
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


class Reward(StrEnum):
    simulated = "simulated"
    measured = "measured"


def register(app: typer.Typer) -> None:
    """Add ``plan`` and ``compare`` to the CLI."""
    from service.cli import clean_errors

    app.command("plan")(clean_errors(plan_command))
    app.command("compare")(clean_errors(compare_command))


# --- the problem ---------------------------------------------------------------------------------


def build_problem(
    model: str | None,
    profile: Path | None,
    input_size: int | None,
    cluster: str,
    objective: Objective,
    min_throughput: float | None,
    batch: int,
    schedule: Schedule,
    microbatches: int | None,
    seed: int,
    budget: int | None,
    seconds: float | None,
) -> Problem:
    """The problem the options describe. The options' own checks and the cluster come before
    profiling (a zoo model takes seconds); :class:`Problem` checks the rest."""
    from service.cli import CliError, load_cluster

    if (model is None) == (profile is None):
        raise CliError("give exactly one of --model NAME or --profile FILE")
    if input_size is not None and model is None:
        raise CliError("--input-size: only applies with --model")
    if objective is Objective.COST and min_throughput is None:
        raise CliError(
            "--min-throughput: required with --objective cost (samples/s to reach; "
            "0 asks for the cheapest plan per sample at any speed)"
        )
    spec = load_cluster(cluster)
    default = Budget()
    limits = Budget(
        evaluations=default.evaluations if budget is None else budget,
        seconds=default.seconds if seconds is None else seconds,
    )
    if model is not None:
        prof = _zoo_profile(model, input_size)
    elif profile is not None:
        prof = ModelProfile.load(profile)
    return Problem(
        profile=prof,
        cluster=spec,
        objective=objective,
        global_batch=batch,
        schedule=schedule,
        microbatches=microbatches,
        min_throughput=min_throughput,
        seed=seed,
        budget=limits,
    )


def _zoo_profile(model: str, input_size: int | None) -> ModelProfile:
    """A zoo model profiled analytically (FLOPs and sizes; layer times from device FLOP/s)."""
    from models import profiler, zoo
    from service.cli import err

    with err.status(f"profiling {model} (analytic)"):
        module, example = zoo.build(model, input_size)
        return profiler.profile_model(module, example, name=model, device_type=None)


# --- progress ---------------------------------------------------------------------------------


def format_value(value: float, objective: Objective) -> str:
    """An objective value for people: ms per batch, or $ per sample."""
    if not math.isfinite(value):
        return "none feasible yet"
    if objective is Objective.COST:
        return f"${value:.3e}/sample"
    return f"{value * 1e3:.3f} ms/batch"


@contextmanager
def progress_bar(label: str, problem: Problem) -> Iterator[Progress]:
    """A transient rich bar on stderr: evaluations (of the budget) and the best value.

    Drawn only when stderr is a terminal (in a pipe or a log it would leave blank lines).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from service.cli import err

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed} evaluations"),
        TextColumn("best {task.fields[best]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(label, total=problem.budget.evaluations, best="-")

        def update(evaluations: int, best: float) -> None:
            bar.update(task, completed=evaluations, best=format_value(best, problem.objective))

        yield update


def run_planner(name: str, problem: Problem, **options: Any) -> PlanResult:
    with progress_bar(name, problem) as update:
        return make_planner(name, **options).plan(problem, progress=update)


# planner-specific spellings of the generic --workers / --iterations flags
WORKERS_OPTION = {"tapp": "workers", "ppo": "num_env_runners"}
ITERATIONS_OPTION = {"tapp": "iterations", "ppo": "iterations"}


def planner_options(
    planner: str, pairs: Sequence[str], workers: int | None, iterations: int | None
) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (values read as JSON when they parse, else as strings) plus the
    RL flags mapped to the planner's own option names."""
    from service.cli import CliError

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--option: expected KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
        if isinstance(options[key], list):
            options[key] = tuple(options[key])
    for flag, value, table in (
        ("--workers", workers, WORKERS_OPTION),
        ("--iterations", iterations, ITERATIONS_OPTION),
    ):
        if value is None:
            continue
        if planner not in table:
            raise CliError(f"{flag}: only applies to {' and '.join(table)}, not {planner!r}")
        options[table[planner]] = value
    return options


def draw_curve(result: PlanResult, problem: Problem, path: Path) -> None:
    """Best objective value against plan evaluations (the search's learning curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [h for h in result.history if math.isfinite(h.best)]
    scale, unit = (
        (1e6, "$ per million samples")
        if problem.objective is Objective.COST
        else (1e3, "batch time (ms)")
    )
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step([h.evaluations for h in pts], [h.best * scale for h in pts], where="post")
    ax.set_xlabel("plans evaluated")
    ax.set_ylabel(f"best {unit} (cost model)")
    ax.set_title(f"{result.planner}: {describe(problem)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def describe(problem: Problem) -> str:
    p = problem
    goal = p.objective.value
    if p.objective is Objective.COST:
        goal += f" at >= {p.min_throughput:g} samples/s"
    return f"{p.profile.name} on {p.cluster.name}, batch {p.global_batch}, {goal}"


# --- plan ---------------------------------------------------------------------------------------


def plan_command(
    cluster: ClusterOpt,
    planner: Annotated[str, typer.Option("--planner", help=f"one of {', '.join(PLANNERS)}")],
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
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write plan.json")] = None,
    as_json: JsonOpt = False,
    option: Annotated[
        list[str] | None,
        typer.Option(
            "--option", "-O", help="planner option KEY=VALUE (repeatable), e.g. -O unequal=false"
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="tapp/ppo: parallel Ray workers for sampling and evaluation")
    ] = None,
    iterations: Annotated[int | None, typer.Option(help="tapp/ppo: training iterations")] = None,
    curve: Annotated[
        Path | None,
        typer.Option(help="write the learning curve (best value vs evaluations) PNG here"),
    ] = None,
    reward: Annotated[
        Reward,
        typer.Option(
            help="tapp: rewards from the cost model, or from real runs on the cluster "
            "(small default budget: each evaluation is a run)"
        ),
    ] = Reward.simulated,
    repeats: Annotated[
        int, typer.Option(help="--reward measured: timed steps per plan (after 1 warm-up)")
    ] = 3,
    address: Annotated[
        str | None,
        typer.Option(
            help="--reward measured: run on this Ray cluster (HOST:PORT, or 'auto' for "
            "`pipeplan cluster up`'s) instead of starting one for --cluster"
        ),
    ] = None,
) -> None:
    """Search a plan with one planner; print its per-stage estimate."""
    from service.cli import CliError, err, out
    from service.render import estimate_table, totals_lines

    if planner not in PLANNERS:
        raise CliError(f"--planner: unknown planner {planner!r} (one of {', '.join(PLANNERS)})")
    if reward is Reward.measured and planner != "tapp":
        raise CliError(f"--reward measured: only applies to tapp, not {planner!r}")
    if reward is Reward.simulated and address is not None:
        raise CliError("--address: only applies with --reward measured")
    problem = build_problem(
        model,
        profile,
        input_size,
        cluster,
        objective,
        min_throughput,
        batch,
        schedule,
        microbatches,
        seed,
        budget,
        seconds,
    )
    options = planner_options(planner, option or [], workers, iterations)
    measured = None
    if reward is Reward.measured:
        from service.run_cmd import measured_problem, model_source, plan_tapp_measured

        source = model_source(model, input_size, None if model else problem.profile)
        problem = measured_problem(problem, budget, seconds)
        measured = plan_tapp_measured(
            problem, source, options, repeats=repeats, warmup=1, address=address
        )
        result = measured.result
    else:
        result = run_planner(planner, problem, **options)
    if curve is not None:
        draw_curve(result, problem, curve)
        err.print(f"wrote {curve}", markup=False, highlight=False)
    if output is not None:
        result.plan.save(output)
        err.print(f"wrote {output}", markup=False, highlight=False)
    if as_json:
        doc = {
            "plan": result.plan.to_dict(),
            "estimate": result.estimate.to_dict(),
            "planner": result.planner,
            "evaluations": result.evaluations,
            "wall_time_s": result.wall_time_s,
        }
        if measured is not None:
            from service.run_cmd import measured_doc

            doc["reward"] = reward.value
            doc["measured"] = measured_doc(measured)
        typer.echo(json.dumps(doc, indent=2))
        return
    out().print(estimate_table(result.estimate, f"{planner}: {describe(problem)} (cost model)"))
    for line in totals_lines(result.estimate):
        typer.echo(line)
    typer.echo(
        f"search          {result.evaluations} evaluations in {result.wall_time_s:.2f} s "
        f"({planner}{', measured reward' if measured is not None else ''})"
    )
    if measured is not None:
        from service.run_cmd import measured_lines

        for line in measured_lines(measured):
            typer.echo(line)


# --- compare ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One planner's outcome in a comparison: a result, or why there is none."""

    planner: str
    result: PlanResult | None = None
    error: str = ""
    search_s: float = 0.0


def default_planners() -> list[str]:
    """Every registered classical baseline (the learned planners take minutes)."""
    return [n for n, target in PLANNERS.items() if target.startswith("agents.baselines.")]


def parse_planners(text: str | None) -> list[str]:
    from service.cli import CliError

    names = default_planners() if text is None else [n.strip() for n in text.split(",")]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in PLANNERS]
    if unknown or not names:
        what = f"unknown planner {unknown[0]!r}" if unknown else "no planner named"
        raise CliError(f"--planners: {what} (one of {', '.join(PLANNERS)})")
    return list(dict.fromkeys(names))


def run_comparison(
    problem: Problem, names: Sequence[str], run: Callable[[str, Problem], PlanResult]
) -> list[Row]:
    """Each planner on ``problem``; failures become rows with their reason. A success's
    search time is the planner's own wall time (module imports, e.g. optuna, excluded)."""
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            result = run(name, problem)
            rows.append(Row(name, result, search_s=result.wall_time_s))
        except PipeplanError as e:
            rows.append(Row(name, error=str(e), search_s=time.perf_counter() - start))
        except Exception as e:  # a planner's bug must not hide the other planners' results
            if os.environ.get("PIPEPLAN_DEBUG"):
                raise
            reason = f"internal error: {type(e).__name__}: {e}"
            rows.append(Row(name, error=reason, search_s=time.perf_counter() - start))
    return rows


def exact_reference(rows: Sequence[Row]) -> Row | None:
    """The successful exact planner's row: ``brute`` if it ran, else ``dp``."""
    done = {r.planner: r for r in rows if r.result is not None}
    return next((done[n] for n in EXACT_PLANNERS if n in done), None)


def ratios(rows: Sequence[Row]) -> tuple[dict[str, float], dict[str, float]]:
    """Objective value of each successful plan over the best one and over the exact one."""
    values = {r.planner: r.result.value for r in rows if r.result is not None}
    if not values:
        return {}, {}
    best = min(values.values())
    ref = exact_reference(rows)
    to_best = {n: v / best for n, v in values.items()}
    to_exact = (
        {}
        if ref is None or ref.result is None
        else {n: v / ref.result.value for n, v in values.items()}
    )
    return to_best, to_exact


def comparison_doc(problem: Problem, rows: Sequence[Row]) -> dict[str, Any]:
    to_best, to_exact = ratios(rows)
    ref = exact_reference(rows)
    results = []
    for r in rows:
        doc: dict[str, Any] = {"planner": r.planner, "ok": r.result is not None}
        if r.result is None:
            doc["error"] = r.error
        else:
            est = r.result.estimate
            doc |= {
                "value": r.result.value,
                "batch_time_s": est.batch_time_s,
                "throughput": est.throughput,
                "cost_per_sample": est.cost_per_sample,
                "fits": est.fits,
                "evaluations": r.result.evaluations,
                "ratio_to_best": to_best[r.planner],
                "ratio_to_exact": to_exact.get(r.planner),
                "plan": r.result.plan.to_dict(),
            }
        doc["search_s"] = r.search_s
        results.append(doc)
    best = min(to_best, key=to_best.__getitem__) if to_best else None
    return {
        "problem": describe(problem),
        "objective": problem.objective.value,
        "exact_reference": None if ref is None else ref.planner,
        "best": best,
        "results": results,
    }


def comparison_table(problem: Problem, rows: Sequence[Row]) -> Table:
    to_best, to_exact = ratios(rows)
    ref = exact_reference(rows)
    table = Table(title=f"{describe(problem)} (cost model)", title_justify="left")
    exact_col = f"vs {ref.planner}" if ref is not None else "vs exact"
    for col in (
        "planner",
        "batch ms",
        "samples/s",
        "$/sample",
        "memory ok",
        "search s",
        "evaluations",
        "vs best",
        exact_col,
        "note",
    ):
        if col == "note":  # a long reason is cut; failure_lines has it all
            table.add_column(col, max_width=NOTE_WIDTH)
        else:
            table.add_column(col, justify="left" if col == "planner" else "right", no_wrap=True)
    for r in rows:
        if r.result is None:
            dash = ["-"] * 4
            note = "failed: " + shorten(short_reason(r), 2 * NOTE_WIDTH)
            table.add_row(r.planner, *dash, f"{r.search_s:.2f}", *dash[:3], note)
            continue
        est, n = r.result.estimate, r.planner
        table.add_row(
            n,
            f"{est.batch_time_s * 1e3:.3f}",
            f"{est.throughput:,.1f}",
            f"{est.cost_per_sample:.3e}",
            "yes" if est.fits else "[red]NO[/red]",
            f"{r.search_s:.2f}",
            str(r.result.evaluations),
            f"{to_best[n]:.3f}",
            f"{to_exact[n]:.3f}" if n in to_exact else "-",
            "best" if to_best[n] == 1.0 else "",
        )
    return table


def short_reason(row: Row) -> str:
    """The reason without the planner/problem prefix the table already shows."""
    name = re.escape(row.planner)
    return re.sub(rf"^(planner '{name}'|{name})( on [^:]*)?: ", "", row.error)


def failure_lines(rows: Sequence[Row]) -> list[str]:
    return [f"{r.planner} failed: {r.error}" for r in rows if r.result is None]


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1].rstrip() + "\u2026"


def reference_note(rows: Sequence[Row]) -> str:
    ref = exact_reference(rows)
    if ref is None:
        return "no exact reference: neither brute nor dp produced a plan"
    if ref.planner == "brute":
        return "vs brute: ratio to the exact optimum (exhaustive search in the cost model)"
    return (
        "vs dp: ratio to dp, exact for the steady-state bottleneck with one device type per "
        "stage; below 1 means a plan beat it in the full cost model"
    )


def draw_comparison(problem: Problem, rows: Sequence[Row], path: Path) -> None:
    """A bar per planner: batch time (ms), or $ per sample for the cost objective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost = problem.objective is Objective.COST
    names = [r.planner for r in rows]
    heights = [
        0.0
        if r.result is None
        else (r.result.estimate.cost_per_sample if cost else r.result.estimate.batch_time_s * 1e3)
        for r in rows
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.0))
    bars = ax.bar(names, heights, color=["#4C72B0" if r.result else "#cccccc" for r in rows])
    for bar, r in zip(bars, rows, strict=True):
        if r.result is None:
            ax.annotate(
                "failed",
                (bar.get_x() + bar.get_width() / 2, 0),
                ha="center",
                va="bottom",
                fontsize=8,
                color="#C44E52",
            )
    ax.set_ylabel("$ per sample" if cost else "batch time (ms)")
    ax.set_title(f"{describe(problem)} (cost model)", fontsize=10)
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_command(
    cluster: ClusterOpt,
    planners: Annotated[
        str | None,
        typer.Option(help="comma-separated planner names (default: every classical baseline)"),
    ] = None,
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
    chart: Annotated[Path | None, typer.Option(help="write a bar chart PNG here")] = None,
) -> None:
    """Run several planners on one problem; one table of their plans side by side."""
    from service.cli import err, out

    names = parse_planners(planners)
    problem = build_problem(
        model,
        profile,
        input_size,
        cluster,
        objective,
        min_throughput,
        batch,
        schedule,
        microbatches,
        seed,
        budget,
        seconds,
    )
    rows = run_comparison(problem, names, run_planner)
    if chart is not None:
        draw_comparison(problem, rows, chart)
        err.print(f"wrote {chart}", markup=False, highlight=False)
    if as_json:
        typer.echo(json.dumps(comparison_doc(problem, rows), indent=2))
        return
    out().print(comparison_table(problem, rows))
    typer.echo(reference_note(rows))
    for line in failure_lines(rows):
        typer.echo(line)
