"""Planners against the exact answer, written once for the CLI's ``compare``, the demo and
the benchmarks.

Each planner runs on one :class:`~agents.problem.Problem` and gives a :class:`Row`: its
result, or why there is none (a planner that refuses a problem does not hide the others).
The exact reference is ``brute`` (exhaustive in the cost model) when it produced a plan,
else ``dp`` (exact for the steady-state bottleneck with one device type per stage). Ratios
are objective values over the best one and over the reference's, lower is better.

Pure data in and out: no console, no files.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeplan.agents.problem import Objective, PlanResult, Problem
from pipeplan.agents.registry import PLANNERS, make_planner
from pipeplan.agents.search import Progress
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan

EXACT_PLANNERS = ("brute", "dp")
"""The planners that can serve as the exact reference, in order of preference."""


@dataclass(frozen=True)
class Entry:
    """A planner to compare, under a label (``genetic-equal`` = ``genetic`` with options)."""

    label: str
    planner: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    """One planner's outcome in a comparison: a result, or why there is none."""

    planner: str
    result: PlanResult | None = None
    error: str = ""
    search_s: float = 0.0

    @property
    def value(self) -> float:
        """The objective value, ``inf`` when the planner gave no plan."""
        return math.inf if self.result is None else self.result.value


def default_planners() -> list[str]:
    """Every registered classical baseline (the learned planners take minutes)."""
    return [n for n, target in PLANNERS.items() if target.startswith("pipeplan.agents.baselines.")]


def plan_with(entry: Entry, problem: Problem, progress: Progress | None = None) -> PlanResult:
    """The entry's planner, with its options, on ``problem``."""
    return make_planner(entry.planner, **entry.options).plan(problem, progress=progress)


def run_entry(
    entry: Entry,
    problem: Problem,
    run: Callable[[Entry, Problem], PlanResult] = plan_with,
    *,
    catch_bugs: bool = True,
) -> Row:
    """One entry's row. A domain error (refused problem, no feasible plan, bad option)
    becomes the row's reason; so does any other exception when ``catch_bugs`` (a planner's
    bug must not hide the other planners' results). A success's search time is the
    planner's own wall time (module imports, e.g. optuna, excluded)."""
    start = time.perf_counter()
    try:
        result = run(entry, problem)
    except PipeplanError as e:
        return Row(entry.label, error=str(e), search_s=time.perf_counter() - start)
    except Exception as e:
        if not catch_bugs:
            raise
        reason = f"internal error: {type(e).__name__}: {e}"
        return Row(entry.label, error=reason, search_s=time.perf_counter() - start)
    return Row(entry.label, result, search_s=result.wall_time_s)


def run_comparison(
    problem: Problem,
    entries: Sequence[Entry],
    run: Callable[[Entry, Problem], PlanResult] = plan_with,
    *,
    catch_bugs: bool = True,
) -> list[Row]:
    """Each entry on ``problem``, in order (:func:`run_entry`)."""
    return [run_entry(e, problem, run, catch_bugs=catch_bugs) for e in entries]


def fixed_plan_row(label: str, problem: Problem, make: Callable[[Problem], Plan]) -> Row:
    """A baseline that builds its plan without searching (e.g. TAPP's every-device ones),
    as a row: simulated, scored, one evaluation per allowed microbatch size it tried."""
    start = time.perf_counter()
    try:
        plan = make(problem)
    except PipeplanError as e:
        return Row(label, error=str(e), search_s=time.perf_counter() - start)
    est = simulate(plan, problem.profile, problem.cluster)
    seconds = time.perf_counter() - start
    evaluations = len(problem.microbatch_sizes())
    result = PlanResult(plan, est, problem.score_estimate(est), (), evaluations, seconds, label)
    return Row(label, result, search_s=seconds)


def ratio(a: float, b: float) -> float:
    """``a / b``, with ``0 / 0 = 1`` (both free) and ``a / 0 = inf``."""
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


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
    to_best = {n: ratio(v, best) for n, v in values.items()}
    to_exact = {} if ref is None else {n: ratio(v, ref.value) for n, v in values.items()}
    return to_best, to_exact


def describe(problem: Problem) -> str:
    """``alexnet on cloud-mix, batch 64, cost at >= 1000 samples/s``."""
    p = problem
    goal = p.objective.value
    if p.objective is Objective.COST:
        goal += f" at >= {p.min_throughput:g} samples/s"
    return f"{p.profile.name} on {p.cluster.name}, batch {p.global_batch}, {goal}"


def row_doc(row: Row, to_best: dict[str, float], to_exact: dict[str, float]) -> dict[str, Any]:
    """One row as JSON: the plan and its estimate's figures, or the error."""
    doc: dict[str, Any] = {"planner": row.planner, "ok": row.result is not None}
    if row.result is None:
        doc["error"] = row.error
    else:
        est = row.result.estimate
        doc |= {
            "value": row.result.value,
            "batch_time_s": est.batch_time_s,
            "throughput": est.throughput,
            "cost_per_sample": est.cost_per_sample,
            "fits": est.fits,
            "evaluations": row.result.evaluations,
            "ratio_to_best": to_best[row.planner],
            "ratio_to_exact": to_exact.get(row.planner),
            "plan": row.result.plan.to_dict(),
        }
    doc["search_s"] = row.search_s
    return doc


def comparison_doc(problem: Problem, rows: Sequence[Row]) -> dict[str, Any]:
    """The comparison as JSON (what ``pipeplan compare --json`` prints)."""
    to_best, to_exact = ratios(rows)
    ref = exact_reference(rows)
    best = min(to_best, key=to_best.__getitem__) if to_best else None
    return {
        "problem": describe(problem),
        "objective": problem.objective.value,
        "exact_reference": None if ref is None else ref.planner,
        "best": best,
        "results": [row_doc(r, to_best, to_exact) for r in rows],
    }
