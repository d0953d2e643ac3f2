"""The calibration fit recovers a cluster's terms from runs it "measured" (no Ray: the
measurements are the cost model's own answers under a known calibration)."""

from __future__ import annotations

import pytest

from core.cluster import ClusterSpec
from core.costmodel import simulate
from core.errors import PlanError
from core.plan import Plan, Stage
from executor.calibrate import Observation, errors, fit
from tests.calibration_cases import TRUTH, cluster, plans, profile


def observe(spec: ClusterSpec, plan: Plan) -> Observation:
    est = simulate(plan, profile(), spec)
    return Observation(
        plan,
        profile(),
        est.batch_time_s,
        tuple(s.forward_s for s in est.stages),
        tuple(s.backward_s for s in est.stages),
    )


def test_fit_recovers_the_terms_that_made_the_measurements() -> None:
    truth = cluster().calibrated(TRUTH)
    every = [observe(truth, p) for p in plans()]
    fitted, held_out = every[::2], every[1::2]
    result = fit(cluster(), fitted, {"source": "test"})
    cal = result.calibration
    assert max(abs(e) for e in result.errors_before) > 0.2  # there was something to fit
    # a weak prior towards the spec costs a little exactness (PRIOR_WEIGHT)
    assert max(abs(e) for e in result.errors_after) < 1e-3
    assert max(abs(e) for e in errors(cluster().calibrated(cal), held_out)) < 1e-3
    assert cal.scale("slow") == pytest.approx(1.3, rel=2e-2)
    assert cal.overhead("slow").bwd_s == pytest.approx(9e-3, rel=0.1)
    assert cal.step_overhead_s == pytest.approx(0.01, rel=0.1)
    assert cal.network["inter_node"][1] == pytest.approx(8000.0, rel=0.05)
    assert cal.fit["source"] == "test" and cal.fit["runs"] == len(fitted)


def test_unused_link_class_and_types_keep_the_spec() -> None:
    single = [observe(cluster().calibrated(TRUTH), Plan(16, (Stage((0, 6), ("n0/fast:0",), 8),)))]
    cal = fit(cluster(), single).calibration
    assert cal.network == {}  # no send, no all-reduce: the spec's links stay
    assert set(cal.compute_scale) == set()  # fast is timed: its scale stays 1


def test_nothing_to_fit_is_refused() -> None:
    with pytest.raises(PlanError, match="no measured runs"):
        fit(cluster(), [])
    bad = observe(cluster(), plans()[0])
    bad = Observation(bad.plan, bad.profile, 0.0, bad.forward_s, bad.backward_s)
    with pytest.raises(PlanError, match=r"observations\[0\].batch_time_s: must be > 0, got 0.0"):
        fit(cluster(), [bad])
