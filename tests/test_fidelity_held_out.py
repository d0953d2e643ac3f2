"""bench.fidelity's held-out calibrations: each plan is predicted by fits that never saw its
runs (no Ray: the "measurements" are the cost model's answers under a known calibration)."""

from __future__ import annotations

import pytest

from bench.fidelity import HELD_OUT, Observed, held_out
from core.costmodel import simulate
from tests.calibration_cases import TRUTH, cluster, plans, profile
from tests.executor.test_calibrate import observe


def rows(models: tuple[str, ...] = ("a", "b")) -> list[Observed]:
    truth = cluster().calibrated(TRUTH)
    every = plans()
    return [
        Observed(models[i % len(models)], p, profile(), (observe(truth, p),))
        for i, p in enumerate(every)
    ]


def test_every_plan_is_predicted_by_fits_without_its_runs() -> None:
    observed = rows()
    predicted, fits = held_out(observed, cluster())
    assert set(fits) == {"a", "b"}
    assert [set(p) for p in predicted] == [set(HELD_OUT)] * len(observed)
    for r, p in zip(observed, predicted, strict=True):
        measured = r.runs[0].batch_time_s
        uncalibrated = simulate(r.plan, r.profile, cluster()).batch_time_s
        assert abs(uncalibrated - measured) > 1e-3  # the spec alone is off
        # every term is pinned by the other plans too, so the held-out fits find the truth
        assert p["held-out plan"] == pytest.approx(measured, rel=1e-2)
        assert p["held-out model"] == pytest.approx(measured, rel=5e-2)


def test_a_lone_model_has_no_other_model_to_learn_from() -> None:
    observed = rows(models=("only",))[:3]
    predicted, fits = held_out(observed, cluster())
    assert fits == {}
    assert all(set(p) == {"held-out plan"} for p in predicted)
