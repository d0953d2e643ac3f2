"""The production-scale cluster presets (examples/clusters/scale/): their sizes, device types
and data-sheet figures, and a save/load round trip of their ``count:`` nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeplan.core.cluster import ClusterSpec

SCALE = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "scale"
SIZES = {
    "dc-64": (10, {"a100": 32, "v100": 16, "t4": 16}),
    "dc-328": (56, {"a100": 128, "v100": 128, "t4": 64, "cpu": 8}),
    "dc-1024": (216, {"h100": 192, "a100": 256, "v100": 256, "t4": 256, "cpu": 64}),
}


def test_the_three_presets_are_there() -> None:
    assert sorted(p.stem for p in SCALE.glob("*.yaml")) == sorted(SIZES)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_a_preset_has_its_nodes_and_devices(name: str) -> None:
    spec = ClusterSpec.load(SCALE / f"{name}.yaml")
    nodes, devices = SIZES[name]
    assert spec.name == name
    assert (len(spec.nodes), spec.counts_by_type()) == (nodes, devices)
    assert len(spec.device_ids) == int(name.removeprefix("dc-"))
    assert 3 <= len(spec.device_types) <= 5 and set(spec.device_types) == set(devices)
    net = spec.network
    assert (net.intra_node.bandwidth_gbps, net.inter_node.bandwidth_gbps) == (600, 100)
    again = ClusterSpec.from_dict(spec.to_dict())
    assert again == spec and again.device_ids == spec.device_ids


def test_data_sheet_figures() -> None:
    types = ClusterSpec.load(SCALE / "dc-1024.yaml").device_types
    figures = {t: (d.flops, d.memory_gb, d.memory_bandwidth_gbps) for t, d in types.items()}
    assert figures == {
        "h100": (989e12, 80, 3350),
        "a100": (312e12, 80, 2039),
        "v100": (125e12, 32, 900),
        "t4": (65e12, 16, 320),
        "cpu": (5e12, 512, 204.8),
    }
    assert all(t.accelerator == "cuda" for n, t in types.items() if n != "cpu")
