"""The ``provision`` use-case: what to rent from a catalogue, the Pareto front of $/hour
against throughput, and on request the deployment of the rental.

Two objectives, both answered by one planner (``provision_dp`` by default) asked the cost
objective at throughput targets:

- ``cost``: the cheapest rental per sample at ``min_throughput`` (the rental), and the same
  at each target of a sweep around it (the front);
- ``throughput``: the fastest rental whose nodes cost at most ``max_price_per_hour``. The
  targets double from the cheapest rental's throughput until a rental is over the budget,
  then a bisection narrows the bracket, ``targets`` answers at most; the answer is the
  fastest rental within the budget among those asked for, and the front is every answer.
  It is as good as the cost planner's answers: a target's cheapest rental per sample is
  not always its cheapest per hour, so a faster rental within the budget may exist.

The front keeps the answers that no other answer beats on both price and throughput. With
``apply``, the rental is rendered as a deployment (:mod:`service.tasks.apply`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pipeplan.agents.problem import InfeasibleError, Objective, Problem
from pipeplan.agents.provision.rental import Rental
from pipeplan.agents.registry import make_planner
from pipeplan.service.tasks.apply import RentalRenderRequest, check_options, render_rental
from pipeplan.service.tasks.common import ProblemRequest, RequestError, build_problem, problem_of
from pipeplan.service.tasks.deploy import Rendered
from pipeplan.service.tasks.plan import Planned, planner_options
from pipeplan.service.tasks.progress import QUIET, Reporter

MAX_TARGETS = 64
"""Throughput targets of one sweep."""
BUDGET_RESOLUTION = 0.02
"""The bisection stops when its bracket of targets is this narrow, relative to its low end."""


class ProvisionRequest(ProblemRequest):
    """A rental problem on a catalogue: ``cost`` with ``min_throughput`` and the sweep
    (``targets`` targets from ``min_throughput / spread`` to ``min_throughput x spread``,
    geometrically), or ``throughput`` with ``max_price_per_hour`` (``targets``: the most
    targets its search asks about, the cheapest rental's included). ``apply``: render the
    rental's deployment (its ``spec`` and ``nodes`` are set from this request's cluster and
    the rental)."""

    objective: Objective = Objective.COST
    planner: str = "provision_dp"
    options: dict[str, Any] = {}
    targets: int = 8
    spread: float = 4.0
    max_price_per_hour: float | None = None
    """The throughput objective's budget: $ per hour of the rented nodes in full."""
    apply: RentalRenderRequest | None = None


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
    """The rental (at the request's target, or within its budget), its plan, the front, and
    the rental's deployment when one was asked for."""

    planned: Planned
    front: tuple[FrontPoint, ...]
    rendered: Rendered | None = None

    def to_dict(self) -> dict[str, Any]:
        doc = self.planned.to_dict() | {"front": [p.to_dict() for p in self.front]}
        if self.rendered is not None:
            doc["applied"] = self.rendered.to_dict()
        return doc


def check_provision_fields(request: ProvisionRequest) -> None:
    objective = request.objective
    if objective is Objective.COST:
        if request.min_throughput is None or not request.min_throughput > 0:
            raise RequestError(
                "min_throughput: required and > 0 for provision (samples/s), got "
                f"{request.min_throughput!r}"
            )
        if request.max_price_per_hour is not None:
            raise RequestError(
                "max_price_per_hour: only applies to the throughput objective, not 'cost' "
                "(whose target is min_throughput)"
            )
    elif objective is Objective.THROUGHPUT:
        budget = request.max_price_per_hour
        if budget is None or not budget > 0:
            raise RequestError(
                "max_price_per_hour: required and > 0 for provision with objective "
                f"throughput ($/hour of the rented nodes), got {budget!r}"
            )
        if request.min_throughput is not None:
            raise RequestError(
                "min_throughput: only applies to the cost objective, not 'throughput' (whose "
                "limit is max_price_per_hour)"
            )
    else:
        raise RequestError(
            "objective: provision answers 'cost' (with min_throughput) or 'throughput' (with "
            f"max_price_per_hour), not {objective.value!r}"
        )
    if not 1 <= request.targets <= MAX_TARGETS:
        raise RequestError(f"targets: must be 1 to {MAX_TARGETS}, got {request.targets}")
    if not request.spread >= 1:
        raise RequestError(f"spread: must be >= 1, got {request.spread!r}")
    if request.apply is not None:
        check_options(request.apply)


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


Answer = Callable[[float], Planned]
"""The planner's answer at a throughput target (cost objective; raises InfeasibleError)."""


def sweep(request: ProvisionRequest, problem: Problem, answer: Answer) -> Provisioned:
    """The cost objective: the rental at the target (an infeasible target is an error) and
    the front over the sweep (a target no plan reaches is a point without a rental)."""
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
    return Provisioned(main, front_of(answers))


def within_budget(request: ProvisionRequest, answer: Answer) -> Provisioned:
    """The throughput objective (module docstring): the fastest rental the planner gives
    whose nodes cost at most the budget; the front is every target asked about. A budget
    below the cheapest rental per sample is an error naming both."""
    budget = float(request.max_price_per_hour or 0)

    def within(r: Rental | None) -> Rental | None:
        return r if r is not None and r.node_price_per_hour <= budget * (1 + 1e-12) else None

    best = answer(0.0)  # the cheapest rental per sample, at any speed
    asked: list[tuple[float, Rental | None]] = [(0.0, best.rental)]
    top = within(best.rental)
    if top is None:
        price = best.rental.node_price_per_hour if best.rental else float("nan")
        raise InfeasibleError(
            f"max_price_per_hour: {budget:g} is below the cheapest rental "
            f"{request.planner} found, ${price:.4f}/h for its nodes in full"
        )
    lo, hi = top.throughput, None
    while len(asked) < request.targets:
        if hi is not None and hi <= lo * (1 + BUDGET_RESOLUTION):
            break
        target = 2 * lo if hi is None else (lo + hi) / 2
        try:
            got = answer(target)
        except InfeasibleError:
            asked.append((target, None))
            hi = target
            continue
        asked.append((target, got.rental))
        r = within(got.rental)
        if r is None:
            hi = target
            continue
        if r.throughput > top.throughput:
            best, top = got, r
        lo = max(lo, r.throughput)
        if hi is not None and lo >= hi:
            hi = None  # a faster rental within the budget than the bracket said: go on up
    return Provisioned(best, front_of(sorted(asked, key=lambda a: a[0])))


def front_of(answers: list[tuple[float, Rental | None]]) -> tuple[FrontPoint, ...]:
    """Each target's answer, flagged when it is on the front."""
    found = [r for _, r in answers if r is not None]
    flags = iter(pareto([(r.price_per_hour, r.throughput) for r in found]))
    return tuple(FrontPoint(tp, r, r is not None and next(flags)) for tp, r in answers)


def provision(request: ProvisionRequest, reporter: Reporter = QUIET) -> Provisioned:
    """The rental for the request's objective and its front; its deployment with ``apply``
    (checked before any search)."""
    check_provision_fields(request)
    problem = build_problem(request, reporter)
    options = planner_options(request.options)

    def answer(tp: float) -> Planned:
        sub = request.model_copy(update={"objective": Objective.COST, "min_throughput": tp})
        at = problem_of(sub, problem.profile, problem.cluster, problem.budget)
        with reporter.step(f"{request.planner} at >= {tp:,.1f} samples/s"):
            return Planned(at, make_planner(request.planner, **options).plan(at))

    if request.objective is Objective.THROUGHPUT:
        done = within_budget(request, answer)
    else:
        done = sweep(request, problem, answer)
    if request.apply is None or done.planned.rental is None:
        return done
    deploy = request.apply.model_copy(
        update={"spec": request.cluster, "nodes": dict(done.planned.rental.nodes)}
    )
    with reporter.step(f"rendering the rental for {deploy.target.value}"):
        return replace(done, rendered=render_rental(deploy))
