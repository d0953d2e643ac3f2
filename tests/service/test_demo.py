"""``pipeplan demo`` end to end on a tiny model: it starts its own cluster (the default,
local-pipeline; so this module shares no cluster), measures, plans, runs every plan and
writes its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.core.plan import Plan
from tests.service.runner import run_cli


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_runs_the_main_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    args = ["--model", "digits_cnn", "--input-size", "8", "--batch", "16", "--steps", "1"]
    args += ["--tapp-iterations", "2", "--out", str(out)]
    code, printed, err = run_cli(monkeypatch, capsys, "demo", *args)
    assert code == 0, err
    assert "EMULATED" in printed and "speed-up vs bsp-all" in printed
    doc = json.loads((out / "demo.json").read_text())
    rows = {r["planner"]: r for r in doc["rows"]}
    expected = {"brute", "dp", "tapp", "uniform", "data_parallel", "single-device",
                "pipe-torch-all", "bsp-all"}  # fmt: skip
    assert set(rows) == expected and doc["reference"] == "bsp-all"
    for name, row in rows.items():
        assert row["error"] is None, (name, row["error"])
        plan = Plan.from_dict(row["plan"])
        assert (out / "plans" / f"{name}.plan.json").exists()
        measured = row["measured"]
        assert measured["batch_time_s"] > 0
        assert Plan.from_dict(measured["plan"]) == plan
    # brute is exact up to three stages: no such plan the demo ran is predicted faster
    best = rows["brute"]["predicted"]["batch_time_s"]
    assert len(Plan.from_dict(rows["brute"]["plan"]).stages) <= 3
    assert all(
        r["predicted"]["batch_time_s"] >= best * (1 - 1e-9)
        for r in rows.values()
        if len(Plan.from_dict(r["plan"]).stages) <= 3
    )
    assert len(Plan.from_dict(rows["bsp-all"]["plan"]).stages[0].devices) == 6
    assert len(Plan.from_dict(rows["single-device"]["plan"]).stages[0].devices) == 1
    assert "faster than single-device" in printed
    fidelity = doc["fidelity"]  # the preset ships uncalibrated
    assert fidelity["calibrated"] is False and fidelity["plans"] >= 2
    errors = [
        abs(r["predicted"]["batch_time_s"] - r["measured"]["batch_time_s"])
        / r["measured"]["batch_time_s"]
        for r in rows.values()
    ]
    assert min(errors) - 1e-12 <= fidelity["median_abs_error"] <= max(errors) + 1e-12
    assert "cost model uncalibrated" in printed and "best plan" in printed
    assert rows["bsp-all"]["measured"]["note"].startswith("EMULATED")  # slow devices in it
    assert (out / "best.gantt.png").stat().st_size > 0
    assert (out / "digits_cnn.profile.json").exists()
