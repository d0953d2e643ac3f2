"""Book-keeping shared by every planner: evaluations, budget, best plan, history.

A planner proposes populations (:class:`core.batch_eval.PlanBatch`, or lists of plans) and
:class:`Search` values them through its reward source (:mod:`agents.rewards`; the vectorised
cost model by default). :meth:`Search.record` is the one place that writes what the search
found -- the evaluation count, the best feasible plan and its value, the history -- and tells
the observers (``progress`` and ``on_record``). The search also knows when the budget is
spent and, when nothing feasible was found, why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from pipeplan.agents.problem import HistoryPoint, InfeasibleError, Objective, PlanResult, Problem
from pipeplan.agents.rewards import Population, Rewards, RewardSource, SimulatedReward
from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan

Progress = Callable[[int, float], None]
"""Called after each recorded population: (evaluations so far, best value so far)."""
OnRecord = Callable[[Population, np.ndarray], None]
"""Called after each recorded population with its plans and their values (turn a
``PlanBatch`` into plans with :func:`agents.rewards.plans_of` where needed)."""

MAX_REASONS = 3
"""Reasons of failed evaluations quoted when a search found nothing feasible."""


class Search:
    """One planner run on one problem, valued by one reward source."""

    def __init__(
        self,
        problem: Problem,
        planner: str,
        options: dict[str, Any],
        progress: Progress | None = None,
        *,
        reward: RewardSource | None = None,
        on_record: OnRecord | None = None,
    ) -> None:
        self.problem, self.planner, self.options = problem, planner, options
        self.reward: RewardSource = SimulatedReward() if reward is None else reward
        self.evaluator = (
            self.reward.evaluator(problem)
            if isinstance(self.reward, SimulatedReward)
            else BatchEvaluator(problem.profile, problem.cluster)
        )
        """The cost model, for planners that reason with it (not for values: those come
        from :attr:`reward`)."""
        self.progress, self.on_record = progress, on_record
        self.start = time.perf_counter()
        self.evaluations = 0
        self.best_value = float("inf")
        self.best_plan: Plan | None = None
        self.history: list[HistoryPoint] = []
        self._min_memory_ratio: float | None = None  # None: the source does not say
        self._min_recompute_ratio: float | None = None  # the same, recomputing where it helps
        self._best_fitting_throughput = 0.0
        self._errors: dict[str, None] = {}  # reasons of failed evaluations, first seen first

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
        """Objective values of a population (lower is better, ``inf`` = infeasible),
        from the reward source, recorded."""
        rewards = self.reward.evaluate(self.problem, batch)
        rewards.check(self.reward.name, batch.size)
        self._note(rewards)
        self.record(batch, rewards.values)
        return rewards.values

    def evaluate_plans(self, plans: Sequence[Plan]) -> np.ndarray:
        """Objective values of plans of any stage counts (one population per stage count,
        in order of first appearance)."""
        values = np.full(len(plans), np.inf)
        by_stages: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            by_stages.setdefault(plan.num_stages, []).append(i)
        for idx in by_stages.values():
            batch = PlanBatch.from_plans([plans[i] for i in idx], self.problem.cluster)
            values[idx] = self.evaluate(batch)
        return values

    def record(
        self, plans: Population, values: ArrayLike, *, evaluations: int | None = None
    ) -> None:
        """Book valued plans: count ``evaluations`` (default: one per plan), keep the best
        feasible plan, add a history point and tell the observers. The only writer of
        :attr:`evaluations`, :attr:`best_plan`, :attr:`best_value` and :attr:`history`.

        ``evaluations`` larger than the plans counts plans valued elsewhere without being
        handed over (RLlib's env runners); with no plans, only the count moves.
        """
        values = np.asarray(values, dtype=np.float64)
        size = plans.size if isinstance(plans, PlanBatch) else len(plans)
        if values.shape != (size,):
            raise ValueError(f"record: values of shape {values.shape} for {size} plans")
        self.evaluations += size if evaluations is None else evaluations
        if size == 0:
            return
        i = int(np.argmin(values))
        if values[i] < self.best_value:
            self.best_value = float(values[i])
            self.best_plan = self._plan(plans, i)
        self.history.append(HistoryPoint(self.evaluations, self.elapsed, self.best_value))
        if self.progress is not None:
            self.progress(self.evaluations, self.best_value)
        if self.on_record is not None:
            self.on_record(plans, values)

    def _plan(self, plans: Population, i: int) -> Plan:
        if isinstance(plans, PlanBatch):
            p = self.problem
            return plans.plan(i, p.cluster, p.global_batch, p.schedule)
        return plans[i]

    def _note(self, rewards: Rewards) -> None:
        """Keep what explains an infeasible search: memory, throughput, failed runs."""
        if rewards.memory_ratio is not None and rewards.memory_ratio.size:
            least = float(rewards.memory_ratio.min())
            known = self._min_memory_ratio
            self._min_memory_ratio = least if known is None else min(known, least)
        if rewards.recompute_ratio is not None and rewards.recompute_ratio.size:
            least = float(rewards.recompute_ratio.min())
            known = self._min_recompute_ratio
            self._min_recompute_ratio = least if known is None else min(known, least)
        if rewards.fits is not None and rewards.throughput is not None and rewards.fits.any():
            tp = float(rewards.throughput[rewards.fits].max())
            self._best_fitting_throughput = max(self._best_fitting_throughput, tp)
        self._errors.update(dict.fromkeys(rewards.errors))

    # --- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resumed search needs to go on as if never stopped (JSON-able): the count,
        the best plan and value, the history, the time spent and what explains an
        infeasible search so far."""
        return {
            "evaluations": self.evaluations,
            "best_value": self.best_value,
            "best_plan": None if self.best_plan is None else self.best_plan.to_dict(),
            "history": [[h.evaluations, h.seconds, h.best] for h in self.history],
            "elapsed_s": self.elapsed,
            "min_memory_ratio": self._min_memory_ratio,
            "min_recompute_ratio": self._min_recompute_ratio,
            "best_fitting_throughput": self._best_fitting_throughput,
            "errors": list(self._errors),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``: the clock goes on from the time it
        had spent (a ``seconds`` budget counts both runs)."""
        plan = state["best_plan"]
        self.evaluations = int(state["evaluations"])
        self.best_value = float(state["best_value"])
        self.best_plan = None if plan is None else Plan.from_dict(plan)
        self.history = [HistoryPoint(int(e), float(s), float(b)) for e, s, b in state["history"]]
        self.start = time.perf_counter() - float(state["elapsed_s"])
        ratio = state["min_memory_ratio"]
        self._min_memory_ratio = None if ratio is None else float(ratio)
        ratio = state.get("min_recompute_ratio")  # absent from checkpoints before it
        self._min_recompute_ratio = None if ratio is None else float(ratio)
        self._best_fitting_throughput = float(state["best_fitting_throughput"])
        self._errors = dict.fromkeys(str(e) for e in state["errors"])

    def _recompute_hint(self) -> str:
        """What recomputation would do for the plans seen, when the source says."""
        ratio = self._min_recompute_ratio
        if ratio is None or ratio >= (self._min_memory_ratio or 0.0):
            return ""
        if ratio <= 1.0:
            return (
                f"; recompute: true on the stages over memory would make one fit ({ratio:.2f}x "
                "a device's memory): the genetic planner recomputes where it must"
            )
        return f"; recompute: true on the stages over memory would need {ratio:.2f}x"

    # --- the answer ----------------------------------------------------------------------

    def result(self) -> PlanResult:
        """The best feasible plan found, simulated in full; or why there is none. The
        options name the reward source when it is not the simulated default."""
        if self.best_plan is None:
            raise InfeasibleError(self.why_infeasible())
        est = simulate(self.best_plan, self.problem.profile, self.problem.cluster)
        options = dict(self.options)
        if self.reward.name != SimulatedReward.name:
            options["reward"] = self.reward.name
        return PlanResult(
            plan=self.best_plan,
            estimate=est,
            value=self.best_value,
            history=tuple(self.history),
            evaluations=self.evaluations,
            wall_time_s=self.elapsed,
            planner=self.planner,
            options=options,
        )

    def why_infeasible(self) -> str:
        p = self.problem
        where = f"{self.planner} on {p.profile.name!r} / cluster {p.cluster.name!r}"
        if self.evaluations == 0:
            return f"{where}: no plan was evaluated (budget or search space empty)"
        if self._errors:
            reasons = "; ".join(list(self._errors)[:MAX_REASONS])
            return (
                f"{where}: no plan ran among {self.evaluations} evaluated "
                f"({self.reward.name} reward: {reasons})"
            )
        if self._min_memory_ratio is None:
            return f"{where}: no feasible plan among {self.evaluations} evaluated"
        if not np.isfinite(self._best_fitting_throughput) or self._best_fitting_throughput == 0:
            return (
                f"{where}: no plan fits in memory among {self.evaluations} evaluated; the "
                f"smallest needs {self._min_memory_ratio:.2f}x a device's memory "
                f"(use more stages/devices or smaller microbatches{self._recompute_hint()})"
            )
        if p.objective is Objective.COST and p.min_throughput:
            return (
                f"{where}: no plan reaches min_throughput {p.min_throughput:g} samples/s; the "
                f"best that fits in memory reaches {self._best_fitting_throughput:.4g} samples/s"
            )
        return f"{where}: no feasible plan among {self.evaluations} evaluated"
