"""The ``provision`` use-case: what to rent from a catalogue for a throughput target, and
the Pareto front of $/hour against throughput over a range of targets.

One planner (``provision_dp`` by default) answers the cost objective at the request's target
(the rental) and at each target of the sweep; the front keeps the answers that no other
answer beats on both price and throughput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeplan.agents.problem import InfeasibleError, Objective
from pipeplan.agents.provision.rental import Rental
from pipeplan.agents.registry import make_planner
from pipeplan.service.tasks.common import ProblemRequest, RequestError, build_problem, problem_of
from pipeplan.service.tasks.plan import Planned, planner_options
from pipeplan.service.tasks.progress import QUIET, Reporter

MAX_TARGETS = 64
"""Throughput targets of one sweep."""


class ProvisionRequest(ProblemRequest):
    """A cost problem (``min_throughput`` required) and the sweep: ``targets`` targets from
    ``min_throughput / spread`` to ``min_throughput x spread``, geometrically."""

    objective: Objective = Objective.COST
    planner: str = "provision_dp"
    options: dict[str, Any] = {}
    targets: int = 8
    spread: float = 4.0


@dataclass(frozen=True)
class FrontPoint:
    """The planner's answer at one target (None: no plan reaches it)."""

    target: float
    rental: Rental | None
    on_front: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "rental": None if self.rental is None else self.rental.to_dict(),
            "on_front": self.on_front,
        }


@dataclass(frozen=True)
class Provisioned:
    """The rental at the request's target, its plan, and the sweep."""

    planned: Planned
    front: tuple[FrontPoint, ...]

    def to_dict(self) -> dict[str, Any]:
        return self.planned.to_dict() | {"front": [p.to_dict() for p in self.front]}


def check_provision_fields(request: ProvisionRequest) -> None:
    if request.objective is not Objective.COST:
        raise RequestError(
            f"objective: provision answers the cost objective, not {request.objective.value!r}"
        )
    if request.min_throughput is None or not request.min_throughput > 0:
        raise RequestError(
            "min_throughput: required and > 0 for provision (samples/s), got "
            f"{request.min_throughput!r}"
        )
    if not 1 <= request.targets <= MAX_TARGETS:
        raise RequestError(f"targets: must be 1 to {MAX_TARGETS}, got {request.targets}")
    if not request.spread >= 1:
        raise RequestError(f"spread: must be >= 1, got {request.spread!r}")


def targets(request: ProvisionRequest) -> list[float]:
    """The sweep's targets, the request's own among them."""
    tp, k = float(request.min_throughput or 0), request.targets
    if k == 1:
        return [tp]
    sweep = np.geomspace(tp / request.spread, tp * request.spread, k)
    others = [float(x) for x in sweep if abs(x - tp) > 1e-9 * tp]
    return sorted([*others, tp])


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """Which (price per hour, throughput) points no other point beats on both (lower price,
    higher throughput; ties kept)."""
    return [not any((q[0] <= p[0] and q[1] >= p[1]) and q != p for q in points) for p in points]


def provision(request: ProvisionRequest, reporter: Reporter = QUIET) -> Provisioned:
    """The rental at the target (an infeasible target is an error) and the front over the
    sweep (a target no plan reaches is a point without a rental)."""
    check_provision_fields(request)
    problem = build_problem(request, reporter)
    options = planner_options(request.options)

    def answer(tp: float) -> Planned:
        sub = request.model_copy(update={"min_throughput": tp})
        at = problem_of(sub, problem.profile, problem.cluster, problem.budget)
        with reporter.step(f"{request.planner} at >= {tp:,.1f} samples/s"):
            return Planned(at, make_planner(request.planner, **options).plan(at))

    main = answer(float(problem.min_throughput or 0))
    answers: list[tuple[float, Rental | None]] = []
    for tp in targets(request):
        if tp == problem.min_throughput:
            answers.append((tp, main.rental))
            continue
        try:
            answers.append((tp, answer(tp).rental))
        except InfeasibleError:
            answers.append((tp, None))
    found = [r for _, r in answers if r is not None]
    flags = iter(pareto([(r.price_per_hour, r.throughput) for r in found]))
    front = tuple(FrontPoint(tp, r, r is not None and next(flags)) for tp, r in answers)
    return Provisioned(main, front)
