"""bench.index: each results folder's README lists its runs newest first, with the commit,
load, wall time and headline its files record, and ``?`` for what a file did not record."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from bench.index import command_of, headline, pages
from bench.record import BenchRun


def test_a_folder_lists_its_runs_newest_first(tmp_path: Path) -> None:
    first = BenchRun("update_bandwidth")
    rows = [{"optimizer": "sgd", "rule8_bandwidth_gbps": g} for g in (20.0, 30.0, 40.0)]
    first.write({"rows": rows}, results=tmp_path)
    second = BenchRun("update_bandwidth")
    second.started = first.started + dt.timedelta(minutes=5)
    second.write({"rows": rows[:1]}, results=tmp_path)
    old = tmp_path / "update_bandwidth" / "2026-11-22T21-37-31Z.json"  # from before provenance
    old.write_text(json.dumps({"provenance": {"git": {"added_in": "e335e08abc"}}, "rows": []}))
    text = pages(tmp_path)[tmp_path / "update_bandwidth" / "README.md"]
    lines = [line for line in text.splitlines() if line.startswith("| [")]
    assert [line.split("](")[1].split(")")[0] for line in lines] == [
        second.path(tmp_path).name,
        first.path(tmp_path).name,
        old.name,
    ]
    assert "plain SGD: median 20.0 GB/s" in lines[0] and "median 30.0 GB/s" in lines[1]
    assert lines[2].startswith("| [2026-11-22 21:37:31](2026-11-22T21-37-31Z.json)")
    assert "? (file added in e335e08) | ? -> ? | ? | - |" in lines[2]
    index = pages(tmp_path)[tmp_path / "README.md"]
    assert f"| 3 | [{second.path(tmp_path).stem[:10]}" in index


def test_variants_name_their_command_and_unknown_benches_have_no_headline() -> None:
    assert command_of("fidelity_quick") == "python -m bench.fidelity --quick"
    assert command_of("links_x").endswith("--cluster examples/clusters/x.yaml")
    assert command_of("plan_quality_realistic") == "python -m bench.plan_quality --realistic"
    assert headline("plan_quality", {"instances": []}) == "-"
    fit = {"bandwidth_gbps": 2.0, "latency_us": 50.0}
    assert headline("links_x", {"classes": {"inter_node": {"fit": fit}}}) == (
        "inter_node 2.00 Gbit/s, 50 us"
    )
