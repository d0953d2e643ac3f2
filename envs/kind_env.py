"""The gymnasium shell of the kind-level placement MDP (:mod:`envs.kinds`): spaces, ``reset``
and ``step`` over its pure functions, nothing else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from pipeplan.envs.config import EnvConfigError
from pipeplan.envs.kinds import (
    action_mask,
    initial_state,
    is_terminal,
    make_kind_instance,
    observation_size,
    observe,
    replay,
    reward,
    to_plan,
    transition,
)
from pipeplan.envs.shell import MDP, MaskedShell

KEYS = (
    "profile",
    "cluster",
    "options",
    "kind_nodes",
    "sizes",
    "objective",
    "global_batch",
    "schedule",
    "min_throughput",
    "max_stages",
    "elite_starts",
)


class KindPlacementEnv(MaskedShell):
    """Place a model's layers into pipeline stages on a cluster by node kinds and counts.

    ## Description

    The production-scale form of :class:`envs.env.PlacementEnv` (DESIGN.md, "At production
    scale"): on a cluster whose nodes are given with counts, an episode chooses the
    microbatch size (when several are offered), then for each stage an option (a device type
    on the nodes of one kind), how many of those nodes it takes (every device of the type on
    them runs the stage as a replica) and its last layer. Stages take the first free nodes
    of their kind; the plan is costed by the contract cost model at the end.

    ## Action Space

    ``Discrete(K + O + N + L)``: ``k < K`` chooses ``sizes[k]``; ``K + o`` opens a stage on
    option ``o``; ``K + O + n`` gives it ``n + 1`` nodes (``N``: the most nodes of a kind);
    ``K + O + N + j`` ends it after layer ``j``. The ``action_mask`` allows only the
    decision of the current phase, options of a kind with a free node (none once
    ``max_stages`` stages are open), at most the free nodes of the kind, ends at or after the
    stage's first layer, the last layer only when no node is free or ``max_stages`` is
    reached, and ends whose stage fits its devices' memory (unless none does). A masked
    action is replaced by the first allowed one and ``info["repaired"]`` is set.

    ## Observation Space

    ``Dict(observations=Box(-1, 1, (G + 3 O + 2 L,)), action_mask=Box(0, 1, (K + O + N +
    L,)))``, float32 (:func:`envs.kinds.observe`): the phase, progress, stages, size, the open
    stage's option and nodes, free nodes per kind; per option its FLOP/s, memory and free
    nodes; per end slot the open stage's load if it ends there and whether it fits.

    ## Rewards

    0 on every step but the last, then ``T / batch_time`` (``T``: the whole batch's compute
    on the whole cluster, a lower bound; 1 would reach it), 0 when the plan does not fit.

    ## Starting State

    Nothing decided. With ``elite_starts: q`` and elites given to :meth:`set_elites`, an
    episode starts with probability ``q`` from a random proper prefix of a random elite
    (drawn with ``self.np_random``).

    ## Episode End

    Terminates when a stage ends at the last layer; ``info`` then holds ``plan``,
    ``estimate``, ``value``, ``feasible`` and ``actions`` (every action of the episode).
    Never truncated.

    ## Arguments

    ``config`` (a dict): ``profile`` (a ModelProfile), ``cluster`` (a ClusterSpec),
    ``options`` (``[type, kind]`` pairs), ``kind_nodes`` (per kind, its node names in
    order), ``sizes`` (microbatch sizes offered), ``objective`` (``time`` or
    ``throughput``), ``global_batch``, ``schedule``, ``min_throughput``, ``max_stages``
    (None: every node), ``elite_starts`` (default 0). A bad key or value raises
    :class:`envs.config.EnvConfigError` naming it.
    """

    metadata: dict[str, Any] = {"render_modes": []}
    mdp = MDP(action_mask, observe, is_terminal, transition, to_plan, reward)
    action_space: spaces.Discrete
    observation_space: spaces.Dict

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = dict(config or {})
        unknown = sorted(set(config) - set(KEYS))
        if unknown:
            raise EnvConfigError(f"env config: unknown keys {unknown} (known: {', '.join(KEYS)})")
        self.elite_starts = float(config.pop("elite_starts", 0.0))
        if not 0.0 <= self.elite_starts <= 1.0:
            raise EnvConfigError(f"elite_starts: must be in [0, 1], got {self.elite_starts!r}")
        try:
            self.instance = make_kind_instance(
                config.pop("profile"),
                config.pop("cluster"),
                [(str(t), int(k)) for t, k in config.pop("options")],
                [list(n) for n in config.pop("kind_nodes")],
                [int(b) for b in config.pop("sizes")],
                **config,
            )
        except KeyError as e:
            raise EnvConfigError(f"env config: {e.args[0]} is required") from None
        except (ValueError, TypeError) as e:
            raise EnvConfigError(str(e)) from None
        n = self.instance.n_actions
        self.action_space = spaces.Discrete(n)
        size = observation_size(self.instance)
        self.observation_space = spaces.Dict(
            {
                "observations": spaces.Box(-1.0, 1.0, (size,), np.float32),
                "action_mask": spaces.Box(0.0, 1.0, (n,), np.float32),
            }
        )
        self.state = initial_state(self.instance)
        self.actions: list[int] = []
        self.elites: tuple[tuple[int, ...], ...] = ()
        self.mask = action_mask(self.instance, self.state)

    def set_elites(self, elites: Mapping[str, Sequence[Sequence[int]]]) -> None:
        """The episodes (their ``info["actions"]``, per profile name) whose prefixes elite
        starts replay; replaces the previous ones."""
        mine = elites.get(self.instance.profile.name, ())
        self.elites = tuple(tuple(int(a) for a in seq) for seq in mine)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        rng = self.np_random
        self.state, self.actions = initial_state(self.instance), []
        if self.elites and self.elite_starts > 0 and rng.random() < self.elite_starts:
            elite = self.elites[int(rng.integers(len(self.elites)))]
            steps = int(rng.integers(len(elite))) if len(elite) > 1 else 0
            self.state, taken = replay(self.instance, elite, steps)
            self.actions = list(taken)
            if is_terminal(self.instance, self.state):  # nothing left to decide: start over
                self.state, self.actions = initial_state(self.instance), []
        return self._obs(), {"profile": self.instance.profile.name}
