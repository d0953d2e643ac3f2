"""Planners: one interface (``make_planner(name, reward=None, **options).plan(problem)``),
many searchers, and the reward sources that value their plans (:mod:`agents.rewards`)."""

from pipeplan.agents.problem import (
    Budget,
    InfeasibleError,
    Objective,
    PlanResult,
    Problem,
    ProblemError,
)
from pipeplan.agents.registry import PLANNERS, Planner, make_planner
from pipeplan.agents.rewards import Rewards, RewardSource, SimulatedReward

__all__ = [
    "PLANNERS",
    "Budget",
    "InfeasibleError",
    "Objective",
    "PlanResult",
    "Planner",
    "Problem",
    "ProblemError",
    "RewardSource",
    "Rewards",
    "SimulatedReward",
    "make_planner",
]
