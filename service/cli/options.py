"""The options several commands share, declared once: the problem a planning command
describes (``plan``, ``compare``, ``provision`` and ``submit plan|compare``), how a named
model is built (those, ``profile`` and ``run``), a search's options (``plan``, ``submit
plan``), and the flags ``submit profile|run`` take from ``profile`` and ``run``.

Neither torch nor Ray: the client commands (``submit ...``) build their requests with it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from dataclasses import fields as dataclass_fields
from enum import StrEnum
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_type_hints

import typer

from pipeplan.agents.problem import Budget, Objective, ProblemError
from pipeplan.agents.registry import planner_class
from pipeplan.core._io import read_document
from pipeplan.core.model_refs import parse_options as parse_model_options
from pipeplan.core.model_refs import parse_shape
from pipeplan.core.plan import Schedule
from pipeplan.service.cli.console import CliError, cluster_ref, document
from pipeplan.service.tasks.requests import DataKind, EngineKind, Reward

F = TypeVar("F", bound=Callable[..., Any])
REQUIRED = inspect.Parameter.empty
"""The default of an option with none: typer makes it required."""

# --- a model ----------------------------------------------------------------------------------

MODEL_FORMS = (
    "a zoo name (pipeplan profile --list), package.module:factory (a callable returning an "
    "nn.Module; its input from --input-shape or --example), or hf:ClassName (a transformers "
    "model from its config, random weights, e.g. hf:GPT2LMHeadModel)"
)
ModelRefOpt = Annotated[str | None, typer.Option("--model", help=f"the model: {MODEL_FORMS}")]


class InputDtype(StrEnum):
    """A factory model's input dtype: images and features, or token ids."""

    FLOAT32 = "float32"
    INT64 = "int64"


ModelOptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--model-option",
        "-M",
        help="model option key=value (repeatable; int, float, true/false or text): a zoo "
        "model's, a factory's keyword argument or an hf: config field, e.g. -M n_layer=48",
    ),
]
InputShapeOpt = Annotated[
    str | None,
    typer.Option(help="a factory model's input shape without the batch, e.g. 3,224,224"),
]
InputDtypeOpt = Annotated[
    InputDtype | None,
    typer.Option(help="a factory model's input dtype (int64: token ids 0; default float32)"),
]
ExampleOpt = Annotated[
    str | None,
    typer.Option(
        help="a factory model's example input: package.module:function returning a batch-1 "
        "tensor (instead of --input-shape)"
    ),
]


@dataclass(frozen=True)
class ModelFlags:
    """How the model ``--model`` names is built, beyond its name and ``--input-size``:
    declared once, taken by a command as one parameter ``model_flags: ModelFlags`` under
    :func:`model_flag_options` (and by the planning commands within :class:`ProblemFlags`)."""

    model_option: ModelOptionOpt = None
    input_shape: InputShapeOpt = None
    input_dtype: InputDtypeOpt = None
    example: ExampleOpt = None

    def source_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~service.tasks.live.model_source` (``options``,
        ``input_shape``, ``input_dtype``, ``example``); ``-M`` and ``--input-shape`` parsed,
        their errors naming the flag and the text."""
        return {
            "options": parse_model_options(self.model_option or [], "-M"),
            "input_shape": None if self.input_shape is None else parse_shape(self.input_shape),
            "input_dtype": None if self.input_dtype is None else self.input_dtype.value,
            "example": self.example,
        }

    def fields(self) -> dict[str, Any]:
        """The model fields of a request (:class:`~service.tasks.requests.ModelFields`)."""
        kwargs = self.source_kwargs()
        shape = kwargs["input_shape"]
        return {
            "model_options": kwargs["options"],
            "input_shape": None if shape is None else list(shape),
            "input_dtype": kwargs["input_dtype"],
            "example": kwargs["example"],
        }


NO_MODEL_FLAGS = ModelFlags()
"""The default of a command's ``model_flags`` parameter (the decorator replaces it)."""


# --- the problem ------------------------------------------------------------------------------

ClusterOpt = Annotated[str, typer.Option("--cluster", help="cluster.yaml or a preset name")]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help=f"the model, profiled analytically: {MODEL_FORMS}")
]
ProfileOpt = Annotated[Path | None, typer.Option("--profile", help="profile.json")]
InputSizeOpt = Annotated[
    int | None, typer.Option(help="input height/width (or tokens) for --model")
]
ObjectiveOpt = Annotated[
    Objective, typer.Option(help="time: fastest batch; cost: cheapest $/sample at a target")
]
MinThroughputOpt = Annotated[
    float | None,
    typer.Option(help="samples/s the cost objective must reach (required with cost)"),
]
BatchOpt = Annotated[int, typer.Option(help="global batch (samples per training step)")]
ScheduleOpt = Annotated[Schedule, typer.Option(help="pipeline schedule")]
MicrobatchesOpt = Annotated[
    int | None, typer.Option(help="fix the number of microbatches (default: planner chooses)")
]
SeedOpt = Annotated[int, typer.Option(help="planner seed")]
BudgetOpt = Annotated[
    int | None, typer.Option(help=f"most plan evaluations (default {Budget().evaluations})")
]
SecondsOpt = Annotated[
    float | None, typer.Option(help=f"most search seconds (default {Budget().seconds:g})")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]


@dataclass(frozen=True)
class ProblemFlags:
    """The options a planning command describes its problem with, declared once: each
    field's annotation is its typer option and its default the option's. A command takes
    them as one parameter ``problem: ProblemFlags`` under :func:`problem_options`."""

    cluster: ClusterOpt
    model: ModelOpt = None
    profile: ProfileOpt = None
    input_size: InputSizeOpt = None
    objective: ObjectiveOpt = Objective.TIME
    min_throughput: MinThroughputOpt = None
    batch: BatchOpt = 64
    schedule: ScheduleOpt = Schedule.GPIPE
    microbatches: MicrobatchesOpt = None
    seed: SeedOpt = 0
    budget: BudgetOpt = None
    seconds: SecondsOpt = None
    model_option: ModelOptionOpt = None
    input_shape: InputShapeOpt = None
    input_dtype: InputDtypeOpt = None
    example: ExampleOpt = None

    def model_flags(self) -> ModelFlags:
        """How ``model`` is built (:class:`ModelFlags`)."""
        return ModelFlags(self.model_option, self.input_shape, self.input_dtype, self.example)

    def fields(self) -> dict[str, Any]:
        """The problem's fields of a request."""
        return {
            **self.model_flags().fields(),
            "cluster": cluster_ref(self.cluster),
            "model": self.model,
            "profile": document(self.profile),
            "input_size": self.input_size,
            "objective": self.objective,
            "min_throughput": self.min_throughput,
            "batch": self.batch,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "seed": self.seed,
            "budget": {"evaluations": self.budget, "seconds": self.seconds},
        }


def problem_options(
    *,
    declare: Mapping[str, tuple[Any, Any]] | None = None,
    fixed: Mapping[str, Any] | None = None,
) -> Callable[[F], F]:
    """A command that takes ``problem: ProblemFlags`` gets :class:`ProblemFlags`' options in
    its signature, where ``problem`` is (typer reads the signature), and is called with them
    as one ``ProblemFlags``.

    ``declare``: field -> ``(annotation, default)`` for an option a command declares its own
    way (``submit``'s optional ``--cluster``, ``provision``'s ``--objective`` that defaults
    to cost; :data:`REQUIRED` for no default); ``fixed``: field -> the value of an option the
    command does not have."""
    return _flag_options(ProblemFlags, "problem", declare, fixed)


def model_flag_options() -> Callable[[F], F]:
    """A command that takes ``model_flags: ModelFlags`` gets :class:`ModelFlags`' options in
    its signature, where ``model_flags`` is, and is called with them as one ``ModelFlags``."""
    return _flag_options(ModelFlags, "model_flags")


def _flag_options(
    flags: type[Any],
    param: str,
    declare: Mapping[str, tuple[Any, Any]] | None = None,
    fixed: Mapping[str, Any] | None = None,
) -> Callable[[F], F]:
    """The options of the dataclass ``flags`` in place of a command's parameter ``param``."""
    declared, given = dict(declare or {}), dict(fixed or {})
    hints = get_type_hints(flags, include_extras=True)
    options = []
    for f in dataclass_fields(flags):
        if f.name in given:
            continue
        own = (hints[f.name], REQUIRED if f.default is MISSING else f.default)
        annotation, default = declared.get(f.name, own)
        kind = inspect.Parameter.KEYWORD_ONLY
        options.append(inspect.Parameter(f.name, kind, annotation=annotation, default=default))

    def decorate(command: F) -> F:
        signature = inspect.signature(command)
        command_hints = get_type_hints(command, include_extras=True)
        params: list[inspect.Parameter] = []
        for p in signature.parameters.values():
            if p.name == param:
                params += options
            else:
                kind = inspect.Parameter.KEYWORD_ONLY
                params.append(p.replace(kind=kind, annotation=command_hints[p.name]))

        @wraps(command)
        def with_flags(**kwargs: Any) -> Any:
            values = {
                o.name: kwargs.pop(o.name) if o.name in kwargs or o.default is REQUIRED
                else o.default
                for o in options
            }  # fmt: skip
            return command(**{param: flags(**values, **given)}, **kwargs)

        with_flags.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        with_flags.__annotations__ = {p.name: p.annotation for p in params}
        return with_flags  # type: ignore[return-value]

    return decorate


# --- a search ---------------------------------------------------------------------------------

OptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--option", "-O", help="planner option KEY=VALUE (repeatable), e.g. -O unequal=false"
    ),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        help="ppo: RLlib env runners; any other planner: cost its plans on this many Ray "
        "workers (reward parallel)"
    ),
]
IterationsOpt = Annotated[int | None, typer.Option(help="tapp/ppo: training iterations")]
PolicyOpt = Annotated[
    Path | None,
    typer.Option(
        "--policy",
        help="tapp: start from this saved policy (a TAPP policy file, e.g. the policy.pt a "
        "checkpointed search writes); the planner option pretrained",
    ),
]
RewardOpt = Annotated[
    Reward,
    typer.Option(
        help="rewards from the cost model (parallel: on --workers Ray workers), or, for tapp "
        "and ppo, from real runs on the cluster (small default budget: each evaluation is a run)"
    ),
]
RepeatsOpt = Annotated[
    int, typer.Option(help="--reward measured: timed steps per plan (after 1 warm-up)")
]
PlannersOpt = Annotated[
    str | None,
    typer.Option(help="comma-separated planner names (default: every classical baseline)"),
]

# planner-specific spellings of the generic --workers / --iterations flags (--workers for
# any other planner asks for a parallel reward: reward_for_workers)
WORKERS_OPTION = {"ppo": "num_env_runners"}
ITERATIONS_OPTION = {"tapp": "iterations", "ppo": "iterations"}
POLICY_OPTION = {"tapp": "pretrained"}


def parse_options(
    planner: str,
    pairs: Sequence[str],
    workers: int | None,
    iterations: int | None,
    policy: Path | None = None,
) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (values read as JSON when they parse, else as strings) plus the
    RL flags mapped to the planner's own option names (``--policy``: an absolute path, for
    a planner that starts from a policy)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--option: expected KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    path = None if policy is None else str(policy.expanduser().absolute())
    for flag, value, table in (
        ("--workers", workers if planner in WORKERS_OPTION else None, WORKERS_OPTION),
        ("--iterations", iterations, ITERATIONS_OPTION),
        ("--policy", path, POLICY_OPTION),
    ):
        if value is None:
            continue
        if planner not in table:
            raise CliError(f"{flag}: only applies to {' and '.join(table)}, not {planner!r}")
        options[table[planner]] = value
    return options


def check_policy(planner: str, policy: Path) -> None:
    """``--policy`` names a policy file ``planner`` can start from: it exists and holds a
    saved policy (the planner's own check, which loads it); :class:`CliError` naming the
    flag otherwise."""
    if planner not in POLICY_OPTION:
        raise CliError(f"--policy: only applies to {' and '.join(POLICY_OPTION)}, not {planner!r}")
    if not policy.is_file():
        raise CliError(f"--policy: no policy file at {str(policy)!r}")
    options: dict[str, Any] = {POLICY_OPTION[planner]: str(policy.absolute())}
    try:
        planner_class(planner)(**options)
    except ProblemError as e:
        raise CliError(f"--policy: {e}") from None


def reward_for_workers(planner: str, reward: Reward, workers: int | None) -> Reward:
    """``--workers N`` with a planner other than ppo: its plans are costed on N Ray workers."""
    if workers is None or planner in WORKERS_OPTION:
        return reward
    if reward is Reward.MEASURED:
        raise CliError("--workers: not with --reward measured (plans run one at a time)")
    return Reward.PARALLEL


# --- profile and run --------------------------------------------------------------------------

EmulatedClusterOpt = Annotated[
    str | None,
    typer.Option(
        help="measure here and derive timings for every device type of this EMULATED "
        "cluster by its slowdown (fastest flops / type flops)"
    ),
]
MeasureOpt = Annotated[
    bool,
    typer.Option(
        "--measure",
        help="with --cluster: start that cluster and time every layer on each of its "
        "device types through actors pinned to them (emulated types include the slowdown)",
    ),
]
RunProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        help="profile.json of a zoo model (its name and input size pick the model); "
        "default: measure one on the cluster first",
    ),
]
DataOpt = Annotated[
    DataKind, typer.Option(help="synthetic tensors, or scikit-learn's digits (images)")
]


# --- training ---------------------------------------------------------------------------------

TrainPlanOpt = Annotated[Path | None, typer.Option("--plan", help="plan.json to train on")]
TrainPlannerOpt = Annotated[
    str | None, typer.Option("--planner", help="plan first with this planner (cost model)")
]
StepsOpt = Annotated[
    int | None,
    typer.Option(help="steps to have trained in all, a resumed run's too (default 10)"),
]
EpochsOpt = Annotated[
    int | None, typer.Option(help="passes over --data instead of --steps (a sized source)")
]
LossOpt = Annotated[
    str, typer.Option(help="cross-entropy (next token for LMs) or package.module:callable")
]
OptimizerOpt = Annotated[str, typer.Option(help="sgd, adam or adamw")]
LrOpt = Annotated[float, typer.Option(help="learning rate")]
MomentumOpt = Annotated[float, typer.Option(help="SGD momentum")]
WeightDecayOpt = Annotated[float, typer.Option(help="weight decay")]
CheckpointEveryOpt = Annotated[
    int, typer.Option(help="a checkpoint every N steps (0: after the last step only)")
]
TimeoutOpt = Annotated[float, typer.Option(help="longest wait for one step, seconds")]
EngineOpt = Annotated[EngineKind, typer.Option(help="who runs the stages")]
EmulateOpt = Annotated[bool, typer.Option(help="emulate slower device types (sleeps)")]
DeterministicOpt = Annotated[bool, typer.Option(help="disable dropout")]
ElasticOpt = Annotated[
    bool, typer.Option(help="re-plan and resume after a lost node; use nodes that join")
]
ReplanThresholdOpt = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=1.0,
        help="switch to a plan on joined nodes when its predicted gain, less the switch "
        "cost's share of what is left, is above this",
    ),
]


@dataclass(frozen=True)
class TrainFlags:
    """How to train, as ``train`` and ``submit train`` take it (declared once; each command
    declares its own ``--data`` and ``--checkpoint-dir``, whose paths differ in where they
    live): a command takes them as one parameter ``training: TrainFlags`` under
    :func:`train_flag_options`."""

    plan: TrainPlanOpt = None
    planner: TrainPlannerOpt = None
    option: OptionOpt = None
    steps: StepsOpt = None
    epochs: EpochsOpt = None
    loss: LossOpt = "cross-entropy"
    optimizer: OptimizerOpt = "sgd"
    lr: LrOpt = 0.05
    momentum: MomentumOpt = 0.0
    weight_decay: WeightDecayOpt = 0.0
    checkpoint_every: CheckpointEveryOpt = 0
    timeout: TimeoutOpt = 300.0
    engine: EngineOpt = EngineKind.PIPEPLAN
    emulate: EmulateOpt = True
    deterministic: DeterministicOpt = False
    elastic: ElasticOpt = True
    replan_threshold: ReplanThresholdOpt = 0.10

    def fields(self) -> dict[str, Any]:
        """The training fields of a ``TrainRequest`` (the plan document read)."""
        return {
            "plan": read_document(self.plan) if self.plan is not None else None,
            "planner": self.planner,
            "options": (
                parse_options(self.planner, self.option or [], None, None) if self.planner else {}
            ),
            "steps": self.steps,
            "epochs": self.epochs,
            "loss": self.loss,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "checkpoint_every": self.checkpoint_every,
            "timeout_s": self.timeout,
            "engine": self.engine,
            "emulate": self.emulate,
            "deterministic": self.deterministic,
            "elastic": self.elastic,
            "replan_threshold": self.replan_threshold,
        }


NO_TRAIN_FLAGS = TrainFlags()
"""The default of a command's ``training`` parameter (the decorator replaces it)."""


def train_flag_options() -> Callable[[F], F]:
    """A command that takes ``training: TrainFlags`` gets :class:`TrainFlags`' options in its
    signature, where ``training`` is, and is called with them as one ``TrainFlags``."""
    return _flag_options(TrainFlags, "training")
