"""bench.idle_slowdown drives real StageWorker code in one process: it must keep up with the
worker's API (it once stopped running when device ids and signatures changed)."""

from __future__ import annotations

import math

import pytest

from bench.common import GPT_OPTIONS, MODELS, ModelCase
from bench.idle_slowdown import COUNT, checked, run
from pipeplan.executor.errors import StageFailedError
from pipeplan.executor.stage import Failure


def test_one_measured_step_gives_a_ratio_per_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    # the benchmark's GPT at a width of 32 and 64 tokens (the code path is the same, the
    # profile and the steps cost a tenth)
    tiny = {**GPT_OPTIONS, "d_model": 32, "vocab_size": 64}
    gpt = MODELS["gpt"]
    monkeypatch.setitem(
        MODELS, "gpt", ModelCase("gpt-tiny", gpt.model, gpt.input_size, gpt.batch, tiny)
    )
    ratios = run(0.0, 1)  # two warm-up steps, then one measured: F and B of every microbatch
    assert list(ratios) == ["0 s"]  # no pause: the back-to-back profile is the paused one
    assert len(ratios["0 s"]) == 2 * COUNT
    assert all(math.isfinite(r) and r > 0 for r in ratios["0 s"])


def test_a_failed_operation_raises_with_its_traceback() -> None:
    failure = Failure(1, 0, "n0/cpu:1", "n0", "B", "Traceback: boom")
    with pytest.raises(StageFailedError, match="operation B raised\n.*\nTraceback: boom"):
        checked(failure)
