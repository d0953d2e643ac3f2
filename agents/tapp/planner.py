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

Checkpoints: with ``checkpoint_dir=DIR`` the search writes its whole state there every
``checkpoint_every`` iterations (and when it ends), with the trained policy beside it as
``policy.pt`` (:mod:`agents.tapp.checkpoint`); started again on the same folder, or with
``resume=DIR``, it continues where the checkpoint stopped instead of starting over.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pipeplan.agents.problem import Problem
from pipeplan.agents.registry import Planner
from pipeplan.agents.resume import every, fingerprint, resume_folder
from pipeplan.agents.rewards import RewardSource
from pipeplan.agents.search import Search
from pipeplan.agents.tapp import checkpoint
from pipeplan.agents.tapp.checkpoint import Checkpointer
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
        checkpointer, resumed = self.checkpointing(problem)
        if resumed is not None:
            saved = resumed["policy"]
            policy = TAPPPolicy(int(saved["hidden"]), int(saved["attention_dim"]))
            search.options["resumed_from"] = config.resume or config.checkpoint_dir
        elif self.policy is not None:
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
            checkpointer=checkpointer,
            resume=resumed,
        )

    def checkpointing(self, problem: Problem) -> tuple[Checkpointer | None, dict[str, Any] | None]:
        """Where this search checkpoints (None: it does not), and the checkpoint it goes on
        from (``resume``, else one in ``checkpoint_dir``; None: a fresh start)."""
        c: TAPPConfig = self.config
        fp = fingerprint(problem, self.name, self.options)
        interval = every(c.checkpoint_dir, c.checkpoint_every)
        writer = None
        if c.checkpoint_dir is not None and interval is not None:
            writer = Checkpointer(Path(c.checkpoint_dir), interval, fp)
        folder = resume_folder(self.name, c.checkpoint_dir, c.resume, checkpoint.CHECKPOINT)
        return writer, None if folder is None else checkpoint.load(folder, fp)
