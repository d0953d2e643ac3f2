"""Checkpoints without a cluster: the folder protocol (staging, atomic commit, ``latest``), a
save and a load in one process (weights, Adam's state, the random state), export of the
plain ``state_dict``, and the refusals of a resume that cannot continue."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import checkpoint
from pipeplan.executor.checkpoint import Manifest
from pipeplan.executor.model import ModelSource, OptimizerConfig
from pipeplan.executor.train import TrainConfig, train

PLAN = Plan(4, (Stage((0, 8), ("n0/fast:0",), 4),))


def manifest(step: int, kind: str = "adam") -> Manifest:
    return Manifest(step, step, PLAN.to_dict(), {"name": "m"}, {"kind": kind}, "synthetic")


def save(model: nn.Module, opt: torch.optim.Optimizer, folder: Path, step: int) -> Path:
    params = dict(model.named_parameters())
    state = checkpoint.shard_state(model.state_dict(keep_vars=True), opt, params, "s0.r0")
    staged = checkpoint.staging_dir(folder, step)
    checkpoint.save_shard(state, staged)
    return checkpoint.commit(staged, manifest(step))


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    return model, opt


def test_a_save_loads_back_weights_optimizer_state_and_random_state(tmp_path: Path) -> None:
    model, opt = trained(0)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    folder = save(model, opt, tmp_path, 2)
    fresh, fresh_opt = trained(1)
    torch.manual_seed(999)
    params = dict(fresh.named_parameters())
    checkpoint.load_shard(folder, fresh.state_dict(keep_vars=True), fresh_opt, params, "s0.r0")
    assert torch.equal(torch.rand(3), expected_draw)  # the saved random state is back
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # buffers (BatchNorm's running stats) too
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(value, fresh_opt.state[q][key]), key


def test_a_stage_loads_only_the_entries_it_holds(tmp_path: Path) -> None:
    model, opt = trained(0)
    folder = save(model, opt, tmp_path, 2)
    part = nn.Linear(8, 3)  # another plan's stage: the model's last layer alone, named "3."
    state = {f"3.{n}": t for n, t in part.state_dict(keep_vars=True).items()}
    params = {f"3.{n}": p for n, p in part.named_parameters()}
    part_opt = torch.optim.Adam(part.parameters(), lr=0.01)
    checkpoint.load_shard(folder, state, part_opt, params, None)
    assert torch.equal(part.weight, model[3].weight)
    assert torch.equal(
        part_opt.state[part.weight]["exp_avg"], opt.state[model[3].weight]["exp_avg"]
    )


def test_an_unknown_entry_is_refused_naming_it(tmp_path: Path) -> None:
    model, opt = trained(0)
    folder = save(model, opt, tmp_path, 2)
    other = nn.Linear(2, 2)
    state = {f"head.{n}": t for n, t in other.state_dict(keep_vars=True).items()}
    with pytest.raises(PipeplanError, match=r"checkpoint step-00000002: has no 'head.weight'"):
        checkpoint.load_shard(folder, state, None, {}, None)


def test_export_writes_the_plain_state_dict(tmp_path: Path) -> None:
    model, opt = trained(0)
    save(model, opt, tmp_path / "ck", 2)
    out = tmp_path / "model.pt"
    checkpoint.export_state_dict(tmp_path / "ck", out)
    plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    plain.load_state_dict(torch.load(out), strict=True)
    plain.eval(), model.eval()
    x = torch.randn(6, 4)
    assert torch.equal(plain(x), model(x))


def test_latest_names_the_last_commit_and_a_crashed_save_leaves_it(tmp_path: Path) -> None:
    model, opt = trained(0)
    save(model, opt, tmp_path, 1)
    second = save(model, opt, tmp_path, 2)
    crashed = checkpoint.staging_dir(tmp_path, 3)  # a save that never committed
    (crashed / "__0_0.distcp").write_bytes(b"half")
    assert checkpoint.resolve(tmp_path) == second
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    (tmp_path / "latest").unlink()  # without the pointer: the highest complete step
    assert checkpoint.resolve(tmp_path) == second
    assert checkpoint.read_manifest(second).step == 2


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "resume: no checkpoint at .* \\(not a directory\\)"),
        ("empty", "resume: .* holds no complete checkpoint"),
        ("format", "checkpoint step-00000001: manifest format 99, expected 1"),
    ],
)
def test_bad_checkpoints_are_refused(tmp_path: Path, setup: str, message: str) -> None:
    folder = tmp_path / "ck"
    if setup == "empty":
        folder.mkdir()
    if setup == "format":
        staged = checkpoint.staging_dir(folder, 1)
        checkpoint.commit(staged, Manifest(1, 1, {}, {}, {}, format=99))
    with pytest.raises(PipeplanError, match=message):
        checkpoint.read_manifest(checkpoint.resolve(folder))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"optimizer": OptimizerConfig("sgd")},
            "optimizer: the checkpoint was trained with 'adam'",
        ),
        ({"data": "digits"}, "data: the checkpoint was trained on 'synthetic', not 'digits'"),
        ({"steps": 2}, "steps: the checkpoint is at step 2 already"),
    ],
)
def test_a_resume_that_cannot_continue_is_refused_before_any_actor(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    checkpoint.commit(checkpoint.staging_dir(tmp_path, 2), manifest(2))
    base: dict[str, object] = {"steps": 4, "optimizer": OptimizerConfig("adam"), "resume": tmp_path}
    with pytest.raises(PipeplanError, match=message):
        train(PLAN, ModelSource("digits_cnn", 8), None, TrainConfig(**{**base, **change}))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"steps": 0}, "steps: must be >= 1, got 0"),
        ({"steps": 2, "checkpoint_every": -1}, "checkpoint_every: must be >= 0, got -1"),
        ({"steps": 2, "checkpoint_every": 1}, "checkpoint_every: needs a checkpoint directory"),
        (
            {"steps": 2, "engine": "torch-pipelining", "loss": "m:f"},
            "loss: engine torch-pipelining trains with cross-entropy only",
        ),
    ],
)
def test_bad_train_settings_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(PipeplanError, match=message):
        TrainConfig(**fields)  # type: ignore[arg-type]
