"""executor.metrics without a cluster: what each record call observes (through a fake
recorder), that nothing is recorded and nothing breaks without Ray, that a failing metric is
skipped, that the definitions are ones Ray accepts, and that a measured search records its
evaluations and the cost model's errors. Read back from Ray's metrics endpoint in
``tests/executor/test_pipeline.py``."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field

import pytest
import ray

from pipeplan.agents import Problem
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from pipeplan.executor import metrics, runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.measure import Measurement, publish_errors
from pipeplan.executor.measured_reward import MeasuredReward
from pipeplan.executor.metrics import HistogramSpec, RayRecorder
from pipeplan.executor.model import ModelSource
from tests.executor.test_measure import _measured

Observation = tuple[str, float, dict[str, str]]


@dataclass
class FakeRecorder:
    seen: list[Observation] = field(default_factory=list)

    def observe(self, spec: HistogramSpec, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(spec.tags), f"{spec.name}: tags {tags}"
        self.seen.append((spec.name, value, tags))


class BrokenRecorder:
    calls = 0

    def observe(self, spec: HistogramSpec, value: float, tags: dict[str, str]) -> None:
        self.calls += 1
        raise RuntimeError("exporter down")


def test_stage_operations_are_recorded_by_stage_device_type_and_op() -> None:
    with metrics.recording_to(FakeRecorder()) as fake:
        metrics.stage_compute(1, "mid", "F", 0.02)
        metrics.stage_compute(1, "mid", "B", 0.04)
        metrics.stage_compute(1, "mid", "U", 0.001)
        metrics.stage_compute(1, "mid", "G", 0.5)  # the gradient exchange is not compute
        metrics.stage_transfer(2, "slow", "F", 0.003)
    compute = metrics.STAGE_COMPUTE.name
    assert fake.seen == [
        (compute, 0.02, {"stage": "1", "device_type": "mid", "op": "forward"}),
        (compute, 0.04, {"stage": "1", "device_type": "mid", "op": "backward"}),
        (compute, 0.001, {"stage": "1", "device_type": "mid", "op": "update"}),
        (
            metrics.STAGE_TRANSFER.name,
            0.003,
            {"stage": "2", "device_type": "slow", "op": "forward"},
        ),
    ]


def test_a_training_step_records_its_batch_time_and_samples_per_second() -> None:
    with metrics.recording_to(FakeRecorder()) as fake:
        metrics.training_step("digits_cnn", "local-hetero", "1f1b", 0.25, 64)
        metrics.training_step("digits_cnn", "local-hetero", "1f1b", 0.0, 64)  # no rate of 0 s
    tags = {"model": "digits_cnn", "cluster": "local-hetero", "schedule": "1f1b"}
    assert fake.seen == [
        (metrics.BATCH.name, 0.25, tags),
        (metrics.THROUGHPUT.name, 256.0, tags),
        (metrics.BATCH.name, 0.0, tags),
    ]


def test_a_prediction_error_is_recorded_as_its_size_and_direction() -> None:
    with metrics.recording_to(FakeRecorder()) as fake:
        metrics.prediction_error("batch_time", "run", -0.25)
        metrics.prediction_error("stage_compute", "measured", 0.5)
        metrics.prediction_error("stage_transfer", "run", math.nan)  # measured 0: no error
        metrics.prediction_error("stage_transfer", "run", math.inf)
    name = metrics.PREDICTION_ERROR.name
    assert fake.seen == [
        (name, 0.25, {"quantity": "batch_time", "direction": "under", "source": "run"}),
        (name, 0.5, {"quantity": "stage_compute", "direction": "over", "source": "measured"}),
    ]


def test_without_a_cluster_nothing_is_recorded_and_ray_is_not_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not ray.is_initialized()
    fake = FakeRecorder()
    monkeypatch.setattr(metrics, "_recorder", fake)
    assert not metrics.enabled()
    metrics.stage_compute(0, "cpu", "F", 0.1)
    metrics.training_step("m", "c", "gpipe", 0.1, 8)
    metrics.measured_evaluation("ran", 1.0)
    assert fake.seen == [] and not ray.is_initialized()


def test_a_failing_metric_is_logged_once_then_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(metrics, "_failed", set())
    broken = BrokenRecorder()
    with metrics.recording_to(broken), caplog.at_level(logging.WARNING):
        metrics.stage_compute(0, "cpu", "F", 0.1)  # does not raise
        metrics.stage_compute(0, "cpu", "B", 0.1)  # skipped
        metrics.training_step("m", "c", "gpipe", 0.1, 8)  # other metrics still try
    assert broken.calls == 3  # compute once, then batch time and samples per second
    assert [r.getMessage() for r in caplog.records] == [
        f"metric {name}: recording failed; not recorded again"
        for name in (
            "pipeplan_stage_compute_seconds",
            "pipeplan_batch_seconds",
            "pipeplan_samples_per_second",
        )
    ]


def test_the_definitions_are_ones_ray_accepts() -> None:
    """Real ``ray.util.metrics`` histograms (no cluster needed to make and feed them): a
    name Ray would discard or a tag it would refuse shows up as a warning or an error."""
    recorder = RayRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for spec in metrics.HISTOGRAMS:
            recorder.observe(spec, spec.boundaries[0], dict.fromkeys(spec.tags, "x"))
    names = [spec.name for spec in metrics.HISTOGRAMS]
    assert len(set(names)) == len(names) and all(n.startswith("pipeplan_") for n in names)
    assert metrics.STAGE_COMPUTE.exported == "ray_pipeplan_stage_compute_seconds"


def test_boundaries_must_be_positive_and_increasing() -> None:
    with pytest.raises(ValueError, match=r"h: boundaries must be positive and increasing"):
        HistogramSpec("h", "", (), (0.0, 1.0))
    with pytest.raises(ValueError, match=r"got \(1.0, 1.0\)"):
        HistogramSpec("h", "", (), (1.0, 1.0))


# --- the executor's calls ---------------------------------------------------------------------


def _problem() -> tuple[Problem, Plan]:
    timing = {"cpu": LayerTiming(1e-3, 2e-3)}
    profile = ModelProfile("m", (4,), (LayerProfile("l0", "fc", 400, 10.0, 4, (), timing),))
    cluster = ClusterSpec(
        "one", {"cpu": DeviceType("cpu", flops=1e9, memory_gb=1)}, (Node("n", {"cpu": 2}),)
    )
    plan = Plan(8, (Stage((0, 1), ("n/cpu:0",), 8),))
    return Problem(profile, cluster, global_batch=8), plan


def test_publish_errors_records_batch_time_and_each_stage() -> None:
    problem, plan = _problem()
    est = simulate(plan, problem.profile, problem.cluster)
    measured = _measured(plan, est.batch_time_s * 2, est.stages[0].compute_s)
    with metrics.recording_to(FakeRecorder()) as fake:
        publish_errors(est, measured, "run")
    got = {(t["quantity"], t["direction"]): v for _, v, t in fake.seen}
    # batch time predicted at half the measured one; compute exact; transfer measured 0: none
    assert got == {("batch_time", "under"): pytest.approx(0.5), ("stage_compute", "under"): 0.0}


def test_a_measured_search_records_each_evaluation_and_the_prediction_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem, plan = _problem()
    est = simulate(plan, problem.profile, problem.cluster)
    shared = Plan(8, (Stage((0, 1), ("n/cpu:0", "n/cpu:1"), 8),))
    unshareable = Plan(8, (Stage((0, 1), ("n/cpu:0", "n/cpu:1"), 1),))  # 1 sample, 2 replicas
    monkeypatch.setattr(runtime, "is_connected", lambda: True)
    source = MeasuredReward(ModelSource("digits_cnn", 8), problem.cluster, repeats=1)

    def fake_measure(p: Plan) -> Measurement:
        if p == shared:
            raise ExecutorError("stage 0 replica 1 on device n/cpu:1 (node n): lost")
        return _measured(p, est.batch_time_s * 1.25, est.stages[0].compute_s)

    monkeypatch.setattr(source, "_measure", fake_measure)
    with metrics.recording_to(FakeRecorder()) as fake:
        outcomes = source.run([plan, unshareable, shared, plan], problem)  # the last: cached
    assert [o.value for o in outcomes] == [
        pytest.approx(est.batch_time_s * 1.25),
        math.inf,
        math.inf,
        pytest.approx(est.batch_time_s * 1.25),
    ]
    evaluations = [t["outcome"] for n, _, t in fake.seen if n == metrics.MEASURED_EVALUATION.name]
    assert evaluations == ["ran", "screened", "failed"]
    errors = {
        t["quantity"]: (v, t["direction"], t["source"])
        for n, v, t in fake.seen
        if n == metrics.PREDICTION_ERROR.name
    }
    assert errors == {
        "batch_time": (pytest.approx(0.2), "under", "measured"),
        "stage_compute": (0.0, "under", "measured"),
    }
