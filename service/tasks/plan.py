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
from enum import StrEnum
from typing import Any

from pipeplan.agents.problem import Objective, PlanResult, Problem
from pipeplan.agents.provision.rental import Rental, rental
from pipeplan.agents.registry import PLANNERS, make_planner, planner_class
from pipeplan.executor.parallel_reward import ParallelReward
from pipeplan.service.tasks.common import ProblemRequest, RequestError, build_problem
from pipeplan.service.tasks.live import ray_for_search
from pipeplan.service.tasks.progress import QUIET, Reporter
from pipeplan.service.tasks.search import (
    MEASURED_PLANNERS,
    MeasuredSearch,
    SearchSettings,
    measured_budget,
    search,
)


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
        hired = self.rental
        if hired is not None:
            doc["rental"] = hired.to_dict()
        if self.measured is not None:
            doc["reward"] = Reward.MEASURED.value
            doc["measured"] = self.measured.to_dict()
        return doc


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
