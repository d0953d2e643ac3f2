"""TAPP: partition network + attention allocation network, trained jointly by REINFORCE.

Torch is imported with this package; Ray only when ``workers > 1``
(:mod:`agents.tapp.parallel`).
"""

from agents.tapp.features import PlanContext, make_context
from agents.tapp.nets import TAPPPolicy
from agents.tapp.planner import TAPPPlanner
from agents.tapp.rewards import RewardSource, SimulatedReward
from agents.tapp.sampling import Sample, sample_plans
from agents.tapp.trainer import IterationLog, TAPPConfig, train, train_policy

__all__ = [
    "IterationLog",
    "PlanContext",
    "RewardSource",
    "Sample",
    "SimulatedReward",
    "TAPPConfig",
    "TAPPPlanner",
    "TAPPPolicy",
    "make_context",
    "sample_plans",
    "train",
    "train_policy",
]
