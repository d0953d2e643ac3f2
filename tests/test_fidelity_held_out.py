"""bench.fidelity's held-out calibrations (bench.common): each plan is predicted by fits that
never saw its runs (no Ray: the "measurements" are the cost model's answers under a known
calibration)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from bench import common
from bench.common import HELD_OUT, Observed, held_out
from bench.fidelity import Result, profile_noise
from pipeplan.core.calibration import Calibration
from pipeplan.core.costmodel import simulate
from pipeplan.core.held_out import Fold
from tests.calibration_cases import TRUTH, cluster, plans, profile
from tests.executor.test_calibrate import observe


def rows(models: tuple[str, ...] = ("a", "b")) -> list[Observed]:
    truth = cluster().calibrated(TRUTH)
    every = plans()
    return [
        Observed(models[i % len(models)], p, profile(), (observe(truth, p),))
        for i, p in enumerate(every)
    ]


@pytest.mark.slow
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


@pytest.mark.parametrize("per_model", [True, False])
def test_each_row_is_predicted_by_the_fits_of_its_folds(
    monkeypatch: pytest.MonkeyPatch, per_model: bool
) -> None:
    """The folds ``held_out`` fits (the fits stand-ins, each a calibration of its own): one
    per model without that model's rows, one per row without it; ``per_model`` reaches
    them; each row is predicted by the two folds that held it out, and the models' fits are
    reported by model."""
    observed = rows()
    models = [r.model for r in observed]
    seen: dict[str, Any] = {}

    def fake_fit_folds(
        spec: object, runs: list[Any], folds: list[Fold], per: bool, records: list[Any]
    ) -> list[Calibration]:
        seen.update(runs=runs, folds=folds, per_model=per, records=records)
        return [Calibration(step_overhead_s=0.001 * (k + 1)) for k in range(len(folds))]

    monkeypatch.setattr(common, "fit_folds", fake_fit_folds)
    predicted, fits = held_out(observed, cluster(), per_model=per_model)
    assert seen["per_model"] is per_model
    assert seen["runs"] == [r.runs for r in observed]
    folds, n = seen["folds"], len(observed)
    assert [set(f.test) for f in folds] == [
        {i for i, m in enumerate(models) if m == "a"},
        {i for i, m in enumerate(models) if m == "b"},
        *({i} for i in range(n)),
    ]
    assert all(set(f.train) == set(range(n)) - set(f.test) for f in folds)
    assert seen["records"] == [{"held_out_model": "a"}, {"held_out_model": "b"}] + [
        {"held_out_plan": j} for j in range(n)
    ]
    for i, (r, p) in enumerate(zip(observed, predicted, strict=True)):
        by_model = 0 if r.model == "a" else 1
        for kind, fold in (("held-out model", by_model), ("held-out plan", 2 + i)):
            spec = cluster().calibrated(Calibration(step_overhead_s=0.001 * (fold + 1)))
            assert p[kind] == simulate(r.plan, r.profile, spec).batch_time_s
    assert fits == {m: Calibration(step_overhead_s=0.001 * (k + 1)).to_dict()
                    for k, m in enumerate(("a", "b"))}  # fmt: skip


@pytest.mark.slow
def test_a_models_own_scale_is_learnt_from_its_other_plans() -> None:
    """Model ``a``'s runs take 1.25x its profile on every type (rule 1c's model scale),
    ``b``'s do not: held out by plan, the fits with the models' scales predict ``a``'s plans;
    the types' terms alone (the ablation ``bench.fidelity`` prints beside it) cannot, as
    they must serve ``b`` too. (28 real fits, ~5 s: the fit's model scale is checked at
    once by ``tests/executor/test_calibrate.py``, ``per_model``'s way to the fits above.)"""
    a, b = profile(), dataclasses.replace(profile(), name="b")
    truth = cluster().calibrated(dataclasses.replace(TRUTH, model_scale={a.model_key: 1.25}))
    observed = [
        Observed(name, p, model, (observe(truth, p, model),))
        for p in plans()[:6]  # each type alone and across the nodes, at two sizes
        for name, model in (("a", a), ("b", b))
    ]
    with_scale, _ = held_out(observed, cluster())
    types_only, _ = held_out(observed, cluster(), per_model=False)
    for r, p in zip(observed, with_scale, strict=True):
        measured = r.runs[0].batch_time_s
        assert p["held-out plan"] == pytest.approx(measured, rel=1e-2)
    worst = max(
        abs(q["held-out plan"] / r.runs[0].batch_time_s - 1)
        for r, q in zip(observed, types_only, strict=True)
    )
    assert worst > 0.05


def test_a_lone_model_has_no_other_model_to_learn_from() -> None:
    observed = rows(models=("only",))[:3]
    predicted, fits = held_out(observed, cluster())
    assert fits == {}
    assert all(set(p) == {"held-out plan"} for p in predicted)


def test_profile_noise_is_how_far_a_second_profile_moves_each_prediction() -> None:
    spec, plan = cluster(), plans()[0]
    before = simulate(plan, profile(), spec)
    moved = Result("a", "p", plan, before, predicted_after_s=before.batch_time_s * 1.1)
    alone = Result("a", "q", plan, before)  # no second profile: no change to report
    assert moved.profile_change == pytest.approx(0.1)
    assert math.isnan(alone.profile_change)
    assert profile_noise([moved, alone]) == [pytest.approx(0.1)]
    doc = moved.to_dict()
    assert doc["predicted_after_s"] == pytest.approx(before.batch_time_s * 1.1)
    assert doc["profile_change"] == pytest.approx(0.1)
    assert alone.to_dict()["profile_change"] is None
