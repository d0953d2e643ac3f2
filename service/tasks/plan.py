"""The ``plan`` use-case: one planner on one problem.

With ``reward: simulated`` (the default) the planner scores plans with the cost model; with
``reward: measured`` every plan it samples runs on a cluster (:mod:`service.tasks.search`).
``objective: cost`` needs ``min_throughput``: without a target the cheapest plan per sample
is usually one cheap device, seldom what anyone means to rent; 0 asks for exactly that. Its
answer carries the rental: ``{node kind: count}`` of the nodes the plan uses (a catalogue's
``count: N`` entries are kinds), $/hour, $/sample and the throughput.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from pipeplan.agents.problem import Objective, PlanResult, Problem
from pipeplan.agents.provision.rental import Rental, rental
from pipeplan.agents.registry import make_planner
from pipeplan.core.bounds import lower_bound
from pipeplan.executor.parallel_reward import ParallelReward
from pipeplan.service.tasks.common import build_problem
from pipeplan.service.tasks.live import ray_for_search
from pipeplan.service.tasks.progress import QUIET, Reporter
from pipeplan.service.tasks.requests import (
    PlanRequest,
    Reward,
    check_plan_fields,
    measured_budget,
    planner_options,
    uses_ray,
)
from pipeplan.service.tasks.search import MeasuredSearch, SearchSettings, search

__all__ = [
    "PlanRequest",
    "Planned",
    "Reward",
    "check_plan_fields",
    "plan",
    "planner_options",
    "uses_ray",
]


@dataclass(frozen=True)
class Planned:
    """A planner's answer to a problem; with a measured reward, every run it made."""

    problem: Problem
    result: PlanResult
    measured: MeasuredSearch | None = None

    @property
    def rental(self) -> Rental | None:
        """With the cost objective, what the plan rents (``{node kind: count}``, prices)."""
        if self.problem.objective is not Objective.COST:
            return None
        return rental(self.result.plan, self.problem.cluster, self.result.estimate)

    def to_dict(self) -> dict[str, Any]:
        """What ``pipeplan plan --json`` prints."""
        r = self.result
        doc: dict[str, Any] = {
            "plan": r.plan.to_dict(),
            "estimate": r.estimate.to_dict(),
            "planner": r.planner,
            "evaluations": r.evaluations,
            "wall_time_s": r.wall_time_s,
        }
        p = self.problem
        bound = lower_bound(p.profile, p.cluster, p.global_batch, p.schedule)
        doc["lower_bound_s"] = bound.batch_time_s
        doc["ratio_to_bound"] = bound.ratio(r.estimate.batch_time_s)
        doc["bound"] = bound.to_dict()
        hired = self.rental
        if hired is not None:
            doc["rental"] = hired.to_dict()
        if self.measured is not None:
            doc["reward"] = Reward.MEASURED.value
            doc["measured"] = self.measured.to_dict()
        return doc


def plan(request: PlanRequest, reporter: Reporter = QUIET) -> Planned:
    """Search a plan for the request's problem with its planner."""
    check_plan_fields(request)
    options = planner_options(request.options)
    if request.reward is Reward.MEASURED:
        problem = build_problem(request, reporter, measured_budget())
        settings = SearchSettings(
            model=request.model,
            input_size=request.input_size,
            repeats=request.repeats,
            warmup=request.warmup,
            address=request.address,
            concurrent=request.concurrent,
            model_fields={
                "options": request.model_options,
                "input_shape": request.input_shape,
                "input_dtype": request.input_dtype,
                "example": request.example,
            },
        )
        found = search(problem, request.planner, options, settings, reporter)
        return Planned(problem, found.result, found)
    problem = build_problem(request, reporter)
    planner = make_planner(request.planner, **options)  # bad options fail before Ray starts
    with ExitStack() as stack:
        if uses_ray(request):
            stack.enter_context(ray_for_search(request.address, reporter))
        if request.workers is not None:
            planner = make_planner(
                request.planner, reward=ParallelReward(request.workers), **options
            )
        with reporter.search(request.planner, problem.budget.evaluations) as progress:
            result = planner.plan(problem, progress=progress, on_record=reporter.evaluated)
    return Planned(problem, result)
