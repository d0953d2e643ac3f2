"""Book-keeping shared by every planner: evaluations, budget, best plan, history.

A planner proposes populations (:class:`core.batch_eval.PlanBatch`) and :class:`Search`
costs them through the vectorised cost model, scores them for the problem's objective,
keeps the best feasible plan and the history, and knows when the budget is spent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agents.problem import HistoryPoint, InfeasibleError, Objective, PlanResult, Problem
from core.batch_eval import BatchEvaluator, PlanBatch
from core.costmodel import simulate
from core.plan import Plan

Progress = Callable[[int, float], None]  # (evaluations so far, best value so far)


class Search:
    """One planner run on one problem."""

    def __init__(
        self,
        problem: Problem,
        planner: str,
        options: dict[str, Any],
        progress: Progress | None = None,
    ) -> None:
        self.problem, self.planner, self.options = problem, planner, options
        self.evaluator = BatchEvaluator(problem.profile, problem.cluster)
        self.progress = progress
        self.start = time.perf_counter()
        self.evaluations = 0
        self.best_value = float("inf")
        self.best_plan: Plan | None = None
        self.history: list[HistoryPoint] = []
        self._min_memory_ratio = float("inf")
        self._best_fitting_throughput = 0.0

    # --- budget --------------------------------------------------------------------------

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def remaining_evaluations(self) -> int | None:
        cap = self.problem.budget.evaluations
        return None if cap is None else max(cap - self.evaluations, 0)

    def exhausted(self) -> bool:
        b = self.problem.budget
        return (b.evaluations is not None and self.evaluations >= b.evaluations) or (
            b.seconds is not None and self.elapsed >= b.seconds
        )

    # --- evaluation ----------------------------------------------------------------------

    def evaluate(self, batch: PlanBatch) -> np.ndarray:
        """Objective values of a population (lower is better, ``inf`` = infeasible)."""
        p = self.problem
        res = self.evaluator.evaluate(batch, p.global_batch, p.schedule)
        values = p.score(res.batch_time_s, res.fits, res.cost_per_hour)
        self.evaluations += batch.size
        self._min_memory_ratio = min(self._min_memory_ratio, float(res.memory_ratio.min()))
        if res.fits.any():
            tp = float(res.throughput[res.fits].max())
            self._best_fitting_throughput = max(self._best_fitting_throughput, tp)
        i = int(np.argmin(values))
        if values[i] < self.best_value:
            self.best_value = float(values[i])
            self.best_plan = batch.plan(i, p.cluster, p.global_batch, p.schedule)
        self.history.append(HistoryPoint(self.evaluations, self.elapsed, self.best_value))
        if self.progress is not None:
            self.progress(self.evaluations, self.best_value)
        return values

    def count(self, evaluations: int) -> None:
        """Count plans costed outside :meth:`evaluate` (e.g. inside RLlib's env runners)."""
        self.evaluations += evaluations

    def evaluate_plans(self, plans: Sequence[Plan]) -> np.ndarray:
        """Objective values of plans of any stage counts (grouped by stage count)."""
        values = np.full(len(plans), np.inf)
        by_stages: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            by_stages.setdefault(plan.num_stages, []).append(i)
        for idx in by_stages.values():
            batch = PlanBatch.from_plans([plans[i] for i in idx], self.problem.cluster)
            values[idx] = self.evaluate(batch)
        return values

    # --- the answer ----------------------------------------------------------------------

    def result(self) -> PlanResult:
        """The best feasible plan found, simulated in full; or why there is none."""
        if self.best_plan is None:
            raise InfeasibleError(self.why_infeasible())
        est = simulate(self.best_plan, self.problem.profile, self.problem.cluster)
        return PlanResult(
            plan=self.best_plan,
            estimate=est,
            value=self.best_value,
            history=tuple(self.history),
            evaluations=self.evaluations,
            wall_time_s=self.elapsed,
            planner=self.planner,
            options=dict(self.options),
        )

    def why_infeasible(self) -> str:
        p = self.problem
        where = f"{self.planner} on {p.profile.name!r} / cluster {p.cluster.name!r}"
        if self.evaluations == 0:
            return f"{where}: no plan was evaluated (budget or search space empty)"
        if not np.isfinite(self._best_fitting_throughput) or self._best_fitting_throughput == 0:
            return (
                f"{where}: no plan fits in memory among {self.evaluations} evaluated; the "
                f"smallest needs {self._min_memory_ratio:.2f}x a device's memory "
                "(use more stages/devices or smaller microbatches)"
            )
        if p.objective is Objective.COST and p.min_throughput:
            return (
                f"{where}: no plan reaches min_throughput {p.min_throughput:g} samples/s; the "
                f"best that fits in memory reaches {self._best_fitting_throughput:.4g} samples/s"
            )
        return f"{where}: no feasible plan among {self.evaluations} evaluated"
