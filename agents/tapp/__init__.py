"""TAPP: partition network + attention allocation network, trained jointly by REINFORCE.

Torch is imported with this package. Plans are valued by the planner's reward source
(:mod:`agents.rewards`), handed to it by whoever builds the planner.
"""

from pipeplan.agents.tapp.features import PlanContext, make_context
from pipeplan.agents.tapp.nets import TAPPPolicy
from pipeplan.agents.tapp.planner import TAPPPlanner
from pipeplan.agents.tapp.sampling import Sample, sample_plans
from pipeplan.agents.tapp.trainer import IterationLog, TAPPConfig, train, train_policy

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
