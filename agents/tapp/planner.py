"""``tapp``: TAPP's partition + attention allocation networks trained jointly by REINFORCE.

Seeded (network initialisation under ``torch.manual_seed``, sampling from a seeded
``torch.Generator``, task choice from a seeded numpy generator), deterministic for a seed on
CPU. Every plan is valued through the :class:`~agents.search.Search`, so by the planner's
reward source (:mod:`agents.rewards`: the cost model by default; ``ParallelReward`` for the
cost model on Ray workers, ``MeasuredReward`` for runs on the executor), and evaluations,
history and the best plan are counted there.

Generalisation: ``TAPPPlanner(policy=train_policy(profiles, cluster))`` starts from a policy
trained on other models (few updates), with ``frozen=True`` it only samples it (zero
updates); ``pretrained=PATH`` loads one saved by ``TAPPPolicy.save``. A trained policy is
nearly deterministic: sample it at ``temperature=4`` or so to spend the budget on distinct
plans. With few updates, sample small batches (``batch_size=16``: about 12 updates within
200 evaluations, against 3 at the default 64). How close that gets on unseen models is
measured by ``bench/rl_quality.py`` (generalisation section of
``bench/results/rl_quality/``).
"""

from __future__ import annotations

import copy
from typing import Any

from pipeplan.agents.problem import Problem
from pipeplan.agents.registry import Planner
from pipeplan.agents.rewards import RewardSource
from pipeplan.agents.search import Search
from pipeplan.agents.tapp.nets import TAPPPolicy
from pipeplan.agents.tapp.trainer import (
    OnIteration,
    TAPPConfig,
    Task,
    new_policy,
    problem_context,
    train,
)


class TAPPPlanner(Planner):
    """TAPP (Mao et al. 2021); options are :class:`TAPPConfig`'s fields."""

    name = "tapp"
    Config = TAPPConfig

    def __init__(
        self,
        policy: TAPPPolicy | None = None,
        on_iteration: OnIteration | None = None,
        reward: RewardSource | None = None,
        **options: Any,
    ) -> None:
        super().__init__(reward, **options)
        self.policy, self.on_iteration = policy, on_iteration

    def search(self, problem: Problem, search: Search) -> None:
        config: TAPPConfig = self.config
        if self.policy is not None:
            policy = copy.deepcopy(self.policy)  # fine-tuning leaves the caller's intact
        else:
            policy = new_policy(config, problem.seed)
        train(
            policy,
            [Task(problem_context(problem, config), search)],
            config,
            seed=problem.seed,
            should_stop=search.exhausted,
            remaining=lambda: search.remaining_evaluations,
            on_iteration=self.on_iteration,
        )
