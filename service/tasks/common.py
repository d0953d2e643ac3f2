"""What every use-case shares: the request base, clusters by document or preset name, and
the planning problem a request describes.

Requests are pydantic models (the REST API takes them as they are): unknown fields are
refused, types are checked by pydantic, and the values by the core, whose errors name the
field and the value (:class:`~core.errors.PipeplanError`), so the CLI and the API give the
same one-line messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeplan.agents.problem import Budget, Objective, Problem
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.models import profiler, zoo
from pipeplan.service.tasks.progress import Reporter

Document = dict[str, Any]
"""A profile, cluster or plan document (DESIGN.md, "Data formats")."""
ClusterRef = str | Document
"""A cluster document, or the name of a preset in examples/clusters."""

PRESETS_DIR = Path(__file__).resolve().parents[2] / "examples" / "clusters"


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


def zoo_profile(model: str, input_size: int | None, reporter: Reporter) -> ModelProfile:
    """A zoo model profiled analytically (FLOPs and sizes; layer times from device FLOP/s)."""
    with reporter.step(f"profiling {model} (analytic)"):
        module, example = zoo.build(model, input_size)
        return profiler.profile_model(module, example, name=model, device_type=None)


class ProblemRequest(Request):
    """A planning problem: a model (zoo ``model`` or a ``profile`` document), a cluster,
    an objective and the batch to plan for."""

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


def check_problem_fields(request: ProblemRequest) -> None:
    """The request's own checks, before the cluster is read or a model profiled."""
    if (request.model is None) == (request.profile is None):
        raise RequestError(
            "model, profile: give exactly one of model (a zoo name) or profile (a document)"
        )
    if request.input_size is not None and request.model is None:
        raise RequestError("input_size: only applies with model")
    if request.objective is Objective.COST and request.min_throughput is None:
        raise RequestError(
            "min_throughput: required with objective cost (samples/s to reach; "
            "0 asks for the cheapest plan per sample at any speed)"
        )


def build_problem(
    request: ProblemRequest, reporter: Reporter, default_budget: Budget | None = None
) -> Problem:
    """The problem the request describes. Its own checks and the cluster come before
    profiling (a zoo model takes seconds); :class:`Problem` checks the rest."""
    check_problem_fields(request)
    spec = cluster_spec(request.cluster)
    budget = request.budget.resolve(default_budget or Budget())
    if request.model is not None:
        prof = zoo_profile(request.model, request.input_size, reporter)
    else:
        prof = ModelProfile.from_dict(request.profile)
    return problem_of(request, prof, spec, budget)


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
