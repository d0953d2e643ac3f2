"""Joint REINFORCE for TAPP's partition and allocation networks.

One iteration reads top to bottom: **sample** a batch of plans from the policy, **evaluate**
them through the task's :class:`~agents.search.Search`, so through its reward source
(plans seen before come from a cache: the simulated reward is deterministic, and a measured
one already averages repeats), compute the
**advantage** (shaped reward minus a moving-average baseline), **update** both networks with
one policy-gradient step (entropy bonus, gradient clipping). The best plan seen is kept, and
the best few distinct plans (the elite) are replayed into every update with their cached
rewards (their decisions re-scored by the current policy), which keeps the search from
drifting away from the best region it has found (self-imitation). A policy that finds
nothing better for ``restart_after`` iterations has converged on a local optimum: learning
starts over from the initial weights (the plans seen and the best plan are kept), so the
rest of the budget follows another trajectory (random restarts).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeplan.agents.problem import Budget, Objective, Problem, ProblemError
from pipeplan.agents.resume import check_checkpoint_options
from pipeplan.agents.search import Search
from pipeplan.agents.tapp import checkpoint
from pipeplan.agents.tapp.checkpoint import Checkpointer, LoopState
from pipeplan.agents.tapp.features import PlanContext, make_context
from pipeplan.agents.tapp.nets import TAPPPolicy
from pipeplan.agents.tapp.sampling import Sample, sample_plans
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.plan import Plan, Schedule
from pipeplan.core.profile import ModelProfile


@dataclass(frozen=True)
class TAPPConfig:
    """Hyper-parameters of TAPP's joint REINFORCE (the ``tapp`` planner's options)."""

    batch_size: int = 64
    """plans sampled per iteration (64 rather than 32: see bench/results/rl_quality/)"""
    learning_rate: float = 3e-3
    """Adam step size, shared by both networks"""
    hidden: int = 64
    """width of the hidden layers of every network"""
    attention_dim: int = 32
    """width of the allocation network's queries and keys"""
    baseline_decay: float = 0.9
    """moving-average baseline: ``b <- decay * b + (1 - decay) * mean reward``"""
    normalize_advantages: bool = True
    """divide the advantages by the batch's reward standard deviation"""
    entropy_coef: float = 1.0
    """weight of the entropy bonus (per-decision mean entropy of each head, summed; 1.0
    rather than 0.3, which settled on local optima of ResNet-50's 174 layers: README, "The
    two learned planners")"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global L2 norm"""
    infeasible_penalty: float = 1.0
    """an infeasible plan's reward sits this far below the worst feasible plan seen"""
    max_groups: int | None = None
    """most pipeline stages (None: one per device)"""
    iterations: int | None = None
    """most iterations (None: until the budget or the patience runs out)"""
    patience: int | None = 300
    """stop after this many iterations without a better plan (None: never)"""
    restart_after: int | None = 100
    """start learning over after this many iterations without a better plan (None: never):
    the policy's initial weights, a fresh optimizer, baseline and elite; the plans seen and
    the best plan are kept. A policy that has converged on a local optimum samples little
    that is new; a restart spends the rest of the budget on another trajectory"""
    greedy_every: int = 10
    """every this many iterations also evaluate the policy's most likely plan (no gradient)"""
    frozen: bool = False
    """sample without updating the policy (a pretrained policy, zero updates)"""
    temperature: float = 1.0
    """divide every logit by this when sampling (> 1 explores more, e.g. a pretrained policy)"""
    pretrained: str | None = None
    """path of a policy saved by ``TAPPPolicy.save`` to start from (its sizes win)"""
    unequal: bool = True
    """each stage samples its own microbatch size (UMPIPE's unequal data partition); False:
    one shared size for every stage, as in the paper"""
    threads: int | None = 1
    """torch threads while training (the networks' tensors are small: one thread is as fast,
    and more wait on each other when other processes hold the cores); None: torch's own"""
    elite: int = 8
    """replay the best this many distinct plans seen in every update (their decisions, their
    cached rewards; no evaluation): self-imitation of the elite (0: off; its effect is in
    bench/results/rl_quality/)"""
    checkpoint_dir: str | None = None
    """write a checkpoint of the search into this folder (:mod:`agents.tapp.checkpoint`), and
    continue from the one it holds when it holds one"""
    checkpoint_every: int | None = None
    """iterations between two checkpoints (None: :data:`agents.resume.DEFAULT_CHECKPOINT_EVERY`
    when ``checkpoint_dir`` is set)"""
    resume: str | None = None
    """continue the search from the checkpoint in this folder (it must hold one)"""

    def __post_init__(self) -> None:
        positive = (
            "batch_size", "learning_rate", "hidden", "attention_dim", "max_grad_norm",
            "temperature",
        )  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ProblemError(f"tapp.{name}: must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.baseline_decay < 1.0:
            raise ProblemError(f"tapp.baseline_decay: must be in [0, 1), got {self.baseline_decay}")
        for name in ("entropy_coef", "infeasible_penalty", "greedy_every", "elite"):
            if getattr(self, name) < 0:
                raise ProblemError(f"tapp.{name}: must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_groups", "iterations", "patience", "restart_after", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ProblemError(f"tapp.{name}: must be None or >= 1, got {value!r}")
        check_checkpoint_options("tapp", self.checkpoint_dir, self.checkpoint_every, self.resume)
        if self.pretrained is not None:
            check_policy_file(self.pretrained, "tapp.pretrained")


def check_policy_file(path: str, what: str) -> None:
    """``path`` holds a policy :meth:`TAPPPolicy.save` wrote; :class:`ProblemError` naming
    ``what`` otherwise (no such file, or a file that is not one)."""
    if not isinstance(path, str) or not Path(path).is_file():
        raise ProblemError(f"{what}: no policy file at {path!r}")
    try:
        TAPPPolicy.load(path)
    except Exception as e:  # torch raises several kinds for a file that is not its own
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ProblemError(f"{what}: {path} is not a TAPP policy ({first})") from None


@dataclass
class Task:
    """One planning problem being learned: its tensors, the search that values its plans
    (and keeps the budget, the best plan and the history) and the learner's book-keeping."""

    context: PlanContext
    search: Search
    cache: dict[bytes, float] = field(default_factory=dict)
    reference: float | None = None  # first finite value seen: reward 0
    worst: float | None = None  # worst finite value seen
    baseline: float | None = None
    best_value: float = math.inf
    best_plan: Plan | None = None
    elite: dict[bytes, tuple[float, Sample]] = field(default_factory=dict)  # key -> value, plan


@dataclass(frozen=True)
class IterationLog:
    """What one iteration did (for progress lines and learning curves)."""

    iteration: int
    profile: str
    evaluations: int  # distinct plans evaluated so far, over all tasks
    best_value: float  # of this iteration's task
    mean_reward: float
    loss: float
    entropy: float
    seconds: float


OnIteration = Callable[[IterationLog], None]


# --- the four parts of an iteration --------------------------------------------------------


def evaluate(task: Task, sample: Sample) -> np.ndarray:
    """Objective values of the sampled plans; only plans never seen go to the search."""
    keys = [sample.key(i) for i in range(sample.n)]
    new: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        if k not in task.cache and k not in new:
            new[k] = i
    if new:
        plans = [sample.plan(i, task.context) for i in new.values()]
        values = task.search.evaluate_plans(plans)
        for k, v, plan in zip(new, values, plans, strict=True):
            task.cache[k] = float(v)
            if v < task.best_value:
                task.best_value, task.best_plan = float(v), plan
    return np.array([task.cache[k] for k in keys])


def update_elite(task: Task, sample: Sample, values: np.ndarray, size: int) -> None:
    """Keep the ``size`` best distinct feasible plans seen (ties: the first seen)."""
    if size < 1:
        return
    for i in np.flatnonzero(np.isfinite(values)):
        key = sample.key(int(i))
        if key not in task.elite:
            task.elite[key] = (float(values[i]), sample.take([int(i)]))
    if len(task.elite) > size:
        keep = sorted(task.elite.items(), key=lambda kv: kv[1][0])[:size]
        task.elite = dict(keep)


def replay_elite(
    policy: TAPPPolicy, task: Task, generator: torch.Generator, temperature: float
) -> tuple[Sample, np.ndarray] | None:
    """The elite's plans re-scored by the current policy (log-probability, entropy) and
    their cached values; None when there is no elite."""
    if not task.elite:
        return None
    plans = Sample.concat([plan for _, plan in task.elite.values()])
    values = np.array([value for value, _ in task.elite.values()])
    replay = sample_plans(
        policy, task.context, plans.n, generator, temperature=temperature, given=plans
    )
    return replay, values


def shape_rewards(
    values: np.ndarray, reference: float, worst: float, infeasible_penalty: float
) -> np.ndarray:
    """Reward ``log(reference / value)`` (0 = as good as the reference, +0.69 = twice as
    good); an infeasible plan gets ``min(0, log(reference / worst)) - infeasible_penalty``,
    below every feasible plan seen (``worst`` = the worst finite value seen). The log-ratio
    gives every model and objective the same reward scale."""
    values = np.asarray(values, dtype=np.float64)
    floor = min(0.0, float(np.log(reference / worst))) - infeasible_penalty
    with np.errstate(divide="ignore"):
        good = np.log(reference / values)
    return np.where(np.isfinite(values), good, floor)


def task_rewards(task: Task, values: np.ndarray, infeasible_penalty: float) -> np.ndarray:
    """Shaped rewards (:func:`shape_rewards`) against the task's reference value."""
    finite = values[np.isfinite(values)]
    if finite.size:
        if task.reference is None:
            task.reference = float(finite[0])
        task.worst = max(task.worst or 0.0, float(finite.max()))
    ref = task.reference or 1.0
    return shape_rewards(values, ref, task.worst or ref, infeasible_penalty)


def advantages(rewards: np.ndarray, baseline: float, normalize: bool) -> np.ndarray:
    """``rewards - baseline``, divided by the rewards' standard deviation when asked (and
    when it is not ~0)."""
    adv = rewards - baseline
    std = float(rewards.std())
    return adv / std if normalize and std > 1e-6 else adv


def reinforce_loss(log_prob: Tensor, advantage: Tensor, entropy: Tensor, coef: float) -> Tensor:
    """``-mean(A * log pi(plan)) - coef * mean(H)``; its gradient is the REINFORCE estimate
    of minus the expected advantage's gradient, minus the entropy bonus's."""
    return -(advantage.detach() * log_prob).mean() - coef * entropy.mean()


# --- the loop ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """What one policy-gradient step saw: its fresh sample, the shaped rewards (the sample's,
    then the replayed elite's) and the loss."""

    sample: Sample
    rewards: np.ndarray
    loss: Tensor


def reinforce_step(
    policy: TAPPPolicy,
    optimizer: torch.optim.Optimizer,
    task: Task,
    config: TAPPConfig,
    gen: torch.Generator,
    n: int,
) -> Step:
    """One iteration on ``task``, top to bottom: sample ``n`` plans, evaluate them (and
    replay the elite), compute the advantage, update the policy (unless frozen)."""
    # 1. sample
    with torch.set_grad_enabled(not config.frozen):
        sample = sample_plans(policy, task.context, n, gen, temperature=config.temperature)
    # 2. evaluate (and the elite: the best plans so far, replayed, not re-evaluated)
    values = evaluate(task, sample)
    update_elite(task, sample, values, config.elite)
    batch, batch_values = sample, values
    with torch.set_grad_enabled(not config.frozen):
        replay = replay_elite(policy, task, gen, config.temperature)
    if replay is not None:
        batch = Sample.concat([sample, replay[0]])
        batch_values = np.concatenate([values, replay[1]])
    # 3. advantage
    rewards = task_rewards(task, batch_values, config.infeasible_penalty)
    if task.baseline is None:
        task.baseline = float(rewards.mean())
    adv = advantages(rewards, task.baseline, config.normalize_advantages)
    d = config.baseline_decay
    task.baseline = d * task.baseline + (1 - d) * float(rewards.mean())
    # 4. update
    loss = reinforce_loss(
        batch.log_prob, torch.as_tensor(adv, dtype=torch.float32), batch.entropy,
        config.entropy_coef,
    )  # fmt: skip
    if not config.frozen:
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
        optimizer.step()
    return Step(sample, rewards, loss)


def train(
    policy: TAPPPolicy,
    tasks: Sequence[Task],
    config: TAPPConfig,
    *,
    seed: int,
    should_stop: Callable[[], bool] = lambda: False,
    remaining: Callable[[], int | None] = lambda: None,
    on_iteration: OnIteration | None = None,
    checkpointer: Checkpointer | None = None,
    resume: dict[str, Any] | None = None,
) -> list[IterationLog]:
    """Run REINFORCE over ``tasks`` (picked uniformly at random when several) until
    ``config.iterations``, ``config.patience``, ``should_stop()`` or ``remaining() == 0``;
    every ``config.greedy_every`` iterations the policy's most likely plan is evaluated too.
    With a ``checkpointer``, every ``checkpointer.every`` iterations the whole loop is saved
    (:mod:`agents.tapp.checkpoint`); ``resume``, a checkpoint :func:`checkpoint.load` read,
    continues it (the iteration count, the generators, the tasks' book-keeping)."""
    with torch_threads(config.threads):
        return _train(
            policy, tasks, config, seed, should_stop, remaining, on_iteration, checkpointer,
            resume,
        )  # fmt: skip


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads (None: as set), then restore."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(
    policy: TAPPPolicy,
    tasks: Sequence[Task],
    config: TAPPConfig,
    seed: int,
    should_stop: Callable[[], bool],
    remaining: Callable[[], int | None],
    on_iteration: OnIteration | None,
    checkpointer: Checkpointer | None,
    resume: dict[str, Any] | None,
) -> list[IterationLog]:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    initial = copy.deepcopy(policy.state_dict())
    optimizer: torch.optim.Optimizer = torch.optim.Adam(
        policy.parameters(), lr=config.learning_rate
    )
    loop = LoopState()
    if resume is not None:
        loop, initial = checkpoint.restore(resume, policy, optimizer, gen, rng, list(tasks))
    logs: list[IterationLog] = []
    start = time.perf_counter()
    while config.iterations is None or loop.iteration < config.iterations:
        it, stale, fresh = loop.iteration, loop.stale, loop.fresh
        if should_stop() or (config.patience is not None and stale >= config.patience):
            break
        if config.restart_after is not None and fresh >= config.restart_after:
            optimizer = restart(policy, initial, tasks, config)
            fresh = 0
        task = tasks[int(rng.integers(len(tasks)))] if len(tasks) > 1 else tasks[0]
        best_before = task.best_value
        if config.greedy_every and it % config.greedy_every == 0:
            with torch.no_grad():
                evaluate(task, sample_plans(policy, task.context, 1, gen, greedy=True))
        left = remaining()
        n = config.batch_size if left is None else min(config.batch_size, left)
        if n < 1:
            break
        step = reinforce_step(policy, optimizer, task, config, gen, n)
        stale = 0 if task.best_value < best_before else stale + 1
        fresh = 0 if stale == 0 else fresh + 1
        it += 1
        loop = LoopState(it, stale, fresh)
        if checkpointer is not None and checkpointer.due(it):
            checkpoint.save(checkpointer, loop, policy, initial, optimizer, gen, rng, list(tasks))
        log = IterationLog(
            iteration=it,
            profile=task.context.profile.name,
            evaluations=sum(len(t.cache) for t in tasks),
            best_value=task.best_value,
            mean_reward=float(step.rewards[: step.sample.n].mean()),
            loss=float(step.loss.detach()),
            entropy=float(step.sample.entropy.detach().mean()),
            seconds=time.perf_counter() - start,
        )
        logs.append(log)
        if on_iteration is not None:
            on_iteration(log)
    if checkpointer is not None and logs and not checkpointer.due(loop.iteration):
        checkpoint.save(checkpointer, loop, policy, initial, optimizer, gen, rng, list(tasks))
    return logs


def restart(
    policy: TAPPPolicy, initial: dict[str, Tensor], tasks: Sequence[Task], config: TAPPConfig
) -> torch.optim.Optimizer:
    """Start learning over (``config.restart_after``): the policy back to its ``initial``
    weights, every task's learner state (reference, baseline, elite) forgotten; the plans
    seen (cache) and the best plan stay. Returns the fresh optimizer."""
    policy.load_state_dict(initial)
    for task in tasks:
        task.reference = task.worst = task.baseline = None
        task.elite = {}
    return torch.optim.Adam(policy.parameters(), lr=config.learning_rate)


def problem_context(problem: Problem, config: TAPPConfig) -> PlanContext:
    """The sampling context of ``problem``: its profile, cluster, batch, allowed microbatch
    sizes and schedule, with at most ``config.max_groups`` groups."""
    return make_context(
        problem.profile,
        problem.cluster,
        problem.global_batch,
        problem.microbatch_sizes(),
        problem.schedule,
        config.max_groups,
        config.unequal,
    )


def new_policy(config: TAPPConfig, seed: int) -> TAPPPolicy:
    """A freshly initialised policy (seeded, leaving the global torch RNG as it was), or the
    one ``config.pretrained`` names."""
    if config.pretrained is not None:
        return TAPPPolicy.load(config.pretrained)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TAPPPolicy(config.hidden, config.attention_dim)


# --- one policy, many models ---------------------------------------------------------------


def train_policy(
    profiles: Sequence[ModelProfile],
    cluster: ClusterSpec | Sequence[ClusterSpec],
    *,
    objective: Objective | str = Objective.TIME,
    global_batch: int = 64,
    schedule: Schedule | str = Schedule.GPIPE,
    microbatches: int | None = None,
    min_throughput: float | None = None,
    config: TAPPConfig = TAPPConfig(),
    iterations: int = 300,
    seed: int = 0,
    on_iteration: OnIteration | None = None,
) -> TAPPPolicy:
    """Train one policy on several models, on one cluster or several (every model on every
    cluster; each iteration picks one pair at random) and return it, for planning unseen
    models: ``TAPPPlanner(policy=p)`` (few updates) or with ``frozen=True`` (zero updates)."""
    clusters = [cluster] if isinstance(cluster, ClusterSpec) else list(cluster)
    if not profiles:
        raise ProblemError("train_policy: profiles: empty list")
    if not clusters:
        raise ProblemError("train_policy: cluster: empty list")
    tasks = []
    for profile, spec in itertools.product(profiles, clusters):
        problem = Problem(
            profile,
            spec,
            objective=Objective(objective),
            global_batch=global_batch,
            schedule=Schedule(schedule),
            microbatches=microbatches,
            min_throughput=min_throughput,
            seed=seed,
            budget=Budget(evaluations=None, seconds=None),
        )
        ctx = make_context(
            profile, spec, global_batch, problem.microbatch_sizes(), problem.schedule,
            config.max_groups, config.unequal,
        )  # fmt: skip
        tasks.append(Task(ctx, Search(problem, "tapp", {})))
    policy = new_policy(config, seed)
    run = dataclasses.replace(config, iterations=iterations, patience=None, restart_after=None)
    train(policy, tasks, run, seed=seed, on_iteration=on_iteration)
    return policy
