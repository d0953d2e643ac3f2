"""PNG charts of searches and comparisons (matplotlib, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from pipeplan.agents.compare import Row, describe
from pipeplan.agents.problem import Objective, PlanResult, Problem


def draw_curve(result: PlanResult, problem: Problem, path: Path) -> None:
    """Best objective value against plan evaluations (the search's learning curve)."""
    pts = [h for h in result.history if math.isfinite(h.best)]
    cost = problem.objective is Objective.COST
    scale, unit = (1e6, "$ per million samples") if cost else (1e3, "batch time (ms)")
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.step([h.evaluations for h in pts], [h.best * scale for h in pts], where="post")
    ax.set_xlabel("plans evaluated")
    ax.set_ylabel(f"best {unit} (cost model)")
    ax.set_title(f"{result.planner}: {describe(problem)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def draw_comparison(problem: Problem, rows: Sequence[Row], path: Path) -> None:
    """A bar per planner: batch time (ms), or $ per sample for the cost objective."""
    cost = problem.objective is Objective.COST
    names = [r.planner for r in rows]
    heights = [
        0.0
        if r.result is None
        else (r.result.estimate.cost_per_sample if cost else r.result.estimate.batch_time_s * 1e3)
        for r in rows
    ]
    fig = Figure(figsize=(max(6.0, 1.1 * len(rows)), 4.0))
    ax = fig.subplots()
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
