"""The contract's formulas (core.rules) on hand-computed values, for floats and arrays."""

from __future__ import annotations

import numpy as np
import pytest

from pipeplan.core import rules
from pipeplan.core.schedules import Schedule


def test_update_streams_four_copies_of_the_parameters() -> None:
    # 1 GB of parameters at 100 GB/s: weights, gradients and two Adam states, 4 x 10 ms
    assert rules.update_s(1e9, 100.0) == pytest.approx(0.04)
    assert rules.OPTIMIZER_COPIES == 4


def test_accumulation_charges_all_backwards_but_the_first() -> None:
    assert rules.accumulation_s(0.04, 1) == 0.0
    assert rules.accumulation_s(0.04, 4) == pytest.approx(0.03)


def test_replica_share_is_the_busiest_replicas_samples() -> None:
    """Rule 2i: ``ceil(n / r)``, for ints, floats and arrays (the executor's shares differ by
    at most one, the first ones larger)."""
    assert rules.replica_share(4, 3) == 2
    assert rules.replica_share(6, 3) == 2
    assert rules.replica_share(1, 1) == 1
    assert rules.replica_share(5.0, 2) == 3.0
    shares = rules.replica_share(np.array([4, 8, 9, 2]), np.array([3, 4, 4, 3]))
    assert shares.tolist() == [2, 2, 3, 1]


def test_replica_samples_are_the_executors_split() -> None:
    """Rule 2i: 4 samples on 3 replicas are 2, 1, 1; 9 on 4 are 3, 2, 2, 2."""
    assert [rules.replica_samples(4, 3, k) for k in range(3)] == [2, 1, 1]
    assert [rules.replica_samples(9, 4, k) for k in range(4)] == [3, 2, 2, 2]
    n, r = np.array([4, 6, 5]), np.array([3, 3, 3])
    assert rules.replica_samples(n, r, 0).tolist() == [2, 2, 2]
    assert rules.replica_samples(n, r, 2).tolist() == [1, 2, 1]


def test_ring_allreduce_is_free_for_one_replica() -> None:
    assert rules.allreduce_s(1e9, 1, 1e9, 1e-5) == 0.0
    # 2 replicas: 2 (r-1)/r = 1 pass of the bytes, 2 latencies
    assert rules.allreduce_s(1e9, 2, 1e9, 1e-5) == pytest.approx(1.0 + 2e-5)


def test_link_units_and_one_transfer() -> None:
    bps, lat = rules.bytes_per_s(10.0), rules.latency_s(50.0)
    assert bps == 1.25e9
    assert lat == pytest.approx(5e-5)
    assert rules.transfer_s(1.25e9, bps, lat) == pytest.approx(1.0 + 5e-5)


def test_in_flight_gpipe_holds_all_and_1f1b_the_stages_ahead() -> None:
    assert rules.in_flight(Schedule.GPIPE, 8, 3) == 8
    held = rules.in_flight(Schedule.ONE_F_ONE_B, 8, np.array([4, 3, 2, 1]))
    assert held.tolist() == [4, 3, 2, 1]
    assert rules.in_flight(Schedule.ONE_F_ONE_B, 2, np.array([4, 1])).tolist() == [2, 1]


def test_memory_per_device() -> None:
    # 4 x 1000 parameter bytes + 3 microbatches x 8 samples x 100 bytes
    assert rules.memory_bytes(1000, 100, 8.0, 3) == 4000 + 2400
    assert rules.capacity_bytes(16) == 16e9


def test_rules_apply_element_wise_to_arrays() -> None:
    params = np.array([1e9, 2e9])
    assert rules.update_s(params, np.array([100.0, 200.0])).tolist() == pytest.approx([0.04, 0.04])
    assert rules.compute_s(np.array([1.0, 0.0]), np.array([0.5, 2.0]), 4).tolist() == [3.0, 8.0]
