"""Measured profiles on a live 2-node local cluster (fast and 4x slower slow), digits_cnn."""

from __future__ import annotations

from typing import Any

import pytest

from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import live_nodes
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.measured_profile import measure_on_type, measure_profile
from pipeplan.executor.model import ModelSource
from pipeplan.models.profiler import profile_model

pytestmark = pytest.mark.ray

SPEC = ClusterSpec(
    "profiling-test",
    {
        "fast": DeviceType("fast", flops=4.0e10, memory_gb=2),
        "slow": DeviceType("slow", flops=1.0e10, memory_gb=2),
    },
    (Node("n0", {"fast": 1}), Node("n1", {"slow": 1})),
)
DIGITS = ModelSource("digits_cnn", 8, seed=1)
OPTIONS: dict[str, Any] = {"batch_sizes": (2, 8), "warmup": 1, "repeats": 3, "timeout_s": 120.0}


def _total(profile: ModelProfile, dtype: str) -> float:
    return sum(
        layer.timings[dtype].forward(8) + layer.timings[dtype].backward(8)
        for layer in profile.layers
    )


@pytest.mark.timeout(180)
def test_fastest_measurement_scaled_by_the_emulated_slowdown(cluster: LocalCluster) -> None:
    profile = measure_profile(DIGITS, SPEC, **OPTIONS)
    model, example = DIGITS.build()
    analytic = profile_model(model, example, "digits_cnn", device_type=None)
    assert len(profile) == len(analytic) == 8
    assert [(a.name, a.flops, a.params_bytes) for a in profile.layers] == [
        (a.name, a.flops, a.params_bytes) for a in analytic.layers
    ]
    assert profile.device_types == ("fast", "slow")
    assert _total(profile, "fast") > 0
    for layer in profile.layers:  # slow = fastest flops / slow flops = 4 x the fast timings
        f, s = layer.timings["fast"], layer.timings["slow"]
        assert s.fwd_s == pytest.approx(4 * f.fwd_s)
        assert s.bwd_s == pytest.approx(4 * f.bwd_s)
        assert s.fwd_fixed_s == pytest.approx(4 * f.fwd_fixed_s)
        assert s.bwd_fixed_s == pytest.approx(4 * f.bwd_fixed_s)
    # the cost model takes it: a two-stage plan across both types
    plan = Plan(16, (Stage((0, 4), ("n0/fast:0",), 4), Stage((4, 8), ("n1/slow:0",), 4)))
    est = simulate(plan, profile, SPEC)
    assert est.batch_time_s > 0 and est.stages[1].forward_s > 0


@pytest.mark.timeout(180)
def test_unemulated_profile_gives_every_type_the_real_times(cluster: LocalCluster) -> None:
    profile = measure_profile(DIGITS, SPEC, emulate=False, **OPTIONS)
    for layer in profile.layers:
        assert layer.timings["fast"] == layer.timings["slow"]


@pytest.mark.timeout(180)
def test_each_type_is_measured_on_its_own_node(cluster: LocalCluster) -> None:
    nodes = {n.name: n.node_id for n in live_nodes()}
    for dtype, node in (("fast", "n0"), ("slow", "n1")):
        m = measure_on_type(DIGITS, dtype, **OPTIONS)
        assert (m.device_type, m.node, m.node_id) == (dtype, node, nodes[node])
        assert len(m.timings) == 8 and m.seconds > 0
    profile = measure_profile(DIGITS, SPEC, measure_on="each", **OPTIONS)
    assert profile.device_types == ("fast", "slow")
    # measured apart (noisy), then x4 for slow: its total is well above the fast one's
    assert _total(profile, "slow") > 1.5 * _total(profile, "fast")


@pytest.mark.timeout(60)
def test_a_type_without_a_live_node_is_named(cluster: LocalCluster) -> None:
    bigger = ClusterSpec(
        "bigger",
        {**SPEC.device_types, "gpu": DeviceType("gpu", flops=1.0e12, memory_gb=8)},
        (*SPEC.nodes, Node("n9", {"gpu": 1})),
    )
    with pytest.raises(ExecutorError, match=r"device type 'gpu': no live node.*fast, slow"):
        measure_profile(DIGITS, bigger, **OPTIONS)
    with pytest.raises(PipeplanError, match="not in cluster"):
        measure_profile(DIGITS, SPEC, device_types=["tpu"], **OPTIONS)


@pytest.mark.timeout(60)
def test_a_failing_model_is_reported_with_its_type(cluster: LocalCluster) -> None:
    bad = ModelSource("digits_cnn", 8, options={"no_such_option": 1})
    with pytest.raises(ExecutorError, match=r"device type 'fast' \(node n0\).*no_such_option"):
        measure_profile(bad, SPEC, **OPTIONS)


@pytest.mark.timeout(60)
def test_the_pause_reaches_the_profiler(cluster: LocalCluster) -> None:
    # the profiler actor checks it: a bad pause is refused there, naming the field
    with pytest.raises(ExecutorError, match=r"device type 'fast'.*pause_s: .*-1"):
        measure_profile(DIGITS, SPEC, pause_s=-1.0, **OPTIONS)
