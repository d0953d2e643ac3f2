"""executor.measure: predicted vs measured, written once."""

from __future__ import annotations

import math

import pytest

from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from pipeplan.executor.measure import (
    Comparison,
    Measurement,
    StageMeasurement,
    StepResult,
    relative_error,
    summarise,
)
from pipeplan.executor.stage import OpRecord


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


def test_a_replicated_stages_all_reduce_starts_when_its_last_replica_does() -> None:
    """Replica 1's backward ends 0.2 s after replica 0's: the ring is timed from its start
    (0.5 s) to the end of the last round (0.62 s), not from replica 0's (0.3 s)."""
    plan = Plan(4, (Stage((0, 1), ("n/cpu:0", "n/cpu:1"), 4),))
    spans = [
        (0, "F", 0.0, 0.1), (1, "F", 0.0, 0.2), (0, "B", 0.1, 0.3), (1, "B", 0.2, 0.5),
        (0, "G", 0.3, 0.31), (1, "G", 0.5, 0.51), (0, "G", 0.52, 0.6), (1, "G", 0.53, 0.62),
        (0, "U", 0.6, 0.65), (1, "U", 0.62, 0.66),
    ]  # fmt: skip
    records = tuple(
        OpRecord(0, k, kind, 0, 0 if kind in "FB" else -1, a, b, b - a, 0.0)  # type: ignore[arg-type]
        for k, kind, a, b in spans
    )
    step = StepResult(0, 0.0, 0.66, 2.3, 0.1, records)
    m = summarise(plan, [step], 0, emulated=False, placement=())
    assert m.stages[0].allreduce_s == pytest.approx(0.12)
    alone = Plan(4, (Stage((0, 1), ("n/cpu:0",), 4),))
    one = tuple(r for r in records if r.replica == 0 and r.kind != "G")
    m = summarise(alone, [StepResult(0, 0.0, 0.65, 2.3, 0.1, one)], 0, emulated=False, placement=())
    assert m.stages[0].allreduce_s == 0.0
