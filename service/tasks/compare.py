"""The ``compare`` use-case: several planners on one problem, against the exact answer
(:mod:`agents.compare`)."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from pipeplan.agents.compare import Entry, Row, comparison_doc, run_comparison
from pipeplan.agents.problem import PlanResult, Problem, ProblemError
from pipeplan.agents.registry import make_planner, planner_class
from pipeplan.service.tasks.common import build_problem
from pipeplan.service.tasks.live import ray_for_search
from pipeplan.service.tasks.progress import QUIET, Reporter
from pipeplan.service.tasks.requests import CompareRequest, planner_names

__all__ = ["CompareRequest", "Compared", "compare", "planner_names"]


@dataclass(frozen=True)
class Compared:
    """Each planner's row on the problem."""

    problem: Problem
    rows: list[Row]

    def to_dict(self) -> dict[str, Any]:
        """What ``pipeplan compare --json`` prints."""
        return comparison_doc(self.problem, self.rows)


def compare(
    request: CompareRequest, reporter: Reporter = QUIET, *, catch_bugs: bool = True
) -> Compared:
    """Run each planner on the request's problem; a planner that fails gets a row with its
    reason (with ``catch_bugs``, a planner's bug too, as an internal error)."""
    names = planner_names(request.planners)
    problem = build_problem(request, reporter)

    def run(entry: Entry, p: Problem) -> PlanResult:
        with reporter.search(entry.label, p.budget.evaluations) as progress:
            planner = make_planner(entry.planner, **entry.options)
            return planner.plan(p, progress=progress, on_record=reporter.evaluated)

    entries = [Entry(n, n) for n in names]
    with ExitStack() as stack:
        if any(_needs_ray(n) for n in names):
            stack.enter_context(ray_for_search(None, reporter))
        rows = run_comparison(problem, entries, run, catch_bugs=catch_bugs)
    return Compared(problem, rows)


def _needs_ray(name: str) -> bool:
    """Whether planner ``name`` runs on Ray; one that cannot be loaded gets its reason in
    its row instead."""
    try:
        return planner_class(name).needs_ray
    except ProblemError:
        return False
