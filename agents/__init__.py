"""Planners: one interface (``make_planner(name).plan(problem)``), many searchers."""

from agents.problem import Budget, InfeasibleError, Objective, PlanResult, Problem, ProblemError
from agents.registry import PLANNERS, Planner, make_planner

__all__ = [
    "PLANNERS",
    "Budget",
    "InfeasibleError",
    "Objective",
    "PlanResult",
    "Planner",
    "Problem",
    "ProblemError",
    "make_planner",
]
