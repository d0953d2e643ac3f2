"""TAPP: partition network + attention allocation network, trained jointly by REINFORCE.

Torch is imported with this package. Plans are valued by the planner's reward source
(:mod:`agents.rewards`), handed to it by whoever builds the planner.
"""

from agents.tapp.features import PlanContext, make_context
from agents.tapp.nets import TAPPPolicy
from agents.tapp.planner import TAPPPlanner
from agents.tapp.sampling import Sample, sample_plans
from agents.tapp.trainer import IterationLog, TAPPConfig, train, train_policy

__all__ = [
    "IterationLog",
    "PlanContext",
    "Sample",
    "TAPPConfig",
    "TAPPPlanner",
    "TAPPPolicy",
    "make_context",
    "sample_plans",
    "train",
    "train_policy",
]
