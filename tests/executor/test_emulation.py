"""executor.emulation: slowdowns, scaled timings and "is this cluster emulated", decided once."""

from __future__ import annotations

import pytest

from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.errors import PipeplanError, PlanError
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from pipeplan.executor.emulation import (
    IDLE_PAUSE_S,
    device_slowdowns,
    emulated_timings,
    is_emulated,
    profile_clock,
    profile_pause,
    scaled_timings,
    slowdown,
)


def spec(headroom: float = 1.0) -> ClusterSpec:
    types = {
        "fast": DeviceType("fast", flops=4e9, memory_gb=1),
        "slow": DeviceType("slow", flops=1e9, memory_gb=1),
    }
    nodes = (Node("a", {"fast": 1}), Node("b", {"slow": 2}))
    return ClusterSpec("two", types, nodes, emulation_headroom=headroom)


def test_slowdown_is_headroom_times_fastest_over_own_flops() -> None:
    assert slowdown(spec(), "fast") == 1.0 and slowdown(spec(), "slow") == 4.0
    assert slowdown(spec(1.5), "fast") == 1.5 and slowdown(spec(1.5), "slow") == 6.0
    with pytest.raises(PipeplanError, match="device type 'tpu': not in cluster 'two'"):
        slowdown(spec(), "tpu")


def test_a_cluster_is_emulated_when_some_type_is_slowed() -> None:
    assert is_emulated(spec()) and not is_emulated(spec(), ["fast"])
    assert is_emulated(spec(1.5), ["fast"])


def test_device_slowdowns_name_an_unknown_type() -> None:
    assert device_slowdowns(spec(), ["a/fast:0", "b/slow:1"]) == {"a/fast:0": 1.0, "b/slow:1": 4.0}
    with pytest.raises(PlanError, match="device 'c/tpu:0': type 'tpu' is not in cluster spec"):
        device_slowdowns(spec(), ["c/tpu:0"])


def test_profile_clock() -> None:
    assert profile_clock(True) == "cpu" and profile_clock(False) == "wall"


def test_profile_pause_only_when_emulated() -> None:
    assert profile_pause(True) == IDLE_PAUSE_S > 0 and profile_pause(False) == 0.0


def test_scaled_timings_scale_every_part() -> None:
    (t,) = scaled_timings([LayerTiming(1.0, 2.0, 3.0, 4.0)], 2.5)
    assert t == LayerTiming(2.5, 5.0, 7.5, 10.0)


def _profile(measured_as: str) -> ModelProfile:
    timing = {measured_as: LayerTiming(1e-3, 2e-3, 1e-4, 2e-4)}
    layers = (LayerProfile("l0", "fc", 4, 10.0, 4, (), timing),)
    return ModelProfile("m", (4,), layers)


@pytest.mark.parametrize("headroom", [1.0, 1.5])
def test_emulated_timings_scale_the_measured_type_by_each_slowdown(headroom: float) -> None:
    prof = emulated_timings(_profile("fast"), spec(headroom), "fast")
    measured = LayerTiming(1e-3, 2e-3, 1e-4, 2e-4)
    for t in ("fast", "slow"):
        expected = scaled_timings([measured], slowdown(spec(headroom), t))[0]
        assert prof.layers[0].timings[t] == expected
