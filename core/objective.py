"""What a plan is judged by: :class:`Objective` and :func:`score`, spelled one way.

Every planner, the env's reward and the comparisons rank plans with :func:`score`, so the
three objectives (TAPP's batch time, its throughput view, HeterPS's cost under a throughput
floor) mean the same thing everywhere.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np
from numpy.typing import ArrayLike

SECONDS_PER_HOUR = 3600.0
COST_TIE_WEIGHT = 1e-15
"""Weight of the batch time in the cost objective: breaks ties between equal prices (free
devices, say) far below any real price difference."""


class Objective(StrEnum):
    """``time``: minimise batch time (TAPP). ``throughput``: the same optimum, shown as
    samples/s. ``cost``: minimise $ per sample subject to ``throughput >= min_throughput``
    (HeterPS); the planner also chooses which devices to rent."""

    TIME = "time"
    THROUGHPUT = "throughput"
    COST = "cost"


def score(
    objective: Objective | str,
    batch_time: ArrayLike,
    fits: ArrayLike,
    price: ArrayLike,
    *,
    global_batch: int,
    min_throughput: float | None = None,
) -> np.ndarray:
    """Objective value per plan, lower is better; ``inf`` when infeasible.

    ``batch_time`` in seconds, ``fits`` whether the plan fits in memory, ``price`` its
    devices' $ per hour (arrays of one length, or scalars). time/throughput: the batch time.
    cost: $ per sample, plus :data:`COST_TIE_WEIGHT` x batch time; a plan below
    ``min_throughput`` samples/s (when given and non-zero) is infeasible.
    """
    time = np.asarray(batch_time, dtype=np.float64)
    ok = np.asarray(fits, dtype=bool).copy()
    if Objective(objective) is Objective.COST:
        if min_throughput:
            with np.errstate(divide="ignore"):
                ok &= global_batch / time >= min_throughput
        value = np.asarray(price) * time / SECONDS_PER_HOUR / global_batch
        value = value + COST_TIE_WEIGHT * time
    else:
        value = time
    return np.where(ok, value, np.inf)
