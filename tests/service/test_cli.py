"""The command line: JSON output, tables, Gantt charts and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from tests.core.test_formats import CLUSTER, PLAN, PROFILE
from tests.service.runner import run_cli as run


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name, doc in (("profile", PROFILE), ("cluster", CLUSTER), ("plan", PLAN)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(doc))
    return paths


def test_simulate_json_matches_the_cost_model(monkeypatch, capsys, files) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = run(
        monkeypatch,
        capsys,
        "simulate",
        "--profile",
        str(files["profile"]),
        "--cluster",
        str(files["cluster"]),
        "--plan",
        str(files["plan"]),
        "--json",
    )
    assert code == 0
    doc = json.loads(out)
    est = simulate(
        Plan.from_dict(PLAN), ModelProfile.from_dict(PROFILE), ClusterSpec.from_dict(CLUSTER)
    )
    assert doc["batch_time_s"] == est.batch_time_s
    for key in ("throughput", "cost_per_hour", "cost_per_batch", "comm_fraction", "fits"):
        assert key in doc
    assert [s["memory_bytes"] for s in doc["stages"]] == [s.memory_bytes for s in est.stages]


def test_simulate_table_and_gantt(monkeypatch, capsys, files, tmp_path) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "g.png"
    code, out, _ = run(
        monkeypatch,
        capsys,
        "simulate",
        "--profile",
        str(files["profile"]),
        "--cluster",
        str(files["cluster"]),
        "--plan",
        str(files["plan"]),
        "--gantt",
        str(png),
    )
    assert code == 0
    assert "batch time" in out and "n1/cpu:0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_uniform_plan_on_a_preset(monkeypatch, capsys, files, tmp_path) -> None:  # type: ignore[no-untyped-def]
    saved = tmp_path / "u.json"
    code, out, _ = run(
        monkeypatch,
        capsys,
        "simulate",
        "--profile",
        str(files["profile"]),
        "--cluster",
        str(files["cluster"]),
        "--uniform",
        "3",
        "--batch",
        "8",
        "--microbatches",
        "2",
        "--save-plan",
        str(saved),
        "--json",
    )
    assert code == 0
    plan = Plan.load(saved)
    assert [s.layers for s in plan.stages] == [(0, 1), (1, 2), (2, 3)]
    assert json.loads(out)["global_batch"] == 8


@pytest.mark.parametrize("kind", ["profile", "cluster", "plan"])
def test_validate_detects_each_kind(monkeypatch, capsys, files, kind) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = run(monkeypatch, capsys, "validate", str(files[kind]))
    assert code == 0 and out.startswith(f"ok: {files[kind]}: {kind}")


def test_validate_plan_against_cluster(monkeypatch, capsys, files, tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {**PLAN, "stages": [{"layers": [0, 3], "devices": ["n5/t4:0"], "microbatch": 8}]}
        )
    )
    code, _, err = run(
        monkeypatch, capsys, "validate", str(bad), "--cluster", str(files["cluster"])
    )
    assert code == 2
    assert err.strip().startswith("error: stages[0].devices: unknown device 'n5/t4:0'")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["simulate", "--profile", "missing.json", "--cluster", "x", "--plan", "p"],
            "error: cannot read missing.json",
        ),
        (["simulate", "--nope"], "error: No such option: --nope"),
        (["validate"], "error: Missing argument"),
        (
            ["simulate", "--profile", "{profile}", "--cluster", "{cluster}"],
            "error: plan, uniform: give exactly one of a plan document or uniform",
        ),
        (
            ["simulate", "--profile", "{profile}", "--cluster", "{cluster}", "--uniform", "9"],
            "error: uniform.devices: must be in [1, 3]",
        ),
        (
            ["simulate", "--profile", "{cluster}", "--cluster", "{cluster}", "--uniform", "1"],
            "error: profile.layers: missing",
        ),
        (["profile", "resnet1000"], "resnet1000"),
        (["profile", "--pipedream", "{plan}"], "error: --batch-size: required with --pipedream"),
    ],
)
def test_errors_are_one_line_and_exit_2(monkeypatch, capsys, files, args, message) -> None:  # type: ignore[no-untyped-def]
    args = [a.format(**{k: str(v) for k, v in files.items()}) for a in args]
    code, _, err = run(monkeypatch, capsys, *args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_long_step_is_a_line_in_a_log(monkeypatch, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Where stderr is not a terminal (a pipe, a log, CI) a step's spinner would draw nothing:
    the step is announced as one line instead, before it runs."""
    out = tmp_path / "p.json"
    code, _, err = run(monkeypatch, capsys, "profile", "digits_cnn", "--input-size", "8",
                       "-o", str(out))  # fmt: skip
    assert code == 0, err
    assert err.splitlines()[0] == "profiling digits_cnn ..."
    assert err.splitlines()[1].startswith(f"wrote {out}")
