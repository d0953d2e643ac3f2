"""Where TAPP's rewards come from: a :class:`RewardSource` turns plans into objective values.

- :class:`SimulatedReward`: the contract cost model, vectorised (``core.batch_eval``) over a
  whole batch of sampled plans, grouped by stage count, through :class:`agents.search.Search`
  so evaluations, the best plan and the history are counted.
- ``MeasuredReward`` (the executor supplies it): runs each plan for real and reports the
  measured time of one training batch averaged over repeated runs, as TAPP does.
- ``RayReward`` (:mod:`agents.tapp.parallel`): the simulated reward on N Ray workers.

The trainer turns values into rewards with :func:`shape_rewards` (log-ratio to a reference,
so the reward scale is the same for every model and objective).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from agents.search import Search
from core.plan import Plan


class RewardSource(Protocol):
    """Objective values of plans: lower is better, ``inf`` for an infeasible plan.

    ``evaluate`` gets plans of any stage counts for the same profile and cluster and returns
    one value per plan in the same order, in the problem's objective (``Problem.score``:
    batch seconds for ``time``/``throughput``, $ per sample for ``cost``). A measured source
    runs each plan (forward, backward and update of one global batch), averages the batch
    time over its repeats and scores that; it reports failures (out of memory, a crashed
    stage) as ``inf`` rather than raising, and keeps its own book of measurements.
    """

    def evaluate(self, plans: Sequence[Plan]) -> np.ndarray: ...


class SimulatedReward:
    """The cost model through ``search``: one vectorised population per stage count."""

    def __init__(self, search: Search) -> None:
        self.search = search

    def evaluate(self, plans: Sequence[Plan]) -> np.ndarray:
        if not plans:
            return np.zeros(0)
        return self.search.evaluate_plans(plans)


def shape_rewards(
    values: np.ndarray, reference: float, worst: float, infeasible_penalty: float
) -> np.ndarray:
    """Reward ``log(reference / value)`` (0 = as good as the reference, +0.69 = twice as
    good); an infeasible plan gets ``min(0, log(reference / worst)) - infeasible_penalty``,
    below every feasible plan seen (``worst`` = the worst finite value seen)."""
    values = np.asarray(values, dtype=np.float64)
    floor = min(0.0, float(np.log(reference / worst))) - infeasible_penalty
    with np.errstate(divide="ignore"):
        good = np.log(reference / values)
    return np.where(np.isfinite(values), good, floor)
