"""score(): the one ranking of plans for the three objectives."""

from __future__ import annotations

import math

import numpy as np

from pipeplan.core.objective import Objective, score


def test_time_and_throughput_rank_by_batch_time() -> None:
    for objective in (Objective.TIME, Objective.THROUGHPUT):
        out = score(objective, [2.0, 1.0], [True, False], [1.0, 1.0], global_batch=8)
        assert out[0] == 2.0 and math.isinf(out[1])


def test_cost_is_dollars_per_sample_under_a_throughput_floor() -> None:
    out = score(
        "cost", np.array([1.0, 4.0]), [True, True], [36.0, 0.0], global_batch=10, min_throughput=5
    )
    assert out[0] == 36.0 / 3600.0 / 10 + 1e-15 * 1.0
    assert math.isinf(out[1])  # 10 samples / 4 s is below 5 samples/s


def test_free_devices_tie_break_on_time() -> None:
    out = score(Objective.COST, [1.0, 2.0], [True, True], [0.0, 0.0], global_batch=4)
    assert 0.0 < out[0] < out[1]
