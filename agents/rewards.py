"""Where a planner's values come from: a :class:`RewardSource` turns plans into objective
values for a :class:`~agents.problem.Problem` (lower is better, ``inf`` for an infeasible
plan).

Every planner evaluates through its :class:`~agents.search.Search`, and the search asks its
source. Sources:

- :class:`SimulatedReward` (``"simulated"``, the default): the contract cost model, vectorised
  over a whole population (:class:`core.batch_eval.BatchEvaluator`), in this process.
- ``ParallelReward`` (``"parallel"``, :mod:`executor.parallel_reward`): the same model split
  over Ray tasks of the current Ray cluster.
- ``MeasuredReward`` (``"measured"``, :mod:`executor.measured_reward`): each plan run for real
  on the executor, its measured batch time scored for the problem's objective.

A source gets populations (:class:`~core.batch_eval.PlanBatch`: one stage count, arrays over
the plans), so the vectorised planners lose no speed with the simulated source; a source
that runs plans one at a time turns the population into plans with :func:`plans_of`. It
answers :class:`Rewards`: the values, plus what it knows of why a plan is infeasible (memory,
throughput, a failed run), which the search keeps to explain an empty answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from pipeplan.agents.problem import Problem
from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan

FloatArray = np.ndarray
BoolArray = np.ndarray
Population = PlanBatch | Sequence[Plan]
"""Plans as a vectorised population (one stage count) or as a list (any stage counts)."""


@dataclass(frozen=True)
class Rewards:
    """What a source says about ``P`` plans, in their order.

    ``values`` is required; the rest is what the source knows, used only to explain an
    infeasible search (``None``: not known, e.g. for a measured source).
    """

    values: FloatArray
    """(P,) objective values (``Problem.score``): lower is better, ``inf`` infeasible"""
    fits: BoolArray | None = None
    """(P,) whether each plan fits in memory"""
    memory_ratio: FloatArray | None = None
    """(P,) worst memory / capacity over each plan's devices"""
    recompute_ratio: FloatArray | None = None
    """(P,) the same with each stage recomputing or not, whichever holds less (rule 9r)"""
    throughput: FloatArray | None = None
    """(P,) samples per second"""
    errors: tuple[str, ...] = ()
    """why plans could not be valued at all (a failed run), one line each"""

    @classmethod
    def of(cls, values: ArrayLike) -> Rewards:
        """Values alone."""
        return cls(np.asarray(values, dtype=np.float64))

    def check(self, source: str, plans: int) -> None:
        """Refuse an answer that does not hold one value per plan."""
        if self.values.shape != (plans,):
            raise PipeplanError(
                f"reward source {source!r}: values of shape {self.values.shape} for {plans} plans"
            )


class RewardSource(Protocol):
    """Objective values of plans for a problem: lower is better, ``inf`` for an infeasible
    plan, in the problem's objective (``Problem.score``: batch seconds for ``time`` and
    ``throughput``, $ per sample for ``cost``).

    :meth:`evaluate` gets a population of plans for ``problem``'s profile and cluster and
    answers one value per plan, in order. A source that cannot run a plan (out of memory, a
    crashed stage) values it ``inf`` and says why in :attr:`Rewards.errors` rather than
    raising; it raises only when it cannot go on at all (e.g. a broken cluster).
    """

    name: str
    """``"simulated"``, ``"parallel"`` or ``"measured"`` (shown in a result's options)"""

    def evaluate(self, problem: Problem, batch: PlanBatch) -> Rewards: ...


def plans_of(problem: Problem, population: Population) -> list[Plan]:
    """The plans of a population, for sources and observers that take plans one at a time."""
    if isinstance(population, PlanBatch):
        p = problem
        return [
            population.plan(i, p.cluster, p.global_batch, p.schedule)
            for i in range(population.size)
        ]
    return list(population)


def simulated_rewards(evaluator: BatchEvaluator, problem: Problem, batch: PlanBatch) -> Rewards:
    """The cost model's rewards of ``batch`` (the simulated and parallel sources share it)."""
    res = evaluator.evaluate(batch, problem.global_batch, problem.schedule)
    return Rewards(
        values=problem.score(res.batch_time_s, res.fits, res.cost_per_hour),
        fits=res.fits,
        memory_ratio=res.memory_ratio,
        recompute_ratio=res.recompute_ratio,
        throughput=res.throughput,
    )


class SimulatedReward:
    """The contract cost model, vectorised over each population, in this process.

    Keeps the :class:`~core.batch_eval.BatchEvaluator` of the last (profile, cluster) it
    costed, so a search builds its tables once.
    """

    name = "simulated"

    def __init__(self) -> None:
        self._evaluator: BatchEvaluator | None = None

    def evaluator(self, problem: Problem) -> BatchEvaluator:
        """The population evaluator of ``problem``'s profile and cluster."""
        ev = self._evaluator
        if ev is None or ev.profile is not problem.profile or ev.cluster is not problem.cluster:
            ev = self._evaluator = BatchEvaluator(problem.profile, problem.cluster)
        return ev

    def evaluate(self, problem: Problem, batch: PlanBatch) -> Rewards:
        return simulated_rewards(self.evaluator(problem), problem, batch)
