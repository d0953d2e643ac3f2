"""``ppo``: PPO from RLlib on :class:`envs.env.PlacementEnv` (the only RLlib import).

RLlib moves its API between releases; everything version-specific is in this module and was
checked against Ray 2.60 (new API stack): ``PPOConfig().environment/env_runners/training/
rl_module/callbacks/debugging``, ``RLModuleSpec`` with RLlib's own action-masking PPO module
(``ActionMaskingTorchRLModule``, which reads the env's ``{"observations", "action_mask"}``
observation), ``Algorithm.save_to_path`` / ``restore_from_path`` for checkpoints and
``env_runner_group.foreach_env_runner`` to gather the best plan each runner has seen. RLlib
gets the env as its class (built from the env config), not as a name in Tune's registry:
that registry keeps the job id of the first cluster this process joined, so after a
reconnect (a second search in one process) remote env runners could not find the name.

Ray: PPO runs on the Ray cluster this process is connected to (the faces start or join one
through ``executor.runtime``: ``--address``, a Ray Job's own cluster, or a local one); it
never starts one of its own, and refuses to run unconnected. Its env runners are actors of
that cluster, one CPU each. Unless the ``num_env_runners`` option fixes their number, PPO
takes as many as the cluster has spare CPUs when it starts (:func:`default_env_runners`:
Ray's available CPUs, rounded down, less one for the driver, which samples nothing then but
runs the learner; 0 -- sample in the driver -- when none are spare), at most one per
:data:`MIN_STEPS_PER_RUNNER` steps of a train batch, so that every runner samples whole
episodes and a large cluster does not start hundreds of idle processes.

Episodes are costed inside the env by the contract cost model. Unless the problem (or the
``microbatches`` option) fixes the microbatch count, the first action of an episode chooses
it among the problem's counts, and a stage may take replicas (up to ``max_replicas``), so
the env's space holds ``brute``'s optimum over equal microbatches. With the ``stages``
actions and several counts, ``stage_sizes=True`` also lets each stage choose its own
microbatch size right after its end (UMPIPE's unequal microbatches, the env's
``stage_sizes``): the space then holds ``brute``'s ``unequal`` optimum too, plans such as
small microbatches for VGG-16's convolutions and the whole batch for its classifier, whose
gradient accumulation (rule 2b) costs the most per microbatch. It is on by default, with the
smaller, more frequent updates (500-step batches at lr 3e-3) that did better with its longer
episodes: the defaults below are what ``bench.plan_quality --realistic`` tuned on VGG-16 and
ResNet-50 on ``cloud-mix`` in 60 s of search, and ``bench.ppo_quality`` measured them on the
small instances too (README). After every training
iteration the best plan any runner has seen is valued through the search, so through its
reward source, and the best plan so valued is the answer. With ``polish_evaluations=N``
(default 0: PPO's own plan, pure RL) that plan is then polished by a steepest-descent local
search over one-edit neighbours (:func:`agents.local_search.polish`), at most N evaluations
through the same source; the result's options say it was.

Elite starts and restarts (both on by default: ``elite_starts=0.5``, ``restart_after=60``;
0 and None turn them off): a PPO policy settles on one plan within a few thousand episodes,
and which one depends on the seed. Every env runner keeps its best distinct plans
(:class:`BestPlan`, one episode per plan); after every iteration the ``elites`` best of all
runners go back to every env (``PlacementEnv.set_elites``), and with ``elite_starts=q`` an
episode starts, with probability ``q``, from a random prefix of one of them
(:func:`envs.mdp.elite_start`, Go-Explore's return to a promising state): the policy then
learns the continuations of the best plans' beginnings, and samples them however it has
converged; with ``elite_mutations=p`` such a start, with probability ``p``, changes the last
action of its prefix to another of its kind (another end, size or device: Go-Explore's
exploring from the state returned to), so the best plans' neighbours keep being tried after
the policy has settled on one. With ``restart_after=N``, after N iterations without a better
plan the policy, its value function and the optimizer go back to their initial state and
the elites are forgotten (:class:`Restart`, as TAPP's ``restart_after``): the next
trajectory starts afresh, and the search keeps the best plan found.

Twin opens and slot scores (both on by default with the ``stages`` actions, which have the
actions and slots they need; ``False`` turns them off): with ``twin_opens=True`` a stage may
open on a device and its free twins (same type, same node) as replicas in one action (the env's
``twin_opens``); the best plans on ``cloud-mix`` pair every GPU with its twin, which plain
actions reach only through an open and a replica step that the policy, facing 174 end actions
beside 6 replicas on ResNet-50, stops taking early. With ``slot_scores=True`` the policy is
:class:`SlotScoringModule`: every end slot and every size gets a score from its own observation
row by one small network shared by the slots, beside the MLP's logits, so what the policy
learns about one end holds for all.

At production scale (a cluster given with counts under the time objectives,
:func:`agents.provision.scale.at_scale`) the env is :class:`envs.kind_env.KindPlacementEnv`
instead: an episode chooses the microbatch size, then per stage an option (a device type on
a node kind), its node count and its end, with RLlib's action-masking module (no slot
scorers), whatever the ``actions``, ``stage_sizes``, ``twin_opens``, ``slot_scores``,
``microbatches`` and ``max_replicas`` options say. Its episodes are ``1 + 3 S`` steps
however many devices there are. With ``elite_starts`` the envs get the balanced kind-level
splits (:func:`agents.provision.scale.balanced_seeds`) as their first elites, to start
episodes from their prefixes; those splits are not evaluated themselves, so the answer is
an episode PPO played.

Reward sources: RLlib's env runners learn from the cost model in the env whatever the
source; the source decides which of PPO's plans is the answer. With a source that values
plans as the env does (``simulated``, ``parallel``: :data:`COST_MODEL_SOURCES`) every episode
is an evaluation of that source and counts towards the budget. With another source (a
``measured`` one runs each plan on the executor) the episodes are a surrogate: they are not
counted, and the budget bounds the source's evaluations alone -- one per iteration (the
runners' best plan; a measured source runs a plan once however often it comes back) plus
the polish.

Checkpoints: with ``checkpoint_dir=DIR`` the search writes, every ``checkpoint_every``
iterations (and where it ends), RLlib's checkpoint of the algorithm and the search's own
state beside it (:class:`PPOCheckpoints`); started again on that folder, or with
``resume=DIR``, it restores both and goes on: the iteration count, the evaluations, the
history and the best plan continue, and the env runners get the saved elites back.

Hyper-parameters: the reward comes once, at the end, so ``gamma = 1`` (RLlib's default 0.99
discounts the first decisions of a 24-step episode by 0.8). With the ``stages`` action space
an episode is a few steps per stage, so a train batch of 1,000 steps holds ~120 episodes;
80 iterations (~10-16k episodes) are what the hardest ``bench/ppo_quality.py`` instance
needed to leave the local optimum that 40 iterations of 500 steps stopped at (the defaults
come from a handful of such runs; entropy and learning-rate changes did not help there).
That bench reports how far PPO alone lands from the exact answer and after how many
evaluations (``bench/results/ppo_quality/``).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.callbacks.callbacks import RLlibCallback
from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.examples.rl_modules.classes.action_masking_rlm import ActionMaskingTorchRLModule
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from pipeplan.agents.local_search import polish
from pipeplan.agents.problem import Problem, ProblemError
from pipeplan.agents.provision.scale import at_scale, kind_env_config
from pipeplan.agents.registry import Planner
from pipeplan.agents.resume import (
    CHECKPOINT_FILES,
    check_checkpoint_options,
    check_fingerprint,
    every,
    fingerprint,
    read_json,
    resume_folder,
    write_json_atomic,
)
from pipeplan.agents.search import Search
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan
from pipeplan.envs import PlacementEnv
from pipeplan.envs.config import instances_from_config
from pipeplan.envs.kind_env import KindPlacementEnv
from pipeplan.envs.mdp import ACTION_SPACES, GLOBAL_FEATURES, STAGES, global_offset, slot_groups

DRIVER_CPUS = 1.0
"""CPUs left to the driver (it runs the learner) when the env runners are counted."""
MIN_STEPS_PER_RUNNER = 32
"""Env steps of a train batch per runner at least, when their number is the default."""
RUNNER_ELITES = 16
"""Best distinct episodes each env runner keeps (the planner takes its ``elites`` of all)."""
COST_MODEL_SOURCES = frozenset({"simulated", "parallel"})
"""Reward sources that value a plan as the env does (the contract cost model): with these,
the env runners' episodes count as the search's evaluations."""


@dataclass(frozen=True)
class PPOOptions:
    """Options of the ``ppo`` planner."""

    iterations: int = 160  # PPO training iterations (each samples train_batch env steps)
    num_env_runners: int | None = None  # sampling actors (0: in the driver; None: spare CPUs)
    envs_per_runner: int = 8  # envs each runner steps together (one batched policy call)
    train_batch: int = 500  # env steps per iteration
    minibatch: int = 125  # SGD minibatch size
    epochs: int = 4  # SGD passes over each batch
    lr: float = 3e-3
    entropy_coeff: float = 0.005
    gamma: float = 1.0  # discount (the only reward is the last)
    lambda_: float = 0.95  # GAE lambda
    clip_param: float = 0.2  # PPO's ratio clip
    hidden: tuple[int, ...] = (128, 128)  # policy / value MLP sizes
    microbatches: int | None = None  # fixed microbatch count (None: problem's, else chosen)
    max_replicas: int | None = None  # devices per stage at most (None: every device)
    actions: str = STAGES  # the env's action space: "stages" or "layers" (envs.mdp)
    stage_sizes: bool = True  # stages choose their own microbatch sizes (stages, >1 count)
    exploring_starts: float = 0.5  # episodes that start after a few random actions
    elite_starts: float = 0.5  # episodes that start from a prefix of an elite episode
    elite_mutations: float = 0.5  # elite starts whose last action becomes another of its kind
    elites: int = 4  # the best distinct episodes elite starts draw from
    restart_after: int | None = 60  # iterations without a better plan before starting over
    slot_scores: bool | None = None  # shared scorers for end slots and sizes (None: stages)
    twin_opens: bool | None = None  # open on a device and its free twins at once (None: stages)
    polish_evaluations: int = 0  # local search from PPO's best plan (0: PPO's plan as is)
    checkpoint: str | None = None  # save the trained algorithm here at the end
    restore: str | None = None  # restore an algorithm saved by `checkpoint` before training
    checkpoint_dir: str | None = None  # checkpoint the search here (and go on from one there)
    checkpoint_every: int | None = None  # iterations between checkpoints (None: 10)
    resume: str | None = None  # continue the search checkpointed in this folder

    def __post_init__(self) -> None:
        for key in (
            "iterations",
            "train_batch",
            "minibatch",
            "epochs",
            "envs_per_runner",
            "elites",
        ):
            if getattr(self, key) < 1:
                raise ProblemError(f"ppo.{key}: must be >= 1, got {getattr(self, key)}")
        if self.num_env_runners is not None and self.num_env_runners < 0:
            raise ProblemError(f"ppo.num_env_runners: must be >= 0, got {self.num_env_runners}")
        if self.restart_after is not None and self.restart_after < 1:
            raise ProblemError(f"ppo.restart_after: must be >= 1, got {self.restart_after}")
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
        for key in ("exploring_starts", "elite_starts", "elite_mutations"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ProblemError(f"ppo.{key}: must be in [0, 1], got {getattr(self, key)}")
        if not isinstance(self.stage_sizes, bool):
            raise ProblemError(f"ppo.stage_sizes: must be true or false, got {self.stage_sizes!r}")
        for key in ("slot_scores", "twin_opens"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), bool):
                raise ProblemError(
                    f"ppo.{key}: must be true, false or unset, got {getattr(self, key)!r}"
                )
            if getattr(self, key) and self.actions != STAGES:
                raise ProblemError(
                    f"ppo.{key}: needs the {STAGES!r} actions, got actions {self.actions!r}"
                )
        if self.actions not in ACTION_SPACES:
            raise ProblemError(
                f"ppo.actions: unknown {self.actions!r} (one of {', '.join(ACTION_SPACES)})"
            )
        check_checkpoint_options("ppo", self.checkpoint_dir, self.checkpoint_every, self.resume)
        if self.resume is not None and self.restore is not None:
            raise ProblemError(
                f"ppo.resume: {self.resume!r} goes on with a search; restore "
                f"{self.restore!r} starts one from an algorithm: give one of them"
            )

    @property
    def uses_slot_scores(self) -> bool:
        """``slot_scores``, or when unset: with the ``stages`` actions, whose slots it scores."""
        return self.actions == STAGES if self.slot_scores is None else self.slot_scores

    @property
    def uses_twin_opens(self) -> bool:
        """``twin_opens``, or when unset: with the ``stages`` actions, which have them."""
        return self.actions == STAGES if self.twin_opens is None else self.twin_opens


def env_config(
    problem: Problem,
    microbatches: int | None,
    max_replicas: int | None = None,
    actions: str = STAGES,
    exploring_starts: float = 0.0,
    stage_sizes: bool = False,
    elite_starts: float = 0.0,
    twin_opens: bool = False,
    elite_mutations: float = 0.0,
) -> dict[str, Any]:
    """The env's config; ``microbatches`` None: the episode chooses among the problem's;
    ``stage_sizes``: each stage chooses its own size too, where the env allows it (``stages``
    actions, several counts)."""
    n_dev = len(problem.cluster.device_ids)
    counts = microbatches or [problem.global_batch // b for b in problem.microbatch_sizes()]
    several = isinstance(counts, list) and len(counts) > 1
    return {
        "profile": problem.profile,
        "cluster": problem.cluster,
        "objective": problem.objective.value,
        "global_batch": problem.global_batch,
        "microbatches": counts,
        "schedule": problem.schedule.value,
        "min_throughput": problem.min_throughput,
        "max_replicas": min(max_replicas or n_dev, n_dev),
        "actions": actions,
        "exploring_starts": exploring_starts,
        "elite_starts": elite_starts,
        "stage_sizes": stage_sizes and actions == STAGES and several,
        "twin_opens": twin_opens,
        "elite_mutations": elite_mutations,
    }


def default_env_runners(available_cpus: float, train_batch: int) -> int:
    """PPO's env runners when the option leaves them open: the cluster's spare CPUs
    (``available_cpus`` less :data:`DRIVER_CPUS`, rounded down; 0 when none are spare), at
    most ``train_batch // MIN_STEPS_PER_RUNNER`` (module docstring)."""
    if available_cpus < 0 or train_batch < 1:
        raise ProblemError(
            f"ppo: available CPUs must be >= 0 and train_batch >= 1, got {available_cpus} "
            f"and {train_batch}"
        )
    spare = max(0, math.floor(available_cpus - DRIVER_CPUS))
    return min(spare, train_batch // MIN_STEPS_PER_RUNNER)


def env_runners(options: PPOOptions) -> int:
    """The env runners PPO starts on the connected cluster: the option's, else
    :func:`default_env_runners` of Ray's available CPUs now."""
    if options.num_env_runners is not None:
        return options.num_env_runners
    available = float(ray.available_resources().get("CPU", 0.0))
    return default_env_runners(available, options.train_batch)


def _microbatches(problem: Problem, option: int | None) -> int | None:
    """The fixed microbatch count (the problem's, else the option's), or None: chosen."""
    if problem.microbatches is not None:
        return problem.microbatches
    if option is not None and problem.global_batch % option:
        raise ProblemError(
            f"ppo.microbatches: {option} does not divide global_batch {problem.global_batch}"
        )
    return option


Elite = tuple[float, dict[str, Any], tuple[int, ...]]
"""A feasible episode: its value, its plan (as a dict) and its actions (start included)."""


def best_distinct(elites: Sequence[Elite], size: int) -> list[Elite]:
    """The ``size`` best of ``elites``, one per plan (ties: the first). Episodes that differ
    only in decisions the plan does not keep (the shared microbatch count when every stage
    chooses its own size, an exploring start's order) are one plan: keeping them all would
    fill the elite with one plan."""
    seen: dict[str, Elite] = {}
    for e in sorted(elites, key=lambda e: e[0]):
        seen.setdefault(json.dumps(e[1], sort_keys=True), e)
    return list(seen.values())[:size]


class BestPlan(RLlibCallback):  # type: ignore[misc]
    """Keeps, on each env runner, the best distinct episodes its envs produced
    (:data:`RUNNER_ELITES` of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.elites: list[Elite] = []
        self.episodes = 0

    def on_episode_end(self, *, episode: Any, **kwargs: Any) -> None:
        info = episode.get_infos(-1)
        self.episodes += 1
        value = float(info.get("value", np.inf))
        if np.isfinite(value) and (len(self.elites) < RUNNER_ELITES or value < self.elites[-1][0]):
            entry = (value, info["plan"].to_dict(), tuple(info["actions"]))
            self.elites = best_distinct([*self.elites, entry], RUNNER_ELITES)


def _gather(algo: Any) -> tuple[int, list[Elite]]:
    """(episodes so far, the elites of every runner) across all env runners."""

    def read(runner: Any) -> tuple[int, list[Elite]]:
        cbs = [c for c in runner._callbacks if isinstance(c, BestPlan)]
        return sum(c.episodes for c in cbs), [e for c in cbs for e in c.elites]

    results = algo.env_runner_group.foreach_env_runner(read, local_env_runner=True)
    episodes = sum(r[0] for r in results)
    return episodes, [e for r in results for e in r[1]]


def _share_elites(algo: Any, profile: str, elites: list[Elite]) -> None:
    """Give every env of every runner the ``elites``' actions to start from."""
    payload = {profile: [e[2] for e in elites]}

    def give(runner: Any) -> None:
        if runner.env is not None:  # the driver's runner has none when others sample
            runner.env.unwrapped.call("set_elites", payload)

    algo.env_runner_group.foreach_env_runner(give, local_env_runner=True)


class Restart:
    """The algorithm's initial policy and optimizer, taken when it is built, to start learning
    over from (the ``restart_after`` option, as TAPP's): the learner gets both back, every
    env runner the initial policy, whatever weights it holds (sequence number 0 always
    loads), and the runners and their envs forget their elites (as TAPP's restart forgets
    its elite: a fresh policy starting from the old elites' prefixes learns their basin again
    at once). The search keeps the best plan found."""

    def __init__(self, algo: Any) -> None:
        learner = f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}"
        self.learner = algo.learner_group.get_state(
            components=[learner, f"{COMPONENT_LEARNER}/{COMPONENT_OPTIMIZER}"]
        )
        sampler = algo.learner_group.get_state(components=[learner], inference_only=True)
        self.sampler = {
            COMPONENT_RL_MODULE: sampler[COMPONENT_LEARNER][COMPONENT_RL_MODULE],
            WEIGHTS_SEQ_NO: 0,
        }

    def __call__(self, algo: Any) -> None:
        algo.learner_group.set_state(self.learner)
        weights = self.sampler

        def load(runner: Any) -> None:
            if runner.module is not None:  # the driver's runner has none when others sample
                runner.set_state(weights)
            for callback in runner._callbacks:
                if isinstance(callback, BestPlan):
                    callback.elites = []
            if runner.env is not None:
                runner.env.unwrapped.call("set_elites", {})

        algo.env_runner_group.foreach_env_runner(load, local_env_runner=True)


SLOT_HIDDEN = 32
"""Hidden units of the slot scorers (:class:`SlotScoringModule`)."""


class SlotScoringModule(ActionMaskingTorchRLModule):  # type: ignore[misc]
    """RLlib's action-masking PPO module, plus a score for every action that has a row of
    its own in the observation (the env's slot groups, :func:`envs.mdp.slot_groups`: the
    ``stages`` end slots, the ``stage_sizes`` sizes), added to that action's logit.

    A plain MLP head gives each of ResNet-50's 174 end slots its own output weights, so what
    it learns about ending a stage where the share is balanced holds for one slot only. A
    scorer is one small MLP per group, shared by the group's actions, of the action's row
    and the observation's global features: a pointer-network-style head, as TAPP's attention
    over devices scores every device with one function. Its last layer starts at zero, so a
    new policy is the MLP's. ``model_config`` holds ``slot_groups`` (``[obs_offset,
    features, action_offset, count]`` each) and ``slot_context`` (``[offset, size]`` of the
    global features)."""

    def setup(self) -> None:
        super().setup()
        config = self.model_config
        if not isinstance(config, dict) or "slot_groups" not in config:
            raise PipeplanError(
                "SlotScoringModule: model_config needs slot_groups and slot_context "
                f"(slot_model_config), got {config!r}"
            )
        self.slot_layout = [tuple(int(x) for x in g) for g in config["slot_groups"]]
        self.slot_context = tuple(int(x) for x in config["slot_context"])
        scorers = []
        for _, features, _, _ in self.slot_layout:
            out = torch.nn.Linear(SLOT_HIDDEN, 1)
            torch.nn.init.zeros_(out.weight)
            torch.nn.init.zeros_(out.bias)
            layers = [torch.nn.Linear(features + self.slot_context[1], SLOT_HIDDEN)]
            scorers.append(torch.nn.Sequential(*layers, torch.nn.Tanh(), out))
        self.slot_scorers = torch.nn.ModuleList(scorers)

    def _forward_inference(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return self._scored(batch, super()._forward_inference(batch, **kwargs))

    def _forward_exploration(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return self._scored(batch, super()._forward_exploration(batch, **kwargs))

    def _forward_train(self, batch: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return self._scored(batch, super()._forward_train(batch, **kwargs))

    def _scored(self, batch: dict[str, Any], outs: dict[str, Any]) -> dict[str, Any]:
        """``outs`` with every slot action's score added to its (masked) logit."""
        obs = batch[Columns.OBS]  # the parent's forward replaced the dict by its observations
        obs = obs["observations"] if isinstance(obs, dict) else obs
        at, size = self.slot_context
        context = obs[:, at : at + size]
        logits = outs[Columns.ACTION_DIST_INPUTS]
        for (obs_at, features, act_at, count), scorer in zip(
            self.slot_layout, self.slot_scorers, strict=True
        ):
            rows = obs[:, obs_at : obs_at + features * count].reshape(-1, count, features)
            both = torch.cat([rows, context[:, None, :].expand(-1, count, -1)], dim=-1)
            score = scorer(both).squeeze(-1)  # (B, count)
            pad = (act_at, logits.shape[-1] - act_at - count)
            logits = logits + torch.nn.functional.pad(score, pad)
        outs[Columns.ACTION_DIST_INPUTS] = logits
        return outs


def slot_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """:class:`SlotScoringModule`'s ``model_config`` keys for the env of ``config``."""
    inst = instances_from_config(config)[0]
    groups = [[g.obs_offset, g.features, g.action_offset, g.count] for g in slot_groups(inst)]
    return {"slot_groups": groups, "slot_context": [global_offset(inst), GLOBAL_FEATURES]}


SEARCH_STATE = CHECKPOINT_FILES["ppo"]
"""The file of a PPO search checkpoint that names its algorithm's folder (module
:class:`PPOCheckpoints`)."""
SEARCH_FORMAT = "pipeplan/ppo-search"
ALGORITHM_PREFIX = "algorithm-"


@dataclass
class PPOProgress:
    """The loop's counters: iterations done, the best elite value the runners found, and
    iterations since it improved (``restart_after``)."""

    iteration: int = 0
    best: float = math.inf
    stale: int = 0


class PPOCheckpoints:
    """A PPO search's checkpoints in ``folder``: RLlib's own checkpoint of the algorithm
    (``Algorithm.save_to_path``, its policy, optimizer and counters) in a folder
    ``algorithm-NNNNNN`` per checkpoint, and :data:`SEARCH_STATE` beside it, written
    atomically last: it names the algorithm's folder and holds the search (evaluations, best
    plan, history), the loop's counters and the elites, so a search killed while RLlib
    writes goes on from the previous checkpoint. Older algorithm folders are removed once
    the new state is written."""

    def __init__(self, folder: Path, fingerprint: dict[str, Any]) -> None:
        self.folder, self.fingerprint = folder, fingerprint

    def save(self, algo: Any, search: Search, progress: PPOProgress, elites: list[Elite]) -> None:
        name = f"{ALGORITHM_PREFIX}{progress.iteration:06d}"
        target = self.folder / name
        if target.exists():  # a run cut while it wrote this one: write it again
            shutil.rmtree(target)
        algo.save_to_path(str(target.resolve()))
        write_json_atomic(
            self.folder / SEARCH_STATE,
            {
                "format": SEARCH_FORMAT,
                "fingerprint": self.fingerprint,
                "algorithm": name,
                "iteration": progress.iteration,
                "best": progress.best,
                "stale": progress.stale,
                "elites": [[v, plan, list(actions)] for v, plan, actions in elites],
                "search": search.state_dict(),
            },
        )
        for old in self.folder.glob(f"{ALGORITHM_PREFIX}*"):
            if old.name != name and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load(folder: Path, expected: dict[str, Any]) -> dict[str, Any]:
        """The search state in ``folder``, checked to be PPO's and of this search."""
        doc = read_json(folder / SEARCH_STATE, "ppo.resume")
        if doc.get("format") != SEARCH_FORMAT:
            raise ProblemError(f"ppo.resume: {folder / SEARCH_STATE}: not a PPO checkpoint")
        check_fingerprint("ppo", folder, doc["fingerprint"], expected)
        if not (folder / str(doc["algorithm"])).is_dir():
            raise ProblemError(
                f"ppo.resume: {folder}: the algorithm's checkpoint {doc['algorithm']} is missing"
            )
        return doc


class PPOPlanner(Planner):
    name = "ppo"
    Config = PPOOptions
    needs_ray = True
    config: PPOOptions

    def search(self, problem: Problem, search: Search) -> None:
        if not ray.is_initialized():
            raise PipeplanError(
                "ppo: needs a connected Ray cluster (RLlib's env runners run on it); start or "
                "connect one first (executor.runtime.start_local / connect)"
            )
        c = self.config
        fp = fingerprint(problem, self.name, self.options)
        folder = resume_folder(self.name, c.checkpoint_dir, c.resume, SEARCH_STATE)
        resumed = None if folder is None else PPOCheckpoints.load(folder, fp)
        writer = None if c.checkpoint_dir is None else PPOCheckpoints(Path(c.checkpoint_dir), fp)
        m = _microbatches(problem, c.microbatches)
        runners = env_runners(c)
        search.options["num_env_runners"] = runners  # the result says how many it took
        if at_scale(problem):
            env, seeds = kind_env_config(problem, search, c.elite_starts)
            algo = self._build_kinds(problem, env, runners)
        else:
            algo, seeds = self._build(problem, m, runners), []
        try:
            if seeds and resumed is None:  # balanced splits to start episodes from
                _share_elites(algo, problem.profile.name, [(math.inf, {}, a) for a in seeds])
            restart = Restart(algo) if c.restart_after is not None else None
            progress = PPOProgress()
            if folder is not None and resumed is not None:
                progress = self._resume(algo, search, folder, resumed, problem.profile.name)
            elif c.restore:
                algo.restore_from_path(str(Path(c.restore).resolve()))
                restart = Restart(algo) if restart is not None else None
            self._train(algo, search, problem.profile.name, restart, progress, writer)
        finally:
            algo.stop()

    def _resume(
        self, algo: Any, search: Search, folder: Path, doc: dict[str, Any], profile: str
    ) -> PPOProgress:
        """Load the checkpoint ``doc`` of ``folder``: the algorithm, the search, the
        counters, and the elites given back to the env runners."""
        algo.restore_from_path(str((folder / str(doc["algorithm"])).resolve()))
        search.load_state_dict(doc["search"])
        search.options["resumed_from"] = str(folder)
        elites: list[Elite] = [(float(v), p, tuple(a)) for v, p, a in doc["elites"]]
        if elites and self.config.elite_starts > 0:
            _share_elites(algo, profile, elites)
        return PPOProgress(int(doc["iteration"]), float(doc["best"]), int(doc["stale"]))

    def _build_kinds(self, problem: Problem, env: dict[str, Any], runners: int) -> Any:
        """PPO on :class:`envs.kind_env.KindPlacementEnv` with RLlib's action-masking
        module (no slot scorers: an episode has few, short decisions)."""
        model = {"head_fcnet_hiddens": list(self.config.hidden)}
        model["fcnet_hiddens"] = list(self.config.hidden)
        spec = RLModuleSpec(module_class=ActionMaskingTorchRLModule, model_config=model)
        return self._algorithm(problem, KindPlacementEnv, env, spec, runners)

    def _build(self, problem: Problem, microbatches: int | None, runners: int) -> Any:
        c = self.config
        env = env_config(
            problem,
            microbatches,
            c.max_replicas,
            c.actions,
            c.exploring_starts,
            c.stage_sizes,
            c.elite_starts,
            c.uses_twin_opens,
            c.elite_mutations,
        )
        model: dict[str, Any] = {
            "head_fcnet_hiddens": list(c.hidden),
            "fcnet_hiddens": list(c.hidden),
        }
        module: type = ActionMaskingTorchRLModule
        if c.uses_slot_scores:
            module = SlotScoringModule
            model.update(slot_model_config(env))
        spec = RLModuleSpec(module_class=module, model_config=model)
        return self._algorithm(problem, PlacementEnv, env, spec, runners)

    def _algorithm(
        self, problem: Problem, env_class: type, env: dict[str, Any], spec: Any, runners: int
    ) -> Any:
        """RLlib's PPO on ``env_class`` built from ``env``, with the module ``spec``."""
        c = self.config
        config = (
            PPOConfig()
            .environment(env_class, env_config=env)
            .env_runners(num_env_runners=runners, num_envs_per_env_runner=c.envs_per_runner)
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
            .rl_module(rl_module_spec=spec)
            .callbacks(BestPlan)
            .debugging(seed=problem.seed, log_level="ERROR")
        )
        if c.restore and not Path(c.restore).exists():
            raise ProblemError(f"ppo.restore: no checkpoint at {c.restore}")
        return config.build_algo()

    def _train(
        self,
        algo: Any,
        search: Search,
        profile: str,
        restart: Restart | None,
        progress: PPOProgress,
        writer: PPOCheckpoints | None,
    ) -> None:
        c = self.config
        counted, first = 0, progress.iteration
        elites: list[Elite] = []
        interval = every(c.checkpoint_dir, c.checkpoint_every)
        while progress.iteration < c.iterations and not search.exhausted():
            if restart is not None and progress.stale >= (c.restart_after or 0):
                restart(algo)
                progress.stale = 0
            algo.train()
            progress.iteration += 1
            episodes, found = _gather(algo)
            if search.reward.name in COST_MODEL_SOURCES:
                search.record([], np.zeros(0), evaluations=episodes - counted)
            counted = episodes
            elites = best_distinct(found, c.elites)
            if elites and elites[0][0] < progress.best:
                progress.best, progress.stale = elites[0][0], 0
            else:
                progress.stale += 1
            if elites:
                search.evaluate_plans([Plan.from_dict(elites[0][1])])
                if c.elite_starts > 0:
                    _share_elites(algo, profile, elites)
            if writer is not None and interval is not None and progress.iteration % interval == 0:
                writer.save(algo, search, progress, elites)
        done = progress.iteration > first
        if writer is not None and interval is not None and done and progress.iteration % interval:
            writer.save(algo, search, progress, elites)  # where the search ended
        if self.config.checkpoint:
            algo.save_to_path(str(Path(self.config.checkpoint).resolve()))
        if search.best_plan is not None and self.config.polish_evaluations > 0:
            polish(search, self.config.polish_evaluations)
