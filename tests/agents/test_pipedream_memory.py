"""``pipedream_dp`` with memory: its stages fit the devices they are mapped onto."""

from __future__ import annotations

import numpy as np

from pipeplan.agents import Budget, Problem, make_planner
from pipeplan.agents.baselines.pipedream_dp import StageMemory, pipedream_partition
from tests.agents.test_genetic_memory import heavy_chain, tight_cluster

GB = 1e9


def memory(capacity_gb: list[float], params_gb: float = 1.0) -> StageMemory:
    """Four layers of ``params_gb`` GB of parameters, no activations, one microbatch."""
    prefix = np.arange(5) * params_gb * GB
    return StageMemory(prefix, np.zeros(5), np.array(capacity_gb) * GB, 1, 1.0)


def test_smallest_capacity_of_every_device_range() -> None:
    m = memory([8, 4, 16])
    table = m.smallest()
    assert table[0, 1] == 8 * GB and table[0, 2] == 4 * GB and table[2, 3] == 16 * GB
    assert table[1, 3] == 4 * GB and np.isinf(table[1, 1])


def test_a_stage_that_does_not_fit_is_split() -> None:
    """Equal layers, free links, no weight sync: without memory one 2-replica stage of all
    four layers ties with two stages and comes first; with 8 GB per device (two layers of
    4 GB of training state each) only the two-stage split fits."""
    args = ([1.0] * 4, [0.0] * 4, [0.0] * 5, 2, 1e9)
    assert pipedream_partition(*args) == [(0, 4, 2)]
    assert pipedream_partition(*args, memory([8, 8])) == [(0, 2, 1), (2, 4, 1)]


def test_the_devices_a_stage_lands_on_decide_its_share() -> None:
    """A 12 GB device then a 4 GB one: the stage on the second (the last in cluster order)
    may hold one layer only."""
    stages = pipedream_partition([1.0] * 4, [0.0] * 4, [0.0] * 5, 2, 1e9, memory([12, 4]))
    assert stages == [(0, 3, 1), (3, 4, 1)]
    assert pipedream_partition([1.0] * 4, [0.0] * 4, [0.0] * 5, 2, 1e9, memory([4, 4])) == []


def test_pipedream_fits_where_memory_binds() -> None:
    """Twelve layers of 4 GB of state on devices of 16 and 8 GB: the memory-blind DP's
    plans of this instance are all over memory; these fit."""
    p = Problem(heavy_chain(), tight_cluster(), global_batch=32,
                budget=Budget(evaluations=None, seconds=None))  # fmt: skip
    result = make_planner("pipedream_dp").plan(p)
    assert result.estimate.fits
    assert all(s.fits for s in result.estimate.stages)
