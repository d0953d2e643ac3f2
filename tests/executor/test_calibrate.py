"""The calibration fit recovers a cluster's terms from runs it "measured" (no Ray: the
measurements are the cost model's own answers under a known calibration)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeplan.core.calibration import Calibration
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PlanError
from pipeplan.core.observations import Observation
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.calibrate import errors, fit
from tests.calibration_cases import TRUTH, cluster, plans, profile


def observe(spec: ClusterSpec, plan: Plan, model: ModelProfile | None = None) -> Observation:
    model = model or profile()
    est = simulate(plan, model, spec)
    return Observation(
        plan,
        model,
        est.batch_time_s,
        tuple(s.forward_s for s in est.stages),
        tuple(s.backward_s for s in est.stages),
        tuple(s.allreduce_s for s in est.stages),
        tuple(s.update_s for s in est.stages),
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


def test_fit_finds_a_models_own_scale_and_leaves_the_others() -> None:
    """Two models on one cluster, the runs of one of them 25% over its profile on every type
    (rule 1c's model scale): the fit gives that model its factor, the other keeps 1, and the
    types' terms stay the truth's."""
    other = dataclasses.replace(profile(), name="q")
    slow_model = profile()
    truth = cluster().calibrated(
        dataclasses.replace(TRUTH, model_scale={slow_model.model_key: 1.25})
    )
    runs = [observe(truth, p, m) for p in plans() for m in (slow_model, other)]
    result = fit(cluster(), runs)
    cal = result.calibration
    assert cal.model(slow_model.model_key) == pytest.approx(1.25, rel=0.02)
    assert cal.model(other.model_key) == pytest.approx(1.0, rel=0.02)
    assert cal.scale("slow") == pytest.approx(1.3, rel=0.02)
    assert max(abs(e) for e in result.errors_after) < 2e-3
    # a model none of the runs used is costed without a factor
    assert cal.model(dataclasses.replace(profile(), name="unseen").model_key) == 1.0


PAIR = ("n1/slow:0", "n1/slow:1")
RING_TRUTH = Calibration(all_reduce={"intra_node": (2.0, 2500.0)})
"""A ring round of 2 Gbit/s (the link's sends: 5) at the spec's latency."""


def heavy() -> ModelProfile:
    """The cases' profile with 50 MB of weights per layer: all-reduces of 50-300 MB."""
    layers = profile().layers
    return dataclasses.replace(
        profile(), layers=tuple(dataclasses.replace(x, params_bytes=50_000_000) for x in layers)
    )


def replicated(spec: ClusterSpec) -> list[Observation]:
    """The whole model on n1's two slow devices, at three microbatch sizes."""
    return [observe(spec, Plan(16, (Stage((0, 6), PAIR, b),)), heavy()) for b in (4, 8, 16)]


def test_fit_finds_the_ring_rounds_bandwidth() -> None:
    """Replicated stages of 50-300 MB on n1's two devices pin the ring round's bandwidth; no
    stage sends within n1, so the intra-node sends stay unfitted."""
    truth = cluster().calibrated(RING_TRUTH)
    runs = replicated(truth) + [
        observe(
            truth, Plan(16, (Stage((0, k), ("n0/fast:0",), 8), Stage((k, 6), PAIR, 8))), heavy()
        )
        for k in (1, 3, 5)
    ]
    cal = fit(cluster(), runs).calibration
    assert cal.all_reduce["intra_node"][0] == pytest.approx(2.0, rel=0.02)
    assert "intra_node" not in cal.network and "inter_node" in cal.network
    assert "inter_node" not in cal.all_reduce


def test_the_measured_all_reduce_keeps_a_batch_times_other_errors_out_of_the_ring() -> None:
    """Batch times 10% above what the model can explain with its terms (say the profile was
    measured on a faster minute): with the rings measured apart, the fitted ring stays the
    truth's; from the batch times alone it takes up part of that 10%."""
    runs = replicated(cluster().calibrated(RING_TRUTH))
    slower = [dataclasses.replace(o, batch_time_s=1.1 * o.batch_time_s) for o in runs]
    assert fit(cluster(), slower).calibration.all_reduce["intra_node"][0] == pytest.approx(
        2.0, rel=0.03
    )
    blind = [dataclasses.replace(o, allreduce_s=()) for o in slower]
    assert fit(cluster(), blind).calibration.all_reduce["intra_node"][0] < 0.95 * 2.0


UPDATE_TRUTH = Calibration(memory_bandwidth_gbps={"slow": 6.0})
"""The slow type's update streams at 6 GB/s (the spec says 30); the fast type's at the spec's."""


def test_fit_finds_the_update_bandwidth_of_each_type() -> None:
    """Plans with 50-300 MB of weights on each type: the measured updates pin each type's
    bandwidth (rule 8u), the slow one's far from the spec's, the fast one's at it; without
    measured updates nothing is fitted and the spec's stay."""
    truth = cluster().calibrated(UPDATE_TRUTH)
    runs = [
        observe(truth, Plan(16, (Stage((0, 6), (d,), b),)), heavy())
        for d in ("n0/fast:0", "n1/slow:0")
        for b in (8, 16)
    ] + [
        observe(
            truth, Plan(16, (Stage((0, k), ("n0/fast:0",), 8), Stage((k, 6), PAIR, 8))), heavy()
        )
        for k in (2, 4)
    ]
    result = fit(cluster(), runs)
    cal = result.calibration
    assert cal.memory_bandwidth_gbps["slow"] == pytest.approx(6.0, rel=0.02)
    assert cal.memory_bandwidth_gbps["fast"] == pytest.approx(30.0, rel=0.02)
    assert max(abs(e) for e in result.errors_before) > 0.05
    assert max(abs(e) for e in result.errors_after) < 2e-3
    blind = [dataclasses.replace(o, update_s=()) for o in runs]
    assert fit(cluster(), blind).calibration.memory_bandwidth_gbps == {}


def test_unused_link_class_and_types_keep_the_spec() -> None:
    single = [observe(cluster().calibrated(TRUTH), Plan(16, (Stage((0, 6), ("n0/fast:0",), 8),)))]
    cal = fit(cluster(), single).calibration
    assert cal.network == {} and cal.all_reduce == {}  # no send, no ring: the spec's stay
    assert set(cal.compute_scale) == set()  # fast is timed: its scale stays 1


def test_nothing_to_fit_is_refused() -> None:
    with pytest.raises(PlanError, match="no measured runs"):
        fit(cluster(), [])
    bad = observe(cluster(), plans()[0])
    bad = Observation(bad.plan, bad.profile, 0.0, bad.forward_s, bad.backward_s)
    with pytest.raises(PlanError, match=r"observations\[0\].batch_time_s: must be > 0, got 0.0"):
        fit(cluster(), [bad])
