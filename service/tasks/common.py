"""What every use-case shares: the request base, clusters by document or preset name, and
the planning problem a request describes, its zoo model profiled.

The requests and their checks live in :mod:`service.tasks.requests` (neither torch nor Ray:
the CLI's client commands and the API import that module); this one adds what builds a
problem, which profiles a zoo model with torch, and names the rest as it always did.
"""

from __future__ import annotations

from pipeplan.agents.problem import Budget, Problem
from pipeplan.core.profile import ModelProfile
from pipeplan.models import profiler
from pipeplan.models.spec import build_model
from pipeplan.service.tasks.progress import Reporter
from pipeplan.service.tasks.requests import (
    PRESETS_DIR,
    BudgetRequest,
    ClusterRef,
    Document,
    ModelFields,
    ProblemRequest,
    Request,
    RequestError,
    check_problem_fields,
    cluster_spec,
    presets,
    problem_of,
)

__all__ = [
    "PRESETS_DIR",
    "BudgetRequest",
    "ClusterRef",
    "Document",
    "ProblemRequest",
    "Request",
    "RequestError",
    "build_problem",
    "check_problem_fields",
    "cluster_spec",
    "presets",
    "problem_of",
    "zoo_profile",
]


def zoo_profile(
    model: str, input_size: int | None, reporter: Reporter, fields: ModelFields | None = None
) -> ModelProfile:
    """A model profiled analytically (FLOPs and sizes; layer times from device FLOP/s): a
    zoo name, or any reference (:mod:`models.spec`) built with the request's ``fields``."""
    with reporter.step(f"profiling {model} (analytic)"):
        module, example = build_model(
            model,
            input_size,
            options=fields.model_options if fields else None,
            input_shape=fields.input_shape if fields else None,
            input_dtype=fields.input_dtype if fields else None,
            example=fields.example if fields else None,
        )
        return profiler.profile_model(module, example, name=model, device_type=None)


def build_problem(
    request: ProblemRequest, reporter: Reporter, default_budget: Budget | None = None
) -> Problem:
    """The problem the request describes. Its own checks and the cluster come before
    profiling (a zoo model takes seconds); :class:`Problem` checks the rest."""
    check_problem_fields(request)
    spec = cluster_spec(request.cluster)
    budget = request.budget.resolve(default_budget or Budget())
    if request.model is not None:
        prof = zoo_profile(request.model, request.input_size, reporter, request)
    else:
        prof = ModelProfile.from_dict(request.profile)
    return problem_of(request, prof, spec, budget)
