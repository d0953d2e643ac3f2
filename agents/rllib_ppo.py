"""``ppo``: PPO from RLlib on :class:`envs.placement.PlacementEnv` (the only RLlib import).

RLlib moves its API between releases; everything version-specific is in this module and was
checked against Ray 2.60 (new API stack): ``PPOConfig().environment/env_runners/training/
rl_module/callbacks/debugging``, ``RLModuleSpec`` with RLlib's own action-masking PPO module
(``ActionMaskingTorchRLModule``, which reads the env's ``{"observations", "action_mask"}``
observation), ``Algorithm.save_to_path`` / ``restore_from_path`` for checkpoints and
``env_runner_group.foreach_env_runner`` to gather the best plan each runner has seen.

Episodes are costed inside the env by the contract cost model (one evaluation each, counted
in the result). The env uses one microbatch count; the best structure found is then tried
with every allowed equal microbatch size through the vectorised cost model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agents.problem import Problem, ProblemError
from agents.registry import Planner
from agents.search import Search
from core.plan import Plan, Stage

ENV_NAME = "pipeplan-placement-v0"


@dataclass(frozen=True)
class PPOOptions:
    """Options of the ``ppo`` planner."""

    iterations: int = 20  # PPO training iterations (each samples train_batch env steps)
    num_env_runners: int = 0  # parallel sampling processes (0: sample in the driver)
    train_batch: int = 1000  # env steps per iteration
    minibatch: int = 250  # SGD minibatch size
    epochs: int = 4  # SGD passes over each batch
    lr: float = 3e-4
    entropy_coeff: float = 0.01
    hidden: tuple[int, ...] = (128, 128)  # policy / value MLP sizes
    microbatches: int | None = None  # microbatch count in the env (None: problem's, or 4)
    checkpoint: str | None = None  # save the trained algorithm here at the end
    restore: str | None = None  # restore an algorithm saved by `checkpoint` before training

    def __post_init__(self) -> None:
        for key in ("iterations", "train_batch", "minibatch", "epochs"):
            if getattr(self, key) < 1:
                raise ProblemError(f"ppo.{key}: must be >= 1, got {getattr(self, key)}")
        if self.num_env_runners < 0:
            raise ProblemError(f"ppo.num_env_runners: must be >= 0, got {self.num_env_runners}")


def env_config(problem: Problem, microbatches: int) -> dict[str, Any]:
    return {
        "profile": problem.profile,
        "cluster": problem.cluster,
        "objective": problem.objective.value,
        "global_batch": problem.global_batch,
        "microbatches": microbatches,
        "schedule": problem.schedule.value,
        "min_throughput": problem.min_throughput,
    }


def _microbatches(problem: Problem, option: int | None) -> int:
    if problem.microbatches is not None:
        return problem.microbatches
    m = option or 4
    if problem.global_batch % m:
        raise ProblemError(
            f"ppo.microbatches: {m} does not divide global_batch {problem.global_batch}"
        )
    return m


def _best_callbacks() -> type:
    from ray.rllib.callbacks.callbacks import RLlibCallback

    class BestPlan(RLlibCallback):  # type: ignore[misc]
        """Keeps, on each env runner, the best plan its episodes produced."""

        def __init__(self) -> None:
            super().__init__()
            self.best: tuple[float, dict[str, Any]] | None = None
            self.episodes = 0

        def on_episode_end(self, *, episode: Any, **kwargs: Any) -> None:
            info = episode.get_infos(-1)
            self.episodes += 1
            value = float(info.get("value", np.inf))
            if np.isfinite(value) and (self.best is None or value < self.best[0]):
                self.best = (value, info["plan"].to_dict())

    return BestPlan


def _gather(algo: Any) -> tuple[int, list[tuple[float, dict[str, Any]]]]:
    """(episodes so far, best plan of every runner) across all env runners."""

    def read(runner: Any) -> tuple[int, Any]:
        cbs = [c for c in runner._callbacks if hasattr(c, "best")]
        return sum(c.episodes for c in cbs), [c.best for c in cbs if c.best is not None]

    results = algo.env_runner_group.foreach_env_runner(read, local_env_runner=True)
    episodes = sum(r[0] for r in results)
    return episodes, [b for r in results for b in r[1]]


class PPOPlanner(Planner):
    name = "ppo"
    Config = PPOOptions
    config: PPOOptions

    def search(self, problem: Problem, search: Search) -> None:
        m = _microbatches(problem, self.config.microbatches)
        started = _ensure_ray()
        try:
            algo = self._build(problem, m)
            try:
                self._train(algo, search)
            finally:
                algo.stop()
        finally:
            if started:
                import ray

                ray.shutdown()

    def _build(self, problem: Problem, microbatches: int) -> Any:
        from ray.rllib.algorithms.ppo import PPOConfig
        from ray.rllib.core.rl_module.rl_module import RLModuleSpec
        from ray.rllib.examples.rl_modules.classes.action_masking_rlm import (
            ActionMaskingTorchRLModule,
        )
        from ray.tune.registry import register_env

        from envs import make_env

        c = self.config
        register_env(ENV_NAME, make_env)
        config = (
            PPOConfig()
            .environment(ENV_NAME, env_config=env_config(problem, microbatches))
            .env_runners(num_env_runners=c.num_env_runners, num_envs_per_env_runner=1)
            .learners(num_learners=0)
            .training(
                train_batch_size_per_learner=c.train_batch,
                minibatch_size=c.minibatch,
                num_epochs=c.epochs,
                lr=c.lr,
                entropy_coeff=c.entropy_coeff,
            )
            .rl_module(
                rl_module_spec=RLModuleSpec(
                    module_class=ActionMaskingTorchRLModule,
                    model_config={
                        "head_fcnet_hiddens": list(c.hidden),
                        "fcnet_hiddens": list(c.hidden),
                    },
                )
            )
            .callbacks(_best_callbacks())
            .debugging(seed=problem.seed, log_level="ERROR")
        )
        algo = config.build_algo()
        if c.restore:
            if not Path(c.restore).exists():
                raise ProblemError(f"ppo.restore: no checkpoint at {c.restore}")
            algo.restore_from_path(str(Path(c.restore).resolve()))
        return algo

    def _train(self, algo: Any, search: Search) -> None:
        problem = search.problem
        counted = 0
        for _ in range(self.config.iterations):
            algo.train()
            episodes, bests = _gather(algo)
            search.count(episodes - counted)
            counted = episodes
            if bests:
                value, doc = min(bests, key=lambda b: b[0])
                search.evaluate_plans([Plan.from_dict(doc)])
            if search.exhausted():
                break
        if self.config.checkpoint:
            algo.save_to_path(str(Path(self.config.checkpoint).resolve()))
        if search.best_plan is not None:  # the best structure with every microbatch size
            best = search.best_plan
            search.evaluate_plans(
                [
                    Plan(
                        problem.global_batch,
                        tuple(Stage(s.layers, s.devices, b) for s in best.stages),
                        problem.schedule,
                    )
                    for b in problem.microbatch_sizes()
                ]
            )


def _ensure_ray() -> bool:
    """Start a local Ray (loopback, capped object store) unless one is up; True if started."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        address="local",  # a new local instance, never a `ray start` cluster found on disk
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 2**20,
        log_to_driver=False,
        configure_logging=False,
    )
    return True
