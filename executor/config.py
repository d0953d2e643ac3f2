"""How a plan is run or trained: the settings, checked without torch.

:class:`RunConfig` (a measured run, :func:`executor.pipeline.run`), :class:`TrainConfig`
(training, :func:`executor.train.train`), the :class:`OptimizerConfig` of both, and
:func:`check_engine`, which refuses a plan the chosen engine cannot run. They are plain
values: the API process checks a job's fields with them before anything is queued, and
must not load torch to do so (DESIGN.md, "Import name and start-up"); the executor
imports them from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError, PlanError
from pipeplan.core.plan import Plan, Schedule
from pipeplan.executor.emulation import device_slowdowns

if TYPE_CHECKING:  # names for annotations: nothing of torch is loaded here
    import torch

    from pipeplan.executor.partition import ValueMeta

OPTIMIZERS = ("sgd", "adam", "adamw")
Engine = Literal["pipeplan", "torch-pipelining"]
ENGINES: tuple[str, ...] = ("pipeplan", "torch-pipelining")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer every stage runs after each batch."""

    kind: Literal["sgd", "adam", "adamw"] = "sgd"
    """SGD (with optional momentum), Adam, or AdamW (Adam with decoupled weight decay)."""
    lr: float = 0.05
    """Learning rate."""
    momentum: float = 0.0
    """SGD momentum (ignored by Adam)."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient (both optimizers)."""

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise PipeplanError(f"optimizer.kind: one of {list(OPTIMIZERS)}, got {self.kind!r}")
        if not self.lr > 0:
            raise PipeplanError(f"optimizer.lr: must be > 0, got {self.lr!r}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise PipeplanError(
                f"optimizer: momentum and weight_decay must be >= 0, got {self.momentum!r}, "
                f"{self.weight_decay!r}"
            )

    @property
    def state_buffers(self) -> int:
        """Buffers of the parameters' size the optimizer keeps: Adam's two moments, SGD's
        momentum buffer (when it has momentum), else none."""
        if self.kind in ("adam", "adamw"):
            return 2
        return 1 if self.momentum > 0 else 0

    def make(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (torch is imported here, where a worker builds it)."""
        import torch

        if self.kind == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.kind == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(
            params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )


@dataclass(frozen=True)
class RunConfig:
    """How to run a plan."""

    steps: int = 5
    """Measured steps, after the warm-up."""
    warmup: int = 1
    """Steps run first and left out of the batch time (loss and accuracy still reported)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer of every stage."""
    emulate: bool = True
    """Emulate slower device types: each compute lasts ``slowdown x`` its CPU time
    (:func:`executor.emulation.emulation_sleep`)."""
    deterministic: bool = False
    """Disable dropout (needed to compare with single-process training)."""
    data: Literal["digits", "synthetic"] = "synthetic"
    """Batches for :func:`executor.pipeline.run` when none are given."""
    seed: int = 0
    """Seed of the generated or shuffled data."""
    timeout_s: float = 300.0
    """Longest wait for one step, or for one request to the actors."""
    start_timeout_s: float = 180.0
    """Longest wait for every actor to be placed and built."""
    engine: Engine = "pipeplan"
    """Who runs each stage's operations: pipeplan's schedule runner (every plan), or
    PyTorch's pipeline schedules (equal microbatches, no replicas:
    :mod:`executor.torch_engine`)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup < 0:
            raise PlanError(
                f"run: steps must be >= 1 and warmup >= 0, got {self.steps}, {self.warmup}"
            )
        if not (self.timeout_s > 0 and self.start_timeout_s > 0):
            raise PlanError("run: timeouts must be > 0")
        if self.engine not in ENGINES:
            raise PlanError(f"run.engine: {self.engine!r} is not one of {list(ENGINES)}")


@dataclass(frozen=True)
class TrainConfig:
    """How to train."""

    steps: int
    """Steps to have trained at the end (counted from the start of training, not from a
    resumed checkpoint)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: str = "synthetic"
    """The data source (:mod:`executor.data`)."""
    loss: str = "cross-entropy"
    """The loss (:mod:`executor.loss`)."""
    seed: int = 0
    """Seed of the data order (the model's seed is the model reference's)."""
    checkpoint_dir: Path | None = None
    """Where checkpoints go (None: none are taken)."""
    checkpoint_every: int = 0
    """Take a checkpoint every this many steps (0: only after the last step)."""
    resume: Path | None = None
    """A checkpoint to continue from."""
    emulate: bool = True
    deterministic: bool = False
    """Disable dropout (to compare with single-process training)."""
    timeout_s: float = 300.0
    start_timeout_s: float = 180.0
    engine: Engine = "pipeplan"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise PipeplanError(f"steps: must be >= 1, got {self.steps}")
        if self.checkpoint_every < 0:
            raise PipeplanError(f"checkpoint_every: must be >= 0, got {self.checkpoint_every}")
        if self.engine == "torch-pipelining" and self.loss != "cross-entropy":
            raise PipeplanError(
                f"loss: engine torch-pipelining trains with cross-entropy only, not {self.loss!r}"
            )
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise PipeplanError("checkpoint_every: needs a checkpoint directory (checkpoint_dir)")

    def run_config(self) -> RunConfig:
        return RunConfig(
            steps=self.steps,
            warmup=0,
            optimizer=self.optimizer,
            emulate=self.emulate,
            deterministic=self.deterministic,
            seed=self.seed,
            timeout_s=self.timeout_s,
            start_timeout_s=self.start_timeout_s,
            engine=self.engine,
        )


def unsupported(plan: Plan, meta: Mapping[str, ValueMeta], emulated: bool) -> str | None:
    """Why torch.distributed.pipelining (:mod:`executor.torch_engine`) cannot run ``plan``
    (None: it can); ``meta``: what crosses each cut, where the model has been cut."""
    sizes = {s.microbatch for s in plan.stages}
    if len(sizes) > 1:
        return f"unequal microbatches {[s.microbatch for s in plan.stages]}"
    (b,) = sizes
    if plan.global_batch % b:
        return f"microbatch {b} does not divide the global batch {plan.global_batch}"
    m, n = plan.global_batch // b, plan.num_stages
    if plan.schedule is Schedule.ONE_F_ONE_B and m < n:
        return f"1F1B with {m} microbatches for {n} stages (it needs at least one per stage)"
    replicated = [i for i, s in enumerate(plan.stages) if s.replicas > 1]
    if replicated:
        return f"replicated stages {replicated}"
    if plan.recomputing:
        return f"recomputing stages {list(plan.recomputing)}"
    constants = sorted(n for n, m in meta.items() if m.kind == "constant")
    if constants:
        return f"Python constants crossing a stage boundary {constants}"
    if emulated:
        return "emulation of slower device types (run with emulate off)"
    return None


def check_engine(
    plan: Plan,
    cluster: ClusterSpec | None,
    config: RunConfig,
    meta: Mapping[str, ValueMeta] | None = None,
) -> None:
    """Refuse a plan the chosen engine cannot run: before any cluster starts, what the plan
    and the spec tell; with the cut's ``meta`` (:meth:`executor.pipeline.Pipeline.start`),
    a constant crossing a cut too."""
    if config.engine != "torch-pipelining":
        return
    slowdowns = device_slowdowns(cluster, plan.devices) if cluster is not None else {}
    emulated = config.emulate and any(v != 1.0 for v in slowdowns.values())
    why = unsupported(plan, meta or {}, emulated)
    if why is not None:
        raise PlanError(
            f"engine torch-pipelining cannot run this plan: {why}; engine pipeplan runs every plan"
        )
