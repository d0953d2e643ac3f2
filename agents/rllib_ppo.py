"""``ppo``: PPO from RLlib on :class:`envs.env.PlacementEnv` (the only RLlib import).

RLlib moves its API between releases; everything version-specific is in this module and was
checked against Ray 2.60 (new API stack): ``PPOConfig().environment/env_runners/training/
rl_module/callbacks/debugging``, ``RLModuleSpec`` with RLlib's own action-masking PPO module
(``ActionMaskingTorchRLModule``, which reads the env's ``{"observations", "action_mask"}``
observation), ``Algorithm.save_to_path`` / ``restore_from_path`` for checkpoints and
``env_runner_group.foreach_env_runner`` to gather the best plan each runner has seen.

Episodes are costed inside the env by the contract cost model (one evaluation each, counted
in the result). Unless the problem (or the ``microbatches`` option) fixes the microbatch
count, the first action of an episode chooses it among the problem's counts, and a stage may
take replicas (up to ``max_replicas``), so the env's space holds ``brute``'s optimum over
equal microbatches. The best plan any runner has seen is the answer. With
``polish_evaluations=N`` (default 0: PPO's own plan, pure RL) that plan is then polished by
a steepest-descent local search over one-edit neighbours (:func:`polish`) through the
vectorised cost model, at most N evaluations; the result's options say it was.

Hyper-parameters: the reward comes once, at the end, so ``gamma = 1`` (RLlib's default 0.99
discounts the first decisions of a 24-step episode by 0.8); small train batches and several
epochs make more updates within ~40 iterations. The defaults come from a handful of runs of
bench/ppo_quality.py only: PPO's own best plan is still 3-22% from exact there (see that
benchmark, which reports PPO alone and PPO + polish).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import permutations
from pathlib import Path
from typing import Any

import numpy as np

from agents.problem import Problem, ProblemError
from agents.registry import Planner
from agents.search import Search
from core.plan import Plan, Stage

ENV_NAME = "pipeplan-placement-v0"
StageSpec = tuple[int, int, tuple[str, ...]]  # layers [start, end) on devices
StageList = list[StageSpec]


@dataclass(frozen=True)
class PPOOptions:
    """Options of the ``ppo`` planner."""

    iterations: int = 40  # PPO training iterations (each samples train_batch env steps)
    num_env_runners: int = 0  # parallel sampling processes (0: sample in the driver)
    train_batch: int = 500  # env steps per iteration
    minibatch: int = 125  # SGD minibatch size
    epochs: int = 6  # SGD passes over each batch
    lr: float = 5e-4
    entropy_coeff: float = 0.005
    gamma: float = 1.0  # discount (the only reward is the last)
    lambda_: float = 0.95  # GAE lambda
    clip_param: float = 0.2  # PPO's ratio clip
    hidden: tuple[int, ...] = (128, 128)  # policy / value MLP sizes
    microbatches: int | None = None  # fixed microbatch count (None: problem's, else chosen)
    max_replicas: int | None = None  # devices per stage at most (None: every device)
    polish_evaluations: int = 0  # local search from PPO's best plan (0: PPO's plan as is)
    checkpoint: str | None = None  # save the trained algorithm here at the end
    restore: str | None = None  # restore an algorithm saved by `checkpoint` before training

    def __post_init__(self) -> None:
        for key in ("iterations", "train_batch", "minibatch", "epochs"):
            if getattr(self, key) < 1:
                raise ProblemError(f"ppo.{key}: must be >= 1, got {getattr(self, key)}")
        if self.num_env_runners < 0:
            raise ProblemError(f"ppo.num_env_runners: must be >= 0, got {self.num_env_runners}")
        for key in ("gamma", "lambda_"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ProblemError(f"ppo.{key}: must be in [0, 1], got {getattr(self, key)}")
        for key in ("lr", "clip_param"):
            if not getattr(self, key) > 0:
                raise ProblemError(f"ppo.{key}: must be > 0, got {getattr(self, key)}")
        if self.polish_evaluations < 0:
            raise ProblemError(
                f"ppo.polish_evaluations: must be >= 0, got {self.polish_evaluations}"
            )
        if self.entropy_coeff < 0:
            raise ProblemError(f"ppo.entropy_coeff: must be >= 0, got {self.entropy_coeff}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ProblemError(f"ppo.microbatches: must be >= 1, got {self.microbatches}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ProblemError(f"ppo.max_replicas: must be >= 1, got {self.max_replicas}")


def env_config(
    problem: Problem, microbatches: int | None, max_replicas: int | None = None
) -> dict[str, Any]:
    """The env's config; ``microbatches`` None: the episode chooses among the problem's."""
    n_dev = len(problem.cluster.device_ids)
    counts = microbatches or [problem.global_batch // b for b in problem.microbatch_sizes()]
    return {
        "profile": problem.profile,
        "cluster": problem.cluster,
        "objective": problem.objective.value,
        "global_batch": problem.global_batch,
        "microbatches": counts,
        "schedule": problem.schedule.value,
        "min_throughput": problem.min_throughput,
        "max_replicas": min(max_replicas or n_dev, n_dev),
    }


def _microbatches(problem: Problem, option: int | None) -> int | None:
    """The fixed microbatch count (the problem's, else the option's), or None: chosen."""
    if problem.microbatches is not None:
        return problem.microbatches
    if option is not None and problem.global_batch % option:
        raise ProblemError(
            f"ppo.microbatches: {option} does not divide global_batch {problem.global_batch}"
        )
    return option


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

    def _build(self, problem: Problem, microbatches: int | None) -> Any:
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
            .environment(ENV_NAME, env_config=env_config(problem, microbatches, c.max_replicas))
            .env_runners(num_env_runners=c.num_env_runners, num_envs_per_env_runner=1)
            .learners(num_learners=0)
            .training(
                train_batch_size_per_learner=c.train_batch,
                minibatch_size=c.minibatch,
                num_epochs=c.epochs,
                lr=c.lr,
                entropy_coeff=c.entropy_coeff,
                gamma=c.gamma,
                lambda_=c.lambda_,
                clip_param=c.clip_param,
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
        if search.best_plan is not None and self.config.polish_evaluations > 0:
            polish(search, self.config.polish_evaluations)


def neighbours(plan: Plan, problem: Problem) -> list[Plan]:
    """Plans one edit away from ``plan``, each with every allowed equal microbatch size.

    Edits: a stage boundary moved by 1-2 layers (also with the stages' device groups in
    every order, up to 4 stages), the device groups reordered, a stage's device exchanged
    with an unused one or with another stage's, a replica added or removed, two adjacent
    stages merged (on the devices of both, or of either), a stage split with one part on an
    unused device or on one of its replicas."""
    ids = problem.cluster.device_ids
    stages: StageList = [(s.start, s.end, s.devices) for s in plan.stages]
    unused = [d for d in ids if d not in plan.devices]
    moved: list[StageList] = [stages]
    for k in range(len(stages) - 1):  # move the boundary between k and k+1
        for step in (-2, -1, 1, 2):
            cut = stages[k][1] + step
            if stages[k][0] < cut < stages[k + 1][1]:
                new = list(stages)
                new[k] = (stages[k][0], cut, stages[k][2])
                new[k + 1] = (cut, stages[k + 1][1], stages[k + 1][2])
                moved.append(new)
    out: list[StageList] = []
    for new in moved:  # ... with the device groups in every order
        groups = [d for _, _, d in new]
        orders = permutations(groups) if len(groups) <= 4 else iter([tuple(groups)])
        out += [[(s, e, g) for (s, e, _), g in zip(new, order, strict=True)] for order in orders]
    for k, (s, e, devs) in enumerate(stages):
        for i, d in enumerate(devs):
            for u in unused:  # exchange a device for an unused one
                out.append(_with(stages, k, (s, e, (*devs[:i], u, *devs[i + 1 :]))))
            for j in range(k + 1, len(stages)):  # exchange with another stage's device
                for i2, d2 in enumerate(stages[j][2]):
                    new = _with(stages, k, (s, e, (*devs[:i], d2, *devs[i + 1 :])))
                    sj, ej, o = stages[j]
                    out.append(_with(new, j, (sj, ej, (*o[:i2], d, *o[i2 + 1 :]))))
            if len(devs) > 1:  # remove a replica
                out.append(_with(stages, k, (s, e, (*devs[:i], *devs[i + 1 :]))))
        for u in unused:  # add a replica; split the stage onto an unused device
            out.append(_with(stages, k, (s, e, (*devs, u))))
        for cut in range(s + 1, e):  # split off a new stage on an unused device or a replica
            for u in unused:
                out.append([*stages[:k], (s, cut, devs), (cut, e, (u,)), *stages[k + 1 :]])
                out.append([*stages[:k], (s, cut, (u,)), (cut, e, devs), *stages[k + 1 :]])
            for i, x in enumerate(devs if len(devs) > 1 else ()):
                rest = (*devs[:i], *devs[i + 1 :])
                out.append([*stages[:k], (s, cut, rest), (cut, e, (x,)), *stages[k + 1 :]])
                out.append([*stages[:k], (s, cut, (x,)), (cut, e, rest), *stages[k + 1 :]])
        if k + 1 < len(stages):  # merge with the next stage, on both's or either's devices
            after = stages[k + 1]
            for group in (devs + after[2], devs, after[2]):
                out.append([*stages[:k], (s, after[1], group), *stages[k + 2 :]])
    return [
        Plan(problem.global_batch, tuple(Stage((s, e), d, b) for s, e, d in new), plan.schedule)
        for new in out
        for b in problem.microbatch_sizes()
    ]


def _with(stages: StageList, k: int, stage: StageSpec) -> StageList:
    return [*stages[:k], stage, *stages[k + 1 :]]


def polish(search: Search, evaluations: int) -> None:
    """Steepest-descent local search from the best plan over :func:`neighbours`, through
    the vectorised cost model, until no neighbour improves or ``evaluations`` are spent."""
    spent = 0
    while search.best_plan is not None and spent < evaluations and not search.exhausted():
        before = search.best_value
        plans = neighbours(search.best_plan, search.problem)[: evaluations - spent]
        if not plans:
            return
        search.evaluate_plans(plans)
        spent += len(plans)
        if not search.best_value < before:
            return


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
