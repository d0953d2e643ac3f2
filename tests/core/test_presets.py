"""The cluster presets in examples/clusters load, make sense and survive a save/load."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeplan.core.cluster import ClusterSpec

PRESETS_DIR = Path(__file__).resolve().parents[2] / "examples" / "clusters"
PRESETS = sorted(PRESETS_DIR.glob("*.yaml"))


def test_the_three_presets_are_there() -> None:
    names = {p.stem for p in PRESETS}
    assert {"local-hetero", "tapp-paper", "cloud-mix"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads_and_is_heterogeneous(path: Path) -> None:
    spec = ClusterSpec.load(path)
    assert spec.name == path.stem
    assert len(spec.device_types) >= 2
    assert set(spec.counts_by_type()) == set(spec.device_types)  # every type is on some node
    assert len(spec.nodes) >= 2


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_preset_round_trips(path: Path, suffix: str, tmp_path: Path) -> None:
    spec = ClusterSpec.load(path)
    out = tmp_path / f"{path.stem}{suffix}"
    spec.save(out)
    again = ClusterSpec.load(out)
    assert again == spec
    assert again.to_dict() == spec.to_dict()
    assert again.device_ids == spec.device_ids


def test_local_hetero_fits_this_machine() -> None:
    spec = ClusterSpec.load(PRESETS_DIR / "local-hetero.yaml")
    assert len(spec.device_ids) <= 4
    assert len(spec.nodes) == 3
    memory = sum(spec.device_type(d).memory_gb for d in spec.device_ids)
    assert memory <= 24
    flops = sorted({t.flops for t in spec.device_types.values()})
    assert len(flops) == 3  # three speeds for the executor to emulate


def test_cloud_mix_has_prices_and_data_sheet_figures() -> None:
    spec = ClusterSpec.load(PRESETS_DIR / "cloud-mix.yaml")
    types = spec.device_types
    assert all(t.price_per_hour > 0 for t in types.values())
    assert (types["t4"].flops, types["v100"].flops, types["a100"].flops) == (
        8.1e12,
        1.57e13,
        1.95e13,
    )
    assert [types[t].memory_gb for t in ("t4", "v100", "a100")] == [16, 16, 40]
    assert [types[t].memory_bandwidth_gbps for t in ("t4", "v100", "a100")] == [320, 900, 1555]
