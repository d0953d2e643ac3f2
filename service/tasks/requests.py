"""The use-cases' requests, and the checks that need neither a model nor a cluster.

Requests are pydantic models (the REST API takes them as they are): unknown fields are
refused, types are checked by pydantic, and the values by the core, whose errors name the
field and the value (:class:`~core.errors.PipeplanError`), so the CLI and the API give the
same one-line messages.

This module imports neither torch nor Ray: the CLI's client commands (``submit``, ``jobs``)
and the API build and check requests with it, and the use-cases that run them
(:mod:`service.tasks.plan`, ``compare``, ``profile``, ``run``) import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pipeplan.agents.compare import default_planners
from pipeplan.agents.problem import Budget, Objective, Problem
from pipeplan.agents.registry import PLANNERS, planner_class
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.config import OPTIMIZERS, OptimizerConfig, TrainConfig
from pipeplan.models import zoo_names
from pipeplan.models.reference import check_input

Document = dict[str, Any]
"""A profile, cluster or plan document (DESIGN.md, "Data formats")."""
ClusterRef = str | Document
"""A cluster document, or the name of a preset in examples/clusters."""

PRESETS_DIR = Path(__file__).resolve().parents[2] / "examples" / "clusters"

MEASURED_PLANNERS = ("tapp", "ppo")
"""The planners a measured reward applies to (:mod:`service.tasks.search`)."""
MEASURED_BUDGET = 16
MEASURED_SECONDS = 900.0


class RequestError(PipeplanError):
    """A request that cannot be served as asked; the message names the field and the value."""


class Request(BaseModel):
    """Base of every request: frozen, and unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BudgetRequest(Request):
    """Most plan evaluations and search seconds; ``None``: the use-case's default."""

    evaluations: int | None = None
    seconds: float | None = None

    def resolve(self, default: Budget) -> Budget:
        """The budget, each missing limit taken from ``default``."""
        return Budget(
            evaluations=default.evaluations if self.evaluations is None else self.evaluations,
            seconds=default.seconds if self.seconds is None else self.seconds,
        )


def measured_budget() -> Budget:
    """The default budget of a measured search (:mod:`service.tasks.search`)."""
    return Budget(evaluations=MEASURED_BUDGET, seconds=MEASURED_SECONDS)


def presets() -> list[str]:
    """The names of the cluster presets."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def cluster_spec(ref: ClusterRef) -> ClusterSpec:
    """The cluster a request names: its document, or a preset by name."""
    if isinstance(ref, str):
        if ref not in presets():
            raise RequestError(f"cluster: unknown preset {ref!r} (one of {', '.join(presets())})")
        return ClusterSpec.load(PRESETS_DIR / f"{ref}.yaml")
    return ClusterSpec.from_dict(ref)


# --- a model ----------------------------------------------------------------------------------

MODEL_FIELDS = ("model_options", "input_shape", "input_dtype", "example")
"""The fields that describe how a named ``model`` is built, beside ``model`` and
``input_size``; they apply only with ``model``."""


class ModelFields(Request):
    """How a request's ``model`` is built. ``model`` is a zoo name, ``package.module:factory``
    or ``hf:ClassName`` (:mod:`models.spec`); the service takes a reference to code only
    where ``PIPEPLAN_ALLOW_CODE`` is on, and imports it only inside the job."""

    model_options: dict[str, Any] = {}
    """Keyword arguments of the zoo builder, the factory or the ``hf:`` config
    (``{"n_layer": 48}``)."""
    input_shape: list[int] | None = None
    """A factory's input shape without the batch dimension (``[3, 224, 224]``)."""
    input_dtype: Literal["float32", "int64"] | None = None
    """A factory's input dtype with ``input_shape`` (``int64``: token ids 0)."""
    example: str | None = None
    """A factory's example input: ``package.module:function`` returning a batch-1 tensor."""


def check_model_fields(request: ModelFields, model: str | None) -> None:
    """Without ``model``, none of :data:`MODEL_FIELDS` applies."""
    if model is not None:
        return
    for name in MODEL_FIELDS:
        value = getattr(request, name)
        if value not in (None, {}):
            raise RequestError(f"{name}: only applies with model, got {value!r}")


def check_source(
    model: str | None,
    input_size: int | None,
    profile: ModelProfile | None,
    *,
    options: Mapping[str, Any] | None = None,
    input_shape: Sequence[int] | None = None,
    input_dtype: str | None = None,
    example: str | None = None,
) -> None:
    """Whether the executor can name a model to build (:func:`service.tasks.live.model_source`):
    exactly one of ``model`` (its form and input fields) or a ``profile`` of a zoo model,
    without ``input_size`` or the model fields. Nothing is imported."""
    if (model is None) == (profile is None):
        raise RequestError(
            "model, profile: give exactly one of model (a zoo name) or profile (a document)"
        )
    if model is not None:
        check_input(model, input_size, input_shape, input_dtype, example)
        return
    assert profile is not None  # one of the two, checked above
    if input_size is not None:
        raise RequestError("input_size: only applies with model (a profile has its own)")
    given = {"model_options": options or None, "input_shape": input_shape,
             "input_dtype": input_dtype, "example": example}  # fmt: skip
    for name, value in given.items():
        if value is not None:
            raise RequestError(f"{name}: only applies with model, got {value!r}")
    if profile.name not in zoo_names.MODELS:
        raise RequestError(
            f"profile: its model {profile.name!r} is not a zoo model the executor can build "
            f"(one of {', '.join(zoo_names.MODELS)}); give model instead"
        )


# --- a planning problem -----------------------------------------------------------------------


class ProblemRequest(ModelFields):
    """A planning problem: a model (``model``, a reference, or a ``profile`` document), a
    cluster, an objective and the batch to plan for."""

    cluster: ClusterRef
    model: str | None = None
    input_size: int | None = None
    profile: Document | None = None
    objective: Objective = Objective.TIME
    min_throughput: float | None = None
    batch: int = 64
    schedule: Schedule = Schedule.GPIPE
    microbatches: int | None = None
    seed: int = 0
    budget: BudgetRequest = BudgetRequest()
    devices: Literal["all", "free"] = "all"
    """``free``: plan on the devices no reservation holds when the job is submitted (the
    service narrows ``cluster`` to them, and the result's ``assumed_devices`` names them);
    ``all``: on every device of ``cluster``."""


def check_problem_fields(request: ProblemRequest) -> None:
    """The request's own checks, before the cluster is read or a model profiled."""
    if (request.model is None) == (request.profile is None):
        raise RequestError(
            "model, profile: give exactly one of model (a zoo name) or profile (a document)"
        )
    if request.input_size is not None and request.model is None:
        raise RequestError("input_size: only applies with model")
    check_model_fields(request, request.model)
    if request.objective is Objective.COST and request.min_throughput is None:
        raise RequestError(
            "min_throughput: required with objective cost (samples/s to reach; "
            "0 asks for the cheapest plan per sample at any speed)"
        )


def problem_of(
    request: ProblemRequest, profile: ModelProfile, cluster: ClusterSpec, budget: Budget
) -> Problem:
    """The request's problem on ``profile`` and ``cluster`` (checked by :class:`Problem`)."""
    return Problem(
        profile=profile,
        cluster=cluster,
        objective=request.objective,
        global_batch=request.batch,
        schedule=request.schedule,
        microbatches=request.microbatches,
        min_throughput=request.min_throughput,
        seed=request.seed,
        budget=budget,
    )


# --- plan -------------------------------------------------------------------------------------


class Reward(StrEnum):
    """Where a plan's value comes from: the cost model (in this process, or split over
    ``workers`` Ray tasks), or a run on the cluster."""

    SIMULATED = "simulated"
    PARALLEL = "parallel"
    MEASURED = "measured"


class PlanRequest(ProblemRequest):
    """A problem, the planner to search it with, and where the rewards come from."""

    planner: str
    options: dict[str, Any] = {}
    reward: Reward = Reward.SIMULATED
    workers: int | None = None
    repeats: int = 3
    warmup: int = 1
    address: str | None = None
    concurrent: bool | None = None


def planner_options(options: dict[str, Any]) -> dict[str, Any]:
    """Options as the planners' frozen configs take them: JSON lists become tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def check_plan_fields(request: PlanRequest) -> None:
    """The checks that need no cluster and no profile."""
    if request.planner not in PLANNERS:
        raise RequestError(
            f"planner: unknown planner {request.planner!r} (one of {', '.join(PLANNERS)})"
        )
    if request.reward is Reward.MEASURED and request.planner not in MEASURED_PLANNERS:
        raise RequestError(
            f"reward: measured applies to {' and '.join(MEASURED_PLANNERS)} (learned planners "
            f"that spend few evaluations), not {request.planner!r}"
        )
    if (request.reward is Reward.PARALLEL) != (request.workers is not None):
        raise RequestError(
            f"workers: goes with reward parallel (got workers {request.workers!r}, "
            f"reward {request.reward.value!r})"
        )
    if request.concurrent is not None and request.reward is not Reward.MEASURED:
        raise RequestError(f"concurrent: goes with reward measured, not {request.reward.value!r}")
    if request.workers is not None and request.workers < 1:
        raise RequestError(f"workers: must be >= 1, got {request.workers}")
    if request.address is not None and not uses_ray(request):
        raise RequestError(
            "address: only applies where the search uses a Ray cluster (reward measured or "
            f"parallel, or planner ppo), not {request.planner!r} with reward "
            f"{request.reward.value!r}"
        )


def uses_ray(request: PlanRequest) -> bool:
    """Whether the search runs on a Ray cluster (its workers, or its measured runs)."""
    return request.reward is not Reward.SIMULATED or planner_class(request.planner).needs_ray


# --- compare ----------------------------------------------------------------------------------


class CompareRequest(ProblemRequest):
    """A problem and the planners to run on it (default: every classical baseline)."""

    planners: list[str] | None = None


def planner_names(requested: list[str] | None) -> list[str]:
    """The planners to run, in order, each once; unknown names are an error."""
    names = default_planners() if requested is None else [n.strip() for n in requested]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in PLANNERS]
    if unknown or not names:
        what = f"unknown planner {unknown[0]!r}" if unknown else "no planner named"
        raise RequestError(f"planners: {what} (one of {', '.join(PLANNERS)})")
    return list(dict.fromkeys(names))


# --- profile ----------------------------------------------------------------------------------


class ProfileRequest(ModelFields):
    """A model to profile, and where its layer times come from
    (:mod:`service.tasks.profile`)."""

    model: str
    input_size: int | None = None
    device_type: str | None = None
    cluster: ClusterRef | None = None
    measure: bool = False
    address: str | None = None


# --- run --------------------------------------------------------------------------------------


class DataKind(StrEnum):
    """The training data: synthetic tensors, or scikit-learn's digits (images)."""

    SYNTHETIC = "synthetic"
    DIGITS = "digits"


class EngineKind(StrEnum):
    """Who runs each stage's operations: pipeplan's schedule runner (every plan), or
    PyTorch's ``torch.distributed.pipelining`` schedules (equal microbatches, no replicas)."""

    PIPEPLAN = "pipeplan"
    TORCH_PIPELINING = "torch-pipelining"


class RunRequest(ModelFields):
    """A plan to run, the model, the cluster (spec to start, or spec of ``address``)."""

    plan: Document
    cluster: ClusterRef | None = None
    model: str | None = None
    input_size: int | None = None
    profile: Document | None = None
    steps: int = 5
    warmup: int = 1
    data: DataKind = DataKind.SYNTHETIC
    seed: int = 0
    timeout_s: float = 300.0
    address: str | None = None
    engine: EngineKind = EngineKind.PIPEPLAN
    emulate: bool = True


# --- train ------------------------------------------------------------------------------------


class TrainRequest(ProblemRequest):
    """What to train, on which plan (``plan``, or ``planner`` to search one first), how
    long, and where checkpoints go (:mod:`service.tasks.train`). It lives here, beside the
    other requests, so that the client commands and the API build and check it without
    torch."""

    plan: Document | None = None
    planner: str | None = None
    options: dict[str, Any] = {}
    steps: int | None = None
    """Steps to have trained in all (default 10 without ``epochs``)."""
    epochs: int | None = None
    """Passes over the data instead of ``steps`` (a source with a length)."""
    data: str = "synthetic"
    loss: str = "cross-entropy"
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume_from: str | None = None
    timeout_s: float = 300.0
    address: str | None = None
    engine: EngineKind = EngineKind.PIPEPLAN
    emulate: bool = True
    deterministic: bool = False
    elastic: bool = True
    """Re-plan and resume when a node is lost; put joined nodes to use
    (:mod:`executor.elastic`)."""
    replan_threshold: float = 0.10
    """Switch to a plan on joined devices when its predicted gain, less the measured switch
    cost's share of the remaining training, is above this (0 to 1)."""


def check_train_fields(request: TrainRequest) -> None:
    """The request's own checks, before any cluster, profile or import."""
    if (request.plan is None) == (request.planner is None):
        raise RequestError("plan, planner: give exactly one (a plan document, or a planner)")
    if request.planner is None and request.options:
        raise RequestError("options: only apply with planner")
    if request.steps is not None and request.epochs is not None:
        raise RequestError("steps, epochs: give at most one")
    for name in ("steps", "epochs"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise RequestError(f"{name}: must be >= 1, got {value}")
    if request.checkpoint_every < 0:
        raise RequestError(f"checkpoint_every: must be >= 0, got {request.checkpoint_every}")
    if request.checkpoint_every and request.checkpoint_dir is None:
        raise RequestError("checkpoint_every: needs checkpoint_dir")
    if request.optimizer not in OPTIMIZERS:
        raise RequestError(f"optimizer: one of {list(OPTIMIZERS)}, got {request.optimizer!r}")
    if not 0.0 <= request.replan_threshold <= 1.0:
        raise RequestError(f"replan_threshold: must be in [0, 1], got {request.replan_threshold!r}")


def train_config(
    request: TrainRequest, steps: int, checkpoint_dir: Path | None, resume: Path | None
) -> TrainConfig:
    """The executor's settings of a request (checked: optimizer, steps, checkpoints)."""
    optimizer = OptimizerConfig(
        request.optimizer,  # type: ignore[arg-type]  # checked by check_train_fields
        request.lr,
        request.momentum,
        request.weight_decay,
    )
    return TrainConfig(
        steps=steps,
        optimizer=optimizer,
        data=request.data,
        loss=request.loss,
        seed=request.seed,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=request.checkpoint_every,
        resume=resume,
        emulate=request.emulate,
        deterministic=request.deterministic,
        timeout_s=request.timeout_s,
        engine=request.engine.value,
    )
