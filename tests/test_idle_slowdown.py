"""bench.idle_slowdown drives real StageWorker code in one process: it must keep up with the
worker's API (it once stopped running when device ids and signatures changed)."""

from __future__ import annotations

import math

import pytest

from bench.idle_slowdown import COUNT, checked, run
from pipeplan.executor.errors import StageFailedError
from pipeplan.executor.stage import Failure


def test_one_measured_step_gives_a_ratio_per_operation() -> None:
    ratios = run(0.0, 1)  # two warm-up steps, then one measured: F and B of every microbatch
    assert list(ratios) == ["0 s"]  # no pause: the back-to-back profile is the paused one
    assert len(ratios["0 s"]) == 2 * COUNT
    assert all(math.isfinite(r) and r > 0 for r in ratios["0 s"])


def test_a_failed_operation_raises_with_its_traceback() -> None:
    failure = Failure(1, 0, "n0/cpu:1", "n0", "B", "Traceback: boom")
    with pytest.raises(StageFailedError, match="operation B raised\n.*\nTraceback: boom"):
        checked(failure)
