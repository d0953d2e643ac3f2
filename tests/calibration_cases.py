"""Synthetic calibration cases shared by the calibration tests: a small profile and
cluster, a known calibration (``TRUTH``) and eleven plans that exercise every term (each
type alone, pipelines across the nodes, replicas, 1F1B). "Measurements" are the cost
model's own answers under ``TRUTH``, so a fit has an exact answer to find."""

from __future__ import annotations

from pipeplan.core.calibration import Calibration, CallOverhead
from pipeplan.core.cluster import ClusterSpec, DeviceType, Link, Network, Node
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile

TRUTH = Calibration(
    compute_scale={"slow": 1.3},  # only slow is costed by FLOPs: only its scale is fitted
    call_overhead={"fast": CallOverhead(2e-3, 4e-3), "slow": CallOverhead(6e-3, 9e-3)},
    network={"inter_node": (1.5, 8000.0)},
    step_overhead_s=0.01,
)


def profile() -> ModelProfile:
    layers = []
    for i in range(6):
        timing = {"fast": LayerTiming(1e-3 * (i + 1), 2e-3 * (i + 1), 1e-4, 2e-4)}
        succ = (i + 1,) if i < 5 else ()  # slow: no timing, rule 1's FLOP fallback
        layers.append(LayerProfile(f"l{i}", "conv", 10_000, 1e7 * (i + 1), 200_000, succ, timing))
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
