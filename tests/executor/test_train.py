"""Training on a plan, on a real 3-node local Ray cluster (local-hetero): the data read by
the stages themselves, checkpoints, resume (bit for bit under the same plan, re-sharded under
another), a killed driver, and export of the single-process ``state_dict``.

The model is a 2-layer GPT with dropout on (so a resumed run must restore each replica's
random state) trained with Adam (so it must restore the optimizer's state too), on a plan
whose last stage is replicated over n2's two devices.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.executor import checkpoint
from pipeplan.executor.data import synthetic_batches
from pipeplan.executor.export import export_torchrun
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.loss import loss_terms
from pipeplan.executor.model import ModelSource, OptimizerConfig, train_single_process
from pipeplan.executor.train import TrainConfig, train
from tests.executor.actors import wait_no_workers
from tests.executor.test_export import torchrun
from tests.executor.train_plans import BATCH, three_stages

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_FILE = ROOT / "examples/clusters/local-hetero.yaml"
SPEC = ClusterSpec.load(CLUSTER_FILE)
CLUSTER_OPTIONS = {"keep_awake": False}
"""No run here is emulated: no idle-priority spinners on the cores (the module's cluster)."""
GPT = {"n_layer": 2, "d_model": 32, "n_head": 2, "n_ctx": 8, "vocab_size": 50}
MODEL = ModelSource("gpt", 8, seed=2, options=GPT)
ADAM = OptimizerConfig("adam", lr=0.01)
SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
"""Compared with single-process training: Adam's normalised step turns rounding-level
gradient differences on near-zero gradients into lr-sized ones."""


def two_stages() -> Plan:
    return Plan(BATCH, (Stage((0, 16), ("n1/mid:0",), 8), Stage((16, 30), ("n0/fast:0",), 4)))


def config(steps: int, folder: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = {
        "steps": steps,
        "optimizer": ADAM,
        "seed": 5,
        "checkpoint_dir": folder,
        "emulate": False,
        "timeout_s": 60,
        "start_timeout_s": 150,
    }
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return loss_terms(model(x), y).loss_sum


def weights(folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    return checkpoint.export_state_dict(folder, tmp / f"export-{time.monotonic_ns()}.pt")


@pytest.mark.timeout(300)
def test_training_equals_single_process_and_exports(cluster: LocalCluster, tmp_path: Path) -> None:
    """Deterministic (no dropout): 3 steps on the plan give single-process training's losses
    and weights (SGD with momentum), and the exported state_dict loads into the plain model."""
    cfg = config(3, tmp_path / "ck", deterministic=True, optimizer=SGD)
    done = train(three_stages(Schedule.ONE_F_ONE_B), MODEL, SPEC, cfg)
    model, example = MODEL.build()
    model.eval()
    with torch.no_grad():
        out_shape = tuple(model(example).shape)
    batches = synthetic_batches(example, out_shape, BATCH, 3, seed=5)
    ref = train_single_process(MODEL, batches, SGD, deterministic=True)
    assert [s.loss for s in done.steps] == pytest.approx(ref.losses, abs=1e-5)
    got = checkpoint.export_state_dict(tmp_path / "ck", tmp_path / "model.pt")
    for name, want in ref.parameters.items():
        assert torch.allclose(got[name], want, atol=1e-5), name
    plain, reference = MODEL.build()[0], MODEL.build()[0]
    plain.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
    reference.load_state_dict(ref.parameters, strict=False)
    x, y = batches[0]
    assert float(loss_of(plain, x, y)) == pytest.approx(float(loss_of(reference, x, y)), abs=1e-6)
    assert wait_no_workers() == 0


@pytest.mark.timeout(400)
def test_resume_continues_bit_for_bit(cluster: LocalCluster, tmp_path: Path) -> None:
    """4 steps straight, or 2 steps + resume + 2 steps: the same weights exactly (dropout
    on: each replica's random state comes back with the checkpoint). GPipe here, 1F1B in
    the killed driver's test."""
    plan = three_stages(Schedule.GPIPE)
    straight = train(plan, MODEL, SPEC, config(4, tmp_path / "a"))
    train(plan, MODEL, SPEC, config(2, tmp_path / "b"))
    resumed = train(plan, MODEL, SPEC, config(4, tmp_path / "b", resume=tmp_path / "b"))
    assert resumed.first_step == 2 and [s.step for s in resumed.steps] == [2, 3]
    assert [s.loss for s in resumed.steps] == [s.loss for s in straight.steps[2:]]
    a, b = weights(tmp_path / "a", tmp_path), weights(tmp_path / "b", tmp_path)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.timeout(300)
def test_resume_on_another_plan_reshards_by_name(cluster: LocalCluster, tmp_path: Path) -> None:
    """2 steps on 3 stages, then 2 on 2 stages with other cuts and devices: single-process
    training's weights after 4 steps (the momentum buffers re-sharded with the weights)."""
    folder = tmp_path / "ck"
    train(three_stages(), MODEL, SPEC, config(2, folder, deterministic=True, optimizer=SGD))
    cfg = config(4, folder, deterministic=True, resume=folder, optimizer=SGD)
    train(two_stages(), MODEL, SPEC, cfg)
    manifest = checkpoint.read_manifest(checkpoint.resolve(folder))
    assert manifest.step == 4 and len(manifest.plan["stages"]) == 2
    model, example = MODEL.build()
    model.eval()
    with torch.no_grad():
        out_shape = tuple(model(example).shape)
    ref = train_single_process(
        MODEL, synthetic_batches(example, out_shape, BATCH, 4, seed=5), SGD, deterministic=True
    )
    got = weights(folder, tmp_path)
    for name, want in ref.parameters.items():
        assert torch.allclose(got[name], want, atol=1e-5), name


@pytest.mark.timeout(400)
def test_killed_driver_resumes_to_the_same_weights(cluster: LocalCluster, tmp_path: Path) -> None:
    """``pipeplan train`` (1F1B) killed with SIGKILL once its second checkpoint is in: the
    run resumed from the latest checkpoint ends with the uninterrupted run's weights."""
    plan_file = tmp_path / "plan.json"
    plan = three_stages(Schedule.ONE_F_ONE_B)
    plan_file.write_text(json.dumps(plan.to_dict()))
    folder = tmp_path / "ck"
    args = [
        sys.executable, "-c", "from pipeplan.service.cli import main; main()",
        "train", "--plan", str(plan_file),
        "--cluster", str(CLUSTER_FILE), "--address", cluster.address, "--model", "gpt",
        "--input-size", "8", "--steps", "4", "--checkpoint-dir", str(folder),
        "--checkpoint-every", "1", "--optimizer", "adam", "--lr", "0.01", "--seed", "2",
        "--no-emulate", "--timeout", "60",
        *[a for k, v in GPT.items() for a in ("-M", f"{k}={v}")],
    ]  # fmt: skip
    driver = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not (folder / checkpoint.step_name(2)).exists():
        assert driver.poll() is None, driver.stdout.read().decode() if driver.stdout else ""
        assert time.monotonic() < deadline, "no second checkpoint"
        time.sleep(0.1)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    assert wait_no_workers(30) == 0  # the dead driver's actors go with it
    source = ModelSource("gpt", 8, seed=2, options=GPT)
    resumed = train(plan, source, SPEC, config(4, folder, resume=folder, seed=2))
    assert resumed.first_step in (2, 3)
    straight = train(plan, source, SPEC, config(4, tmp_path / "straight", seed=2))
    a, b = weights(folder, tmp_path), weights(tmp_path / "straight", tmp_path)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert [s.loss for s in straight.steps[resumed.first_step :]] == [s.loss for s in resumed.steps]


@pytest.mark.timeout(400)
def test_the_exported_torchrun_script_trains_to_pipeplans_losses(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The plan exported for torchrun (torch.distributed.pipelining, 3 ranks on gloo) and the
    same plan under ``pipeplan train``, same seeds, 2 steps: the same losses."""
    plan = Plan(
        BATCH,
        (
            Stage((0, 10), ("n0/fast:0",), 2),
            Stage((10, 20), ("n1/mid:0",), 2),
            Stage((20, 30), ("n2/slow:0",), 2),
        ),
        Schedule.ONE_F_ONE_B,
    )
    model = ModelSource("gpt", 8, seed=2, options={**GPT, "dropout": 0.0})
    export_torchrun(plan, model, tmp_path / "export", optimizer=SGD, seed=5, steps=2)
    scripted = torchrun(tmp_path / "export", 3, 2)
    trained = train(plan, model, SPEC, config(2, tmp_path / "ck", optimizer=SGD))
    assert scripted == pytest.approx([s.loss for s in trained.steps], abs=1e-5)
