"""The command line of production-scale planning: ``pipeplan profile gen:...`` writes a
generated profile, ``pipeplan validate`` reads the scale presets, and ``pipeplan plan``
prints the lower bound and the answer's ratio to it (and ``--json`` carries both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.core.bounds import lower_bound
from pipeplan.core.profile import ModelProfile
from pipeplan.models import shapes
from pipeplan.service.tasks.common import cluster_spec
from tests.service.runner import run_cli as run

ROOT = Path(__file__).resolve().parents[2]
SCALE = ROOT / "examples" / "clusters" / "scale"
SMALL = ["-M", "n_layer=3", "-M", "d_model=256", "-M", "n_head=4", "-M", "vocab_size=1000"]


@pytest.mark.parametrize(
    ("name", "nodes", "devices"), [("dc-64", 10, 64), ("dc-328", 56, 328), ("dc-1024", 216, 1024)]
)
def test_validate_reads_each_scale_preset(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, name: str, nodes: int, devices: int
) -> None:
    path = SCALE / f"{name}.yaml"
    code, out, err = run(monkeypatch, capsys, "validate", str(path))
    assert code == 0, err
    assert out.startswith(f"ok: {path}: cluster '{name}': {nodes} nodes, {devices} devices (")


def test_profile_writes_a_generated_model(monkeypatch, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "gpt.json"
    code, _, err = run(
        monkeypatch, capsys, "profile", "gen:gpt-13b", "--input-size", "512",
        "-M", "precision=fp32", "-o", str(path),
    )  # fmt: skip
    assert code == 0, err
    assert f"wrote {path}: 42 layers" in err
    written = ModelProfile.load(path)
    assert written == shapes.generate("gpt-13b", 512, {"precision": "fp32"})
    code, out, _ = run(monkeypatch, capsys, "profile", "--list")
    assert "gen:gpt-70b" in out.splitlines() and "gpt" in out.splitlines()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device-type", "cpu"], "--device-type: not with a generated model (gen:resnet152)"),
        (["--measure"], "--measure: not with a generated model"),
        (["--input-shape", "3,8,8"], "--input-shape: not with a generated model"),
        (["-M", "precision=fp8"], "precision: 'fp8' is not one of mixed, fp32"),
        (["-M", "width=3"], "gen:resnet152: unknown option 'width'"),
    ],
)
def test_profile_refuses_what_a_generated_model_cannot_take(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, args: list[str], message: str
) -> None:
    code, _, err = run(monkeypatch, capsys, "profile", "gen:resnet152", *args)
    assert code != 0
    assert message in err


def test_plan_prints_the_lower_bound_and_the_ratio(monkeypatch, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "small.json"
    code, _, err = run(monkeypatch, capsys, "profile", "gen:gpt-13b", "--input-size", "64",
                       *SMALL, "-o", str(path))  # fmt: skip
    assert code == 0, err
    args = ["plan", "--profile", str(path), "--cluster", "cloud-mix", "--planner", "greedy",
            "--batch", "16"]  # fmt: skip
    code, out, err = run(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    bound = lower_bound(ModelProfile.load(path), cluster_spec("cloud-mix"), 16)
    assert doc["lower_bound_s"] == bound.batch_time_s
    batch_time = doc["estimate"]["batch_time_s"]
    assert doc["ratio_to_bound"] == pytest.approx(batch_time / bound.batch_time_s, rel=1e-12)
    assert doc["ratio_to_bound"] >= 1
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 0, err
    (line,) = [x for x in out.splitlines() if x.startswith("lower bound")]
    assert f"{bound.batch_time_s * 1e3:.3f} ms" in line
    assert f"this plan is {doc['ratio_to_bound']:.2f}x it" in line
