"""Profile, cluster and plan documents: round trips and errors that name field and value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from pipeplan.core.cluster import ClusterSpec, parse_device_id
from pipeplan.core.errors import FormatError, PlanError
from pipeplan.core.plan import Plan, Schedule, uniform_stages
from pipeplan.core.profile import ModelProfile

from .strategies import clusters, profiles

PROFILE: dict[str, Any] = {
    "name": "tiny",
    "input_shape": [3, 8, 8],
    "layers": [
        {
            "name": "c",
            "op": "conv",
            "params_bytes": 100,
            "flops": 1e6,
            "activation_bytes": 64,
            "successors": [1, 2],
            "timings": {"cpu": {"fwd_s": 1e-4, "bwd_s": 2e-4}},
        },
        {
            "name": "r",
            "op": "relu",
            "params_bytes": 0,
            "flops": 16,
            "activation_bytes": 64,
            "successors": [2],
        },
        {"name": "a", "op": "add", "params_bytes": 0, "flops": 16, "activation_bytes": 64},
    ],
}
CLUSTER: dict[str, Any] = {
    "name": "c2",
    "device_types": {
        "cpu": {"flops": 1e11, "memory_gb": 8},
        "t4": {"flops": 8.1e12, "memory_gb": 16, "price_per_hour": 0.35},
    },
    "nodes": [{"name": "n0", "devices": {"t4": 2}}, {"name": "n1", "devices": {"cpu": 1}}],
}
PLAN: dict[str, Any] = {
    "global_batch": 8,
    "stages": [
        {"layers": [0, 1], "devices": ["n0/t4:0"], "microbatch": 4},
        {"layers": [1, 3], "devices": ["n0/t4:1", "n1/cpu:0"], "microbatch": 8},
    ],
}


def edit(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``doc`` with ``path`` ("a.0.b") set to ``value``."""
    out = json.loads(json.dumps(doc))
    *keys, last = path.split(".")
    cur: Any = out
    for k in keys:
        cur = cur[int(k)] if isinstance(cur, list) else cur[k]
    if isinstance(cur, list):
        cur[int(last)] = value
    else:
        cur[last] = value
    return out


def test_profile_defaults_and_round_trip(tmp_path: Path) -> None:
    p = ModelProfile.from_dict(PROFILE)
    assert p.layers[0].timings["cpu"].fwd_fixed_s == 0.0
    assert p.layers[2].successors == ()
    p.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json") == p
    assert p.device_types == ()  # only layer 0 is timed


@settings(max_examples=30, deadline=None)
@given(profiles())
def test_random_profiles_round_trip(p: ModelProfile) -> None:
    assert ModelProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("layers.0.op", "lstm", "layers[0].op: unknown op 'lstm'"),
        ("layers.1.params_bytes", -5, "layers[1].params_bytes: must be >= 0, got -5"),
        ("layers.0.successors", [1, 7], "successors: index 7 out of range [0, 3)"),
        (
            "layers.2.successors",
            [0],
            "cycle in successors: 0 ('c') -> 1 ('r') -> 2 ('a') -> 0 ('c')",
        ),
        ("layers.1.successors", [1], "cycle in successors: 1 ('r') -> 1 ('r')"),
        ("layers.0.flops", "many", "layers[0].flops: expected a number, got 'many'"),
        ("layers.0.timings.cpu.bwd_s", -1, "timings.cpu.bwd_s: must be >= 0, got -1"),
        ("layers", [], "layers: empty"),
        ("input_shape", [3, 0], "input_shape: sizes must be > 0, got [3, 0]"),
    ],
)
def test_profile_errors_name_field_and_value(path: str, value: Any, message: str) -> None:
    with pytest.raises(FormatError) as e:
        ModelProfile.from_dict(edit(PROFILE, path, value))
    assert message in str(e.value)


def test_profile_not_in_topological_order_is_refused() -> None:
    doc = edit(PROFILE, "layers.1.successors", [])
    doc = edit(doc, "layers.2.successors", [1])
    with pytest.raises(FormatError, match=r"layers\[2\] \('a'\).successors: \[1\] come before"):
        ModelProfile.from_dict(doc)


def test_text_library_has_one_line_per_layer() -> None:
    text = ModelProfile.from_dict(PROFILE).text_library().splitlines()
    assert len(text) == 2 + 3
    assert text[2].split()[:3] == ["0", "c", "conv"] and text[2].split()[-1] == "1,2"


def test_cluster_yaml_and_json_round_trip(tmp_path: Path) -> None:
    c = ClusterSpec.from_dict(CLUSTER)
    assert c.device_ids == ("n0/t4:0", "n0/t4:1", "n1/cpu:0")
    assert c.device_types["cpu"].memory_bandwidth_gbps == 100.0  # default
    assert c.network.inter_node.bandwidth_gbps == 10.0
    for name in ("c.yaml", "c.json"):
        c.save(tmp_path / name)
        assert ClusterSpec.load(tmp_path / name) == c


def test_a_gpu_type_says_its_accelerator_and_round_trips(tmp_path: Path) -> None:
    plain = ClusterSpec.from_dict(CLUSTER)
    assert plain.device_types["t4"].accelerator is None
    assert "accelerator" not in plain.to_dict()["device_types"]["t4"]
    gpu = ClusterSpec.from_dict(edit(CLUSTER, "device_types.t4.accelerator", "cuda"))
    assert gpu.device_types["t4"].accelerator == "cuda"
    assert gpu.to_dict()["device_types"]["t4"]["accelerator"] == "cuda"
    gpu.save(tmp_path / "c.yaml")
    assert ClusterSpec.load(tmp_path / "c.yaml") == gpu


def test_a_links_all_reduce_numbers_round_trip_and_default_to_the_link(tmp_path: Path) -> None:
    doc = edit(
        CLUSTER,
        "network",
        {
            "inter_node": {
                "bandwidth_gbps": 1.5,
                "latency_us": 8000,
                "all_reduce": {"bandwidth_gbps": 2.5, "latency_us": 20000},
            }
        },
    )
    c = ClusterSpec.from_dict(doc)
    inter, intra = c.network.inter_node, c.network.intra_node
    assert (inter.ring_bytes_per_s, inter.ring_latency_s) == (
        pytest.approx(2.5e9 / 8),
        pytest.approx(0.02),
    )
    assert (inter.bytes_per_s, inter.latency_s) == (pytest.approx(1.5e9 / 8), pytest.approx(0.008))
    assert (intra.ring_bytes_per_s, intra.ring_latency_s) == (intra.bytes_per_s, intra.latency_s)
    assert "all_reduce" not in c.to_dict()["network"]["intra_node"]
    c.save(tmp_path / "c.yaml")
    assert ClusterSpec.load(tmp_path / "c.yaml") == c
    assert inter.allreduce_s(1e9, 4) == pytest.approx(2 * 3 / 4 * 1e9 / (2.5e9 / 8) + 6 * 0.02)


def test_emulation_headroom_is_optional_and_round_trips(tmp_path: Path) -> None:
    plain = ClusterSpec.from_dict(CLUSTER)
    assert plain.emulation_headroom == 1.0 and "emulation" not in plain.to_dict()
    slowed = ClusterSpec.from_dict(CLUSTER | {"emulation": {"headroom": 1.5}})
    assert slowed.emulation_headroom == 1.5 and slowed.emulated_slower
    slowed.save(tmp_path / "c.yaml")
    assert ClusterSpec.load(tmp_path / "c.yaml") == slowed


@settings(max_examples=30, deadline=None)
@given(clusters())
def test_random_clusters_round_trip(c: ClusterSpec) -> None:
    assert ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("nodes.0.devices", {"h100": 1}, "unknown device type 'h100'"),
        ("nodes.1.name", "n0", "nodes[1].name: 'n0' appears twice"),
        ("nodes.1.name", "n/1", "nodes[1].name: 'n/1' may hold only"),
        ("device_types.cpu.flops", 0, "device_types.cpu.flops: must be > 0, got 0"),
        ("device_types.t4.memory_gb", -16, "device_types.t4.memory_gb: must be >= 0, got -16"),
        ("nodes.0.devices", {"t4": -1}, "devices.t4: expected a count >= 0, got -1"),
        ("nodes", [], "nodes: empty"),
        ("emulation", {"headroom": 0.5}, "emulation.headroom: must be >= 1, got 0.5"),
        ("emulation", "fast", "cluster.emulation: expected an object, got 'fast'"),
        ("device_types.t4.accelerator", "rocm", "device_types.t4.accelerator: 'rocm' is not"),
        ("device_types.t4.accelerator", 1, "device_types.t4.accelerator: expected a name"),
        (
            "network",
            {"inter_node": {"bandwith_gbps": 3}},
            "network.inter_node: unknown key 'bandwith_gbps'",
        ),
        (
            "network",
            {"intra_node": {"bandwidth_gbps": 0}},
            "network.intra_node.bandwidth_gbps: must be > 0, got 0",
        ),
        (
            "network",
            {"inter_node": {"all_reduce": {"bandwidth_gbps": 2}}},
            "network.inter_node.all_reduce.latency_us: missing",
        ),
        (
            "network",
            {"inter_node": {"all_reduce": {"bandwidth_gbps": 0, "latency_us": 5}}},
            "network.inter_node.all_reduce.bandwidth_gbps: must be > 0, got 0",
        ),
        (
            "network",
            {"inter_node": {"all_reduce": {"bandwidth_gbps": 2, "latency_us": -1}}},
            "network.inter_node.all_reduce.latency_us: must be >= 0, got -1",
        ),
        (
            "network",
            {"inter_node": {"all_reduce": {"bandwidth_gbps": 2, "latency_us": 1, "x": 1}}},
            "network.inter_node.all_reduce: unknown key 'x'",
        ),
        (
            "network",
            {"inter_node": {"all_reduce": 5}},
            "network.inter_node.all_reduce: expected an object, got int 5",
        ),
    ],
)
def test_cluster_errors_name_field_and_value(path: str, value: Any, message: str) -> None:
    with pytest.raises(FormatError) as e:
        ClusterSpec.from_dict(edit(CLUSTER, path, value))
    assert message in str(e.value)


def test_device_ids_parse_and_reject() -> None:
    assert parse_device_id("n1/t4:0") == ("n1", "t4", 0)
    for bad in ("n1-t4:0", "n1/t4", "n1/t4:x", "/t4:0"):
        with pytest.raises(FormatError, match="expected NODE/TYPE:INDEX"):
            parse_device_id(bad)


def test_plan_round_trip(tmp_path: Path) -> None:
    p = Plan.from_dict(PLAN)
    assert p.schedule is Schedule.GPIPE and p.microbatches(0) == 2
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == p
    p.validate(ModelProfile.from_dict(PROFILE), ClusterSpec.from_dict(CLUSTER))


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            "stages.1.layers",
            [2, 3],
            "stages[1].layers: starts at 2 but the previous stage ends at 1 (gap)",
        ),
        ("stages.1.layers", [0, 3], "(overlap)"),
        ("stages.0.layers", [0, 0], "stages[0].layers: [0, 0) holds no layer"),
        (
            "stages.1.devices",
            ["n0/t4:0"],
            "stages[1].devices: device 'n0/t4:0' already used by stages[0]",
        ),
        ("stages.1.devices", ["n1/cpu:0", "n1/cpu:0"], "device 'n1/cpu:0' listed twice"),
        ("stages.1.devices", ["t4-0"], "stages[1].devices: device id 't4-0': expected"),
        ("stages.0.microbatch", 9, "stages[0].microbatch: 9 exceeds global_batch 8"),
        ("stages.0.microbatch", -4, "stages[0].microbatch: must be an integer >= 1, got -4"),
        ("global_batch", 0, "plan.global_batch: must be >= 1, got 0"),
        ("schedule", "zb-h1", "plan.schedule: unknown schedule 'zb-h1'"),
        ("stages.0.layers", [-1, 1], "stages[0].layers: negative index in [-1, 1]"),
        ("stages", [], "plan.stages: empty"),
    ],
)
def test_plan_errors_name_stage_and_values(path: str, value: Any, message: str) -> None:
    with pytest.raises((PlanError, FormatError)) as e:
        Plan.from_dict(edit(PLAN, path, value))
    assert message in str(e.value)


def test_remainders_and_unequal_one_f_one_b_are_plans() -> None:
    """A microbatch need not divide the batch (the last one holds the remainder), and 1F1B
    takes unequal microbatches."""
    p = Plan.from_dict({**PLAN, "schedule": "1f1b"})
    assert [st.microbatch for st in p.stages] == [4, 8] and p.schedule is Schedule.ONE_F_ONE_B
    p = Plan.from_dict(edit(PLAN, "stages.0.microbatch", 3))
    assert p.microbatches(0) == 3 and [p.samples(0, j) for j in range(3)] == [3, 3, 2]


def test_plan_against_profile_and_cluster() -> None:
    plan = Plan.from_dict(edit(PLAN, "stages.1.layers", [1, 2]))
    with pytest.raises(PlanError, match="ends at 2 but profile 'tiny' has 3 layers"):
        plan.validate(ModelProfile.from_dict(PROFILE))
    plan = Plan.from_dict(edit(PLAN, "stages.0.devices", ["n7/t4:0"]))
    with pytest.raises(PlanError, match="stages\\[0\\].devices: unknown device 'n7/t4:0'"):
        plan.validate(cluster=ClusterSpec.from_dict(CLUSTER))


def test_uniform_stages() -> None:
    assert uniform_stages(10, 3) == [(0, 3), (3, 7), (7, 10)]
    with pytest.raises(PlanError, match="n_stages: must be in \\[1, 2\\]"):
        uniform_stages(2, 3)


def test_domain_objects_pickle_and_deepcopy() -> None:
    import copy
    import pickle

    for obj in (
        ModelProfile.from_dict(PROFILE),
        ClusterSpec.from_dict(CLUSTER),
        Plan.from_dict(PLAN),
    ):
        assert pickle.loads(pickle.dumps(obj)) == obj
        assert copy.deepcopy(obj) == obj
