"""``pipeplan calibrate --runs``: a calibration fitted to runs already measured (no Ray);
the probes on a live cluster are tested in test_run_cli.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan
from tests.calibration_cases import TRUTH, cluster, plans, profile
from tests.service.runner import run_cli as cli


def run_document(plan: Plan, spec: ClusterSpec) -> dict[str, Any]:
    """What `pipeplan run --json` writes, as far as calibration reads it; the "measurement"
    is the cost model's answer on ``spec``."""
    est = simulate(plan, profile(), spec)
    stages = [
        {"forward_s": s.microbatches * s.forward_s, "backward_s": s.microbatches * s.backward_s}
        for s in est.stages
    ]
    measured = {"batch_time_s": est.batch_time_s, "batch_time_std_s": 0.001, "stages": stages}
    return {"plan": plan.to_dict(), "measured": measured, "emulated": True}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Any]:
    truth = cluster().calibrated(TRUTH)
    runs = []
    for i, plan in enumerate(plans()):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(run_document(plan, truth)))
        runs.append(path)
    spec, prof = tmp_path / "c.yaml", tmp_path / "p.json"
    cluster().save(spec)
    profile().save(prof)
    return {"runs": runs, "cluster": spec, "profile": prof, "dir": tmp_path}


def test_runs_are_fitted_and_judged_on_the_ones_left_out(monkeypatch, capsys, files) -> None:  # type: ignore[no-untyped-def]
    out = files["dir"] / "c.calibrated.yaml"
    args = [a for path in files["runs"] for a in ("--runs", str(path))]
    # fmt: off
    code, text, err = cli(
        monkeypatch, capsys, "calibrate", "--cluster", str(files["cluster"]), "--profile",
        str(files["profile"]), *args, "--out", str(out), "--json",
    )
    # fmt: on
    assert code == 0, err
    report = json.loads(text)
    summary = report["summary"]
    assert summary["held_out_plans"] == len(files["runs"]) // 2
    assert summary["held_out_median_abs_error_before"] > 0.1
    assert summary["held_out_median_abs_error_after"] < 0.01
    spec = ClusterSpec.load(out)
    assert spec.calibration is not None
    assert spec.calibration.fit["runs"] == len(files["runs"])
    assert spec.calibration.scale("slow") == pytest.approx(1.3, rel=0.02)
    code, text, _ = cli(
        monkeypatch, capsys, "calibrate", "--cluster", str(files["cluster"]), "--profile",
        str(files["profile"]), *args, "--out", str(out),
    )  # fmt: skip
    assert code == 0 and "held-out plans (5): median |error|" in text and f"wrote {out}" in text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("measured"), "runs[0]: needs 'plan' and 'measured'"),
        (
            lambda d: d["measured"].update(batch_time_s=0),
            "runs[0].measured.batch_time_s: must be a number > 0, got 0",
        ),
        (lambda d: d["measured"]["stages"].pop(), "runs[0].measured.stages: expected 1 stages"),
        (
            lambda d: d["measured"]["stages"][0].pop("backward_s"),
            "runs[0].measured.stages[0]: needs numbers forward_s and backward_s",
        ),
        (
            lambda d: d["measured"]["stages"][0].update(allreduce_s="slow"),
            "runs[0].measured.stages[0].allreduce_s: must be a number >= 0, got 'slow'",
        ),
        (
            lambda d: d["measured"]["stages"][0].update(update_s=-1),
            "runs[0].measured.stages[0].update_s: must be a number >= 0, got -1",
        ),
        (
            lambda d: d["plan"]["stages"][0].update(devices=["n9/fast:0"]),
            "runs[0].plan: stages[0].devices: unknown device 'n9/fast:0'",
        ),
    ],
)
def test_a_bad_run_is_refused_naming_it(monkeypatch, capsys, files, change, message) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(files["runs"][0].read_text())
    change(doc)
    files["runs"][0].write_text(json.dumps(doc))
    code, out, err = cli(
        monkeypatch, capsys, "calibrate", "--cluster", str(files["cluster"]), "--profile",
        str(files["profile"]), "--runs", str(files["runs"][0]),
    )  # fmt: skip
    assert code == 2 and message in err and not out


def test_runs_need_the_profile(monkeypatch, capsys, files) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli(
        monkeypatch, capsys, "calibrate", "--cluster", str(files["cluster"]), "--runs",
        str(files["runs"][0]),
    )  # fmt: skip
    assert code == 2 and "profile: required with runs" in err
