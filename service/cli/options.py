"""The options several commands share, declared once: the problem a planning command
describes (``plan``, ``compare``, ``provision`` and ``submit plan|compare``), a search's
options (``plan``, ``submit plan``), and the flags ``submit profile|run`` take from
``profile`` and ``run``.

Neither torch nor Ray: the client commands (``submit ...``) build their requests with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeplan.agents.problem import Budget, Objective
from pipeplan.core.plan import Schedule
from pipeplan.service.cli.console import CliError, cluster_ref, document
from pipeplan.service.tasks.requests import DataKind, Reward

# --- the problem ------------------------------------------------------------------------------

ClusterOpt = Annotated[str, typer.Option("--cluster", help="cluster.yaml or a preset name")]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help="zoo model name, profiled analytically")
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
    """The flags a planning command describes a problem with, as a request's fields."""

    cluster: str
    model: str | None
    profile: Path | None
    input_size: int | None
    objective: Objective
    min_throughput: float | None
    batch: int
    schedule: Schedule
    microbatches: int | None
    seed: int
    budget: int | None
    seconds: float | None

    def fields(self) -> dict[str, Any]:
        return {
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


def parse_options(
    planner: str, pairs: Sequence[str], workers: int | None, iterations: int | None
) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (values read as JSON when they parse, else as strings) plus the
    RL flags mapped to the planner's own option names."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--option: expected KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    for flag, value, table in (
        ("--workers", workers if planner in WORKERS_OPTION else None, WORKERS_OPTION),
        ("--iterations", iterations, ITERATIONS_OPTION),
    ):
        if value is None:
            continue
        if planner not in table:
            raise CliError(f"{flag}: only applies to {' and '.join(table)}, not {planner!r}")
        options[table[planner]] = value
    return options


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
