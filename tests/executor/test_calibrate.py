"""The calibration fit recovers a cluster's terms from runs it "measured" (no Ray: the
measurements are the cost model's own answers under a known calibration)."""

from __future__ import annotations

import pytest

from core.calibration import Calibration, CallOverhead
from core.cluster import ClusterSpec, DeviceType, Link, Network, Node
from core.costmodel import simulate
from core.errors import PlanError
from core.plan import Plan, Schedule, Stage
from core.profile import LayerProfile, LayerTiming, ModelProfile
from executor.calibrate import Observation, errors, fit

TRUTH = Calibration(
    compute_scale={"fast": 1.3, "slow": 0.8},
    call_overhead={"fast": CallOverhead(2e-3, 4e-3), "slow": CallOverhead(6e-3, 9e-3)},
    network={"inter_node": (1.5, 8000.0)},
    step_overhead_s=0.01,
)


def profile() -> ModelProfile:
    layers = []
    for i in range(6):
        timing = {
            "fast": LayerTiming(1e-3 * (i + 1), 2e-3 * (i + 1), 1e-4, 2e-4),
            "slow": LayerTiming(4e-3 * (i + 1), 8e-3 * (i + 1), 4e-4, 8e-4),
        }
        succ = (i + 1,) if i < 5 else ()
        layers.append(LayerProfile(f"l{i}", "conv", 10_000, 1e6, 200_000, succ, timing))
    return ModelProfile("p", (3, 8, 8), tuple(layers))


def cluster() -> ClusterSpec:
    types = {
        "fast": DeviceType("fast", 4e10, 4.0, 30.0),
        "slow": DeviceType("slow", 1e10, 4.0, 30.0),
    }
    nodes = (Node("n0", {"fast": 1}), Node("n1", {"slow": 2}))
    return ClusterSpec("c", types, nodes, Network(Link(5.0, 2500.0), Link(10.0, 50.0)))


def plans() -> list[Plan]:
    f, s0, s1 = "n0/fast:0", "n1/slow:0", "n1/slow:1"
    out = []
    for b in (4, 8, 16):
        out.append(Plan(16, (Stage((0, 6), (f,), b),)))
        out.append(Plan(16, (Stage((0, 6), (s0,), b),)))
        out.append(Plan(16, (Stage((0, 4), (f,), b), Stage((4, 6), (s0,), b))))
    out.append(Plan(16, (Stage((0, 3), (f,), 4), Stage((3, 6), (s0, s1), 8))))
    out.append(
        Plan(16, (Stage((0, 2), (s0,), 4), Stage((2, 6), (f,), 4)), schedule=Schedule.ONE_F_ONE_B)
    )
    return out


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
    assert cal.scale("fast") == pytest.approx(1.3, rel=2e-2)
    assert cal.overhead("slow").bwd_s == pytest.approx(9e-3, rel=0.1)
    assert cal.step_overhead_s == pytest.approx(0.01, rel=0.1)
    assert cal.network["inter_node"][1] == pytest.approx(8000.0, rel=0.05)
    assert cal.fit["source"] == "test" and cal.fit["runs"] == len(fitted)


def test_unused_link_class_and_types_keep_the_spec() -> None:
    single = [observe(cluster().calibrated(TRUTH), Plan(16, (Stage((0, 6), ("n0/fast:0",), 8),)))]
    cal = fit(cluster(), single).calibration
    assert cal.network == {}  # no send, no all-reduce: the spec's links stay
    assert set(cal.compute_scale) == {"fast"}


def test_nothing_to_fit_is_refused() -> None:
    with pytest.raises(PlanError, match="no measured runs"):
        fit(cluster(), [])
    bad = observe(cluster(), plans()[0])
    bad = Observation(bad.plan, bad.profile, 0.0, bad.forward_s, bad.backward_s)
    with pytest.raises(PlanError, match=r"observations\[0\].batch_time_s: must be > 0, got 0.0"):
        fit(cluster(), [bad])
