"""executor.measure: predicted vs measured, written once."""

from __future__ import annotations

import math

import pytest

from core.cluster import ClusterSpec, DeviceType, Node
from core.costmodel import simulate
from core.plan import Plan, Stage
from core.profile import LayerProfile, LayerTiming, ModelProfile
from executor.measure import Comparison, Measurement, StageMeasurement, relative_error


def test_relative_error_is_over_the_measured_value() -> None:
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert relative_error(0.5, 1.0) == pytest.approx(-0.5)
    assert math.isnan(relative_error(1.0, 0.0))


def _measured(plan: Plan, batch_time_s: float, compute_s: float) -> Measurement:
    stage = plan.stages[0]
    st = StageMeasurement(
        0, stage.layers, stage.devices, stage.microbatch, compute_s / 3, 2 * compute_s / 3,
        0.0, compute_s, 0.0, batch_time_s - compute_s, 0.0,
    )  # fmt: skip
    return Measurement(
        plan, 1, 0, (batch_time_s,), batch_time_s, 0.0, batch_time_s, batch_time_s,
        plan.global_batch / batch_time_s, 0.0, (st,), (2.3,), (0.1,), False, (),
    )  # fmt: skip


def test_comparison_reports_every_error_against_the_measurement() -> None:
    timing = {"cpu": LayerTiming(1e-3, 2e-3)}
    profile = ModelProfile("m", (4,), (LayerProfile("l0", "fc", 400, 10.0, 4, (), timing),))
    cluster = ClusterSpec(
        "one", {"cpu": DeviceType("cpu", flops=1e9, memory_gb=1)}, (Node("n", {"cpu": 1}),)
    )
    plan = Plan(8, (Stage((0, 1), ("n/cpu:0",), 8),))
    est = simulate(plan, profile, cluster)
    m = _measured(plan, est.batch_time_s * 2, est.stages[0].compute_s)
    c = Comparison("m", "one", "given", est, m)
    d = c.to_dict()
    assert c.error == pytest.approx(-0.5)
    assert d["error"]["batch_time"] == pytest.approx(-0.5)
    assert d["error"]["throughput"] == pytest.approx(1.0)
    assert d["error"]["stages"][0]["compute"] == pytest.approx(0.0)
    assert d["plan"] == plan.to_dict() and d["emulated"] is False
    assert d["measured"]["note"] == "measured on real devices"
