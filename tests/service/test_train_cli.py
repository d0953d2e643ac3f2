"""``pipeplan train`` and ``pipeplan checkpoint export`` without a cluster: every bad flag is
one line naming it, before any cluster starts; an export writes the plain state_dict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import checkpoint
from tests.service.runner import run_cli as run

PLAN = Plan(16, (Stage((0, 8), ("n0/fast:0",), 16),))
BASE = ("train", "--cluster", "local-pipeline", "--model", "digits_cnn", "--input-size", "8")


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN.to_dict()))
    return path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--steps", "2", "--epochs", "1"), "steps, epochs: give at most one"),
        (("--steps", "0"), "steps: must be >= 1, got 0"),
        (("--checkpoint-every", "2"), "checkpoint_every: needs checkpoint_dir"),
        (("--optimizer", "lion"), "optimizer: one of ['sgd', 'adam', 'adamw'], got 'lion'"),
        (("--epochs", "1"), "epochs: data 'synthetic' has no length; give steps instead"),
        (("--data", "nowhere:x y"), "data: 'nowhere:x y'"),
        (("--loss", "mse"), "loss: 'mse' is neither 'cross-entropy' nor a package.module"),
        (("--replan-threshold", "2"), "'--replan-threshold': Input should be less than or equal"),
    ],
)
def test_bad_flags_are_one_line_naming_them(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    plan_file: Path,
    extra: tuple[str, ...],
    message: str,
) -> None:
    code, _, err = run(monkeypatch, capsys, *BASE, "--plan", str(plan_file), *extra)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_plan_and_planner_are_exclusive(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], plan_file: Path
) -> None:
    code, _, err = run(monkeypatch, capsys, *BASE, "--plan", str(plan_file), "--planner", "dp")
    assert code == 2 and "plan, planner: give exactly one" in err


def test_resume_needs_a_checkpoint_dir(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], plan_file: Path
) -> None:
    code, _, err = run(monkeypatch, capsys, *BASE, "--plan", str(plan_file), "--resume")
    assert code == 2 and "--resume needs --checkpoint-dir" in err


def test_checkpoint_export_writes_the_state_dict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = nn.Linear(3, 2)
    state = checkpoint.shard_state(model.state_dict(keep_vars=True), None, {}, "s0.r0")
    staged = checkpoint.staging_dir(tmp_path / "ck", 1)
    checkpoint.save_shard(state, staged)
    checkpoint.commit(staged, checkpoint.Manifest(1, 1, PLAN.to_dict(), {}, {"kind": "sgd"}))
    out = tmp_path / "model.pt"
    code, _, err = run(
        monkeypatch, capsys, "checkpoint", "export", str(tmp_path / "ck"), "--out", str(out)
    )
    assert code == 0, err
    assert "2 tensors" in err
    loaded = torch.load(out)
    assert torch.equal(loaded["weight"], model.weight.detach())


def test_checkpoint_export_of_nothing_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(
        monkeypatch, capsys, "checkpoint", "export", str(tmp_path), "--out", str(tmp_path / "x")
    )
    assert code == 2 and "checkpoint: " in err and "holds no complete checkpoint" in err


def test_resume_from_alone_writes_beside_the_checkpoint(tmp_path: Path) -> None:
    from pipeplan.service.tasks.train import TrainRequest, _checkpoint_dir

    def request(**kw: object) -> TrainRequest:
        return TrainRequest(cluster="local-hetero", model="digits_cnn", plan={}, **kw)  # type: ignore[arg-type]

    assert _checkpoint_dir(request()) is None
    assert _checkpoint_dir(request(resume_from=str(tmp_path))) == tmp_path
    step = tmp_path / "step-00000004"
    assert _checkpoint_dir(request(resume_from=str(step))) == tmp_path
    assert _checkpoint_dir(request(checkpoint_dir="a", resume_from=str(step))) == Path("a")
