"""A node's ``count: N`` (a catalogue to rent from): expansion into ``NAME-0 .. NAME-(N-1)``
with the kind kept, limits checked before expansion, errors naming field and value, and the
document round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.errors import FormatError
from pipeplan.core.limits import MAX_NODES
from tests.work import AT_ONCE, counting_calls

ROOT = Path(__file__).resolve().parents[2]


def catalogue(*nodes: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "cat",
        "device_types": {
            "cpu": {"flops": 1.0e12, "memory_gb": 32},
            "a100": {"flops": 1.95e13, "memory_gb": 40, "price_per_hour": 4.1},
        },
        "nodes": list(nodes),
    }


def test_count_expands_into_named_nodes_of_one_kind() -> None:
    spec = ClusterSpec.from_dict(
        catalogue(
            {"name": "c5", "devices": {"cpu": 1}, "count": 2},
            {"name": "head", "devices": {"cpu": 1}},
            {"name": "p4d", "devices": {"a100": 8}, "count": 3},
        )
    )
    assert [n.name for n in spec.nodes] == ["c5-0", "c5-1", "head", "p4d-0", "p4d-1", "p4d-2"]
    assert [n.kind for n in spec.nodes] == ["c5", "c5", None, "p4d", "p4d", "p4d"]
    assert all(n.count is None for n in spec.nodes)
    assert spec.counts_by_type() == {"cpu": 3, "a100": 24}
    assert "p4d-2/a100:7" in spec.device_ids


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_catalogue_round_trips_with_its_counts(suffix: str, tmp_path: Path) -> None:
    doc = catalogue(
        {"name": "c5", "devices": {"cpu": 1}, "count": 1},
        {"name": "p4d", "devices": {"a100": 8}, "count": 16},
        {"name": "solo", "devices": {"a100": 1}},
    )
    spec = ClusterSpec.from_dict(doc)
    nodes = spec.to_dict()["nodes"]
    assert nodes == [
        {"name": "c5", "devices": {"cpu": 1}, "count": 1},
        {"name": "p4d", "devices": {"a100": 8}, "count": 16},
        {"name": "solo", "devices": {"a100": 1}},
    ]
    spec.save(tmp_path / f"c{suffix}")
    again = ClusterSpec.load(tmp_path / f"c{suffix}")
    assert again == spec and again.device_ids == spec.device_ids
    # an expanded spec handed to the constructor again stays the same spec
    assert ClusterSpec(spec.name, spec.device_types, spec.nodes, spec.network) == spec


def test_the_preset_catalogue_round_trips_and_is_realistic() -> None:
    spec = ClusterSpec.load(ROOT / "examples/clusters/cloud-catalogue.yaml")
    kinds: dict[str, int] = {}
    for n in spec.nodes:
        assert n.kind is not None
        kinds[n.kind] = kinds.get(n.kind, 0) + 1
        assert 1 <= sum(n.devices.values()) <= 8
    assert 4 <= len(kinds) <= 6 and max(kinds.values()) <= 16
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    cpu = [t for t in spec.device_types.values() if t.accelerator is None]
    gpu = [t for t in spec.device_types.values() if t.accelerator == "cuda"]
    assert len(cpu) == 1 and 3 <= len(gpu) <= 4
    assert all(t.price_per_hour > 0 for t in spec.device_types.values())


@pytest.mark.parametrize(
    ("count", "message"),
    [
        (0, "nodes[0].count: must be >= 1, got 0"),
        (-3, "nodes[0].count: must be >= 1, got -3"),
        (2.5, "nodes[0].count: expected an integer, got 2.5"),
        ("4", "nodes[0].count: expected an integer, got '4'"),
        (True, "nodes[0].count: expected an integer, got True"),
    ],
)
def test_a_bad_count_is_refused_naming_field_and_value(count: Any, message: str) -> None:
    with pytest.raises(FormatError) as e:
        ClusterSpec.from_dict(catalogue({"name": "p4d", "devices": {"a100": 8}, "count": count}))
    assert message in str(e.value)


def test_a_bad_count_given_directly_is_refused() -> None:
    types = {"a": DeviceType("a", 1e12, 16)}
    with pytest.raises(FormatError, match=r"nodes\[0\] \(g\)\.count: expected an integer >= 1"):
        ClusterSpec("c", types, (Node("g", {"a": 1}, count=0),))


def test_counts_over_the_node_limit_are_refused_before_expansion() -> None:
    doc = catalogue(
        {"name": "a", "devices": {"cpu": 1}, "count": MAX_NODES},
        {"name": "b", "devices": {"cpu": 1}, "count": 10**12},
    )
    with pytest.raises(FormatError) as e, counting_calls() as work:
        ClusterSpec.from_dict(doc)
    assert work.calls < AT_ONCE  # refused, not expanded (MAX_NODES nodes would take more)
    text = str(e.value)
    assert "nodes (counts included)" in text and "1,000,000,004,096" in text
    assert f"{MAX_NODES:,}" in text


def test_the_devices_of_a_counted_node_are_checked_once_before_expansion() -> None:
    doc = catalogue({"name": "big", "devices": {"a100": 10**9}, "count": 10**3})
    with (
        pytest.raises(FormatError, match=r"nodes\[0\] \(big\)\.devices: 1,000,000,000"),
        counting_calls() as work,
    ):
        ClusterSpec.from_dict(doc)
    assert work.calls < AT_ONCE  # checked once, not once per node of the count (1,000)


def test_an_expanded_name_that_clashes_is_named() -> None:
    doc = catalogue(
        {"name": "g-1", "devices": {"cpu": 1}},
        {"name": "g", "devices": {"a100": 1}, "count": 2},
    )
    with pytest.raises(FormatError, match=r"nodes\[1\]\.name: 'g-1' appears twice"):
        ClusterSpec.from_dict(doc)
