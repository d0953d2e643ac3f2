"""Train a model on a plan: the loop over steps, checkpoints and resume.

:func:`train` deploys the plan (:class:`~executor.pipeline.Pipeline`) with a data
:class:`~executor.stage.Feed`: the first stage's replicas read the inputs of every global
batch from their own data stream and the last stage's the targets, so no batch passes
through the driver. Each step is one call per stage replica; the driver gets back the loss
and the step's time and hands them to ``on_step``.

**Checkpoints** (:mod:`executor.checkpoint`) are taken every ``checkpoint_every`` steps and
after the last one, into ``checkpoint_dir``: every replica writes its part into a staging
folder, then the driver adds the manifest and commits the folder atomically.

**Resume.** ``resume`` names a checkpoint (a step folder, or a checkpoint directory: its
latest). Training continues at the checkpoint's step up to ``steps`` (a total, so the same
command resumed runs only what was left), the data streams at the checkpoint's position.
Under the plan that wrote it, each replica also gets back its random state, so a resumed
run computes bit for bit what the uninterrupted one would have. Under another plan the
weights and optimizer state are re-sharded by parameter name.

**Hooks for a caller that changes plans** (:mod:`executor.elastic`): ``on_started`` gets
the seconds it took to deploy the plan and restore the checkpoint (what a switch of plans
costs), and ``stop_after_checkpoint``, asked after each checkpoint, may end the run there
(the result says ``stopped``); the caller then resumes that checkpoint under another plan.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan
from pipeplan.executor import checkpoint
from pipeplan.executor.checkpoint import Manifest
from pipeplan.executor.config import TrainConfig as TrainConfig
from pipeplan.executor.data import DataSpec, open_stream
from pipeplan.executor.loss import LossSpec
from pipeplan.executor.measure import StepResult
from pipeplan.executor.model import ModelSource
from pipeplan.executor.pipeline import Pipeline
from pipeplan.executor.stage import Feed


@dataclass(frozen=True)
class TrainStep:
    """One trained step, as the driver saw it."""

    step: int
    loss: float
    accuracy: float
    batch_time_s: float
    samples_per_s: float


@dataclass(frozen=True)
class TrainResult:
    """What a training run did."""

    steps: tuple[TrainStep, ...]
    """The steps this run trained (after the resumed checkpoint's, if any)."""
    first_step: int
    """The step it started at (0, or the resumed checkpoint's)."""
    checkpoint: Path | None
    """The last checkpoint it wrote."""
    resumed_from: Path | None = None
    startup_s: float = 0.0
    """Seconds from the start to the first step: deploying the plan, restoring a checkpoint."""
    stopped: bool = False
    """Ended early at ``checkpoint``, because ``stop_after_checkpoint`` asked."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_step": self.first_step,
            "steps": [asdict(s) for s in self.steps],
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
        }


StepHook = Callable[[TrainStep], None]
CheckpointHook = Callable[[int, Path], None]
StartHook = Callable[[float], None]
StopHook = Callable[[int, Path], bool]
ResultHook = Callable[[StepResult], None]


def model_reference(model: ModelSource) -> dict[str, Any]:
    """What a manifest records of the model: enough to build the same architecture."""
    return {
        "name": model.name,
        "input_size": model.input_size,
        "seed": model.seed,
        "options": dict(model.options),
        "input_shape": list(model.input_shape) if model.input_shape else None,
        "input_dtype": model.input_dtype,
        "example": model.example_ref,
    }


def train(
    plan: Plan,
    model: ModelSource,
    cluster: ClusterSpec,
    config: TrainConfig,
    on_step: StepHook | None = None,
    on_checkpoint: CheckpointHook | None = None,
    on_started: StartHook | None = None,
    stop_after_checkpoint: StopHook | None = None,
    on_result: ResultHook | None = None,
) -> TrainResult:
    """Train ``model`` on ``plan`` for ``config.steps`` steps (module docstring).
    ``on_result`` gets each step's :class:`~executor.measure.StepResult` (its operations'
    records: what each stage computed) before ``on_step``."""
    resumed = _resumable(config, plan) if config.resume is not None else None
    first = resumed[1].step if resumed else 0
    if first >= config.steps:
        raise PipeplanError(
            f"steps: the checkpoint is at step {first} already; ask for more than {first} steps"
        )
    feed = Feed(config.data, config.seed, config.loss)
    done: list[TrainStep] = []
    last: Path | None = None
    started = time.perf_counter()
    with Pipeline(plan, model, cluster, config.run_config(), feed) as pipe:
        if resumed is not None:
            folder, manifest = resumed
            same_plan = manifest.plan == json.loads(json.dumps(plan.to_dict()))
            pipe.load_checkpoint(folder, restore_rng=same_plan)
            pipe.seek_data(manifest.data_position, manifest.step)
        startup_s = time.perf_counter() - started
        if on_started is not None:
            on_started(startup_s)
        for t in range(first, config.steps):
            t0 = time.perf_counter()
            result = pipe.step()
            elapsed = time.perf_counter() - t0
            if on_result is not None:
                on_result(result)
            report = TrainStep(
                t, result.loss, result.accuracy, elapsed, plan.global_batch / elapsed
            )
            done.append(report)
            if on_step is not None:
                on_step(report)
            if _checkpoint_due(config, t + 1):
                last = _save(pipe, plan, model, config, t + 1)
                if on_checkpoint is not None:
                    on_checkpoint(t + 1, last)
                if (
                    t + 1 < config.steps
                    and stop_after_checkpoint is not None
                    and stop_after_checkpoint(t + 1, last)
                ):
                    return _result(done, first, last, resumed, startup_s, stopped=True)
    return _result(done, first, last, resumed, startup_s, stopped=False)


def _result(
    done: list[TrainStep],
    first: int,
    last: Path | None,
    resumed: tuple[Path, Manifest] | None,
    startup_s: float,
    stopped: bool,
) -> TrainResult:
    resumed_from = resumed[0] if resumed else None
    return TrainResult(tuple(done), first, last, resumed_from, startup_s, stopped)


def steps_for_epochs(
    model: ModelSource, data: str, loss: str, global_batch: int, seed: int, epochs: int
) -> int:
    """The steps of ``epochs`` passes over ``data`` (global batches per pass, the last
    partial one dropped); refused for a source without a length (synthetic data)."""
    if epochs < 1:
        raise PipeplanError(f"epochs: must be >= 1, got {epochs}")
    built, example = model.build()
    built.eval()
    with torch.no_grad():
        output_shape = tuple(built(example).shape)
    class_targets = LossSpec.parse(loss).class_targets
    stream = open_stream(
        DataSpec.parse(data), example, output_shape, global_batch, seed, class_targets=class_targets
    )
    if stream.batches_per_epoch is None:
        raise PipeplanError(f"epochs: data {data!r} has no length; give steps instead")
    if stream.batches_per_epoch < 1:
        raise PipeplanError(
            f"epochs: data {data!r} holds less than one global batch of {global_batch}"
        )
    return epochs * stream.batches_per_epoch


def _checkpoint_due(config: TrainConfig, trained: int) -> bool:
    if config.checkpoint_dir is None:
        return False
    every = config.checkpoint_every
    return trained == config.steps or (every > 0 and trained % every == 0)


def _save(pipe: Pipeline, plan: Plan, model: ModelSource, config: TrainConfig, step: int) -> Path:
    assert config.checkpoint_dir is not None
    staged = checkpoint.staging_dir(config.checkpoint_dir, step)
    pipe.save_checkpoint(staged)
    manifest = Manifest(
        step=step,
        data_position=step,  # one global batch per step
        plan=plan.to_dict(),
        model=model_reference(model),
        optimizer=asdict(config.optimizer),
        data=config.data,
    )
    return checkpoint.commit(staged, manifest)


def _resumable(config: TrainConfig, plan: Plan) -> tuple[Path, Manifest]:
    """The checkpoint to resume and its manifest; refuses one that cannot continue here."""
    assert config.resume is not None
    folder = checkpoint.resolve(config.resume)
    manifest = checkpoint.read_manifest(folder)
    kind = manifest.optimizer.get("kind")
    if kind != config.optimizer.kind:
        raise PipeplanError(
            f"optimizer: the checkpoint was trained with {kind!r}, not {config.optimizer.kind!r}"
        )
    if manifest.data != config.data:
        raise PipeplanError(
            f"data: the checkpoint was trained on {manifest.data!r}, not {config.data!r}"
        )
    if plan.global_batch != manifest.plan.get("global_batch"):
        raise PipeplanError(
            f"plan.global_batch: {plan.global_batch}, but the checkpoint's plan trained "
            f"{manifest.plan.get('global_batch')} samples a step (the data position would shift)"
        )
    return folder, manifest
