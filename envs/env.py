"""The gymnasium shell of the placement MDP (:mod:`envs.mdp`): spaces, ``reset`` and
``step`` over the pure functions, nothing else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from pipeplan.envs.config import instances_from_config
from pipeplan.envs.mdp import (
    action_mask,
    elite_start,
    exploring_start,
    initial_state,
    is_terminal,
    observation_size,
    observe,
    reward,
    to_plan,
    transition,
)
from pipeplan.envs.shell import MDP, MaskedShell


class PlacementEnv(MaskedShell):
    """Place a model's layers, one per step, into pipeline stages on a heterogeneous cluster.

    ## Description

    TAPP's task allocation as an MDP (DESIGN.md, "TAPP planner and the MDP"). When the config
    offers several microbatch counts, the first step chooses one. Then step ``i`` decides
    layer ``i`` of the profile (layers in topological order): keep it in the stage that holds
    layer ``i-1``, or open a new stage for it on an unused device. Right after a stage is
    opened (it holds one layer), a step may instead add an unused device to it as a replica
    (``max_replicas > 1``); such a step places no layer. At the end the stages form a
    :class:`core.plan.Plan` (equal microbatches of ``global_batch / M`` samples, or with
    ``stage_sizes`` each stage's own) that the contract cost model costs.

    ## Action Space

    ``Discrete(1 + D + R + K)`` for a cluster of ``D`` devices (``cluster.device_ids``
    order), ``R = D`` when ``max_replicas > 1`` else 0, ``K`` the microbatch counts offered
    (0 when there is one):

    - ``0``: keep layer ``i`` in the open stage; once every layer is placed and the last
      stage could still take a replica, ``0`` ends the episode;
    - ``1 .. D``: open a new stage for layer ``i`` on device ``d - 1``;
    - ``D + 1 .. 2 D``: add device ``d - D - 1`` to the open stage as a replica;
    - ``1 + D + R + k``: choose the ``k``-th microbatch count (first step only).

    The ``action_mask`` forbids: anything but a microbatch count on the first step when
    choosing (and microbatch counts afterwards), staying at layer 0 (a stage must be
    opened), staying when the layers left are just enough for the stages ``min_stages``
    still needs, devices already used, opening beyond ``max_stages``, replicas except right
    after the open stage was opened, beyond ``max_replicas`` or when the devices left are
    needed for ``min_stages``, and actions whose stage would not fit its devices' memory
    (unless no action fits). A masked action is replaced by the first allowed one and
    ``info["repaired"]`` is set.

    With ``actions: stages`` the stages are built a stage at a time instead:
    ``Discrete(D + R + S + K)`` (``S`` end slots: the layers of the longest profile):

    - ``0 .. D-1``: open a stage on device ``d`` at the first unplaced layer;
    - ``D .. D+R-1``: add device ``d - D`` to the open stage as a replica (before its end);
    - ``D + R + k``: end the open stage after layer ``k`` (it holds layers ``start..k``);
      the episode ends when a stage ends at the last layer;
    - ``D + R + S + k``: choose the ``k``-th microbatch count (first step only).

    With ``twin_opens`` (``stages`` only) ``D`` more actions follow the opens,
    ``Discrete(2 D + R + S + K)``: ``D + d`` opens a stage on device ``d`` together with its
    free twins (the unused devices of its type on its node, in the cluster's order, up to
    ``max_replicas`` devices in all) as replicas, one step for an open and its replica steps;
    the mask allows it where ``d`` has a free twin and enough devices stay free for the stages
    ``min_stages`` still needs, and the stage's one-layer share fits all of them.

    The mask forbids opening while a stage's end is pending, used devices, replicas beyond
    ``max_replicas`` or needed by ``min_stages``, ends that leave fewer layers or free devices
    than the stages ``min_stages`` still needs, ends before the last layer once
    ``max_stages`` stages are open or no device is free, and ends whose stage would not fit
    its devices' memory (unless nothing fits).

    With ``stage_sizes`` (``stages`` and ``K > 1`` only) each stage gets its own microbatch
    size: ``Discrete(D + R + S + 2 K)``, where ``D + R + S + K + k`` gives the stage just
    ended microbatches of ``global_batch // counts[k]`` samples. The first step still
    chooses the shared count (the end features and the memory masks are priced at its
    size); after every end the mask allows only the size actions, less those whose stage
    would not fit its devices' memory (rule 9 at that size; unless none fits).

    ## Observation Space

    ``Dict(observations=Box(-1, 1, (32 (1 + lookahead) + 5 D + 10,)), action_mask=Box(0, 1,
    (1 + D + R + K,)))``, float32, as RLlib's action-masking modules expect (``stages``:
    ``3 S`` more observations, ``stage_sizes``: ``4 K`` more; the mask as wide as the action
    space).
    ``observations`` holds the TAPP encoding (:mod:`envs.encoding`) of layer ``i`` and the
    next ``lookahead`` layers (zero rows past the end), per device its speed (FLOP/s over
    the fastest), memory left (fraction), whether the remaining layers would fit in that
    memory (ratio, capped at 1), the used flag and whether it holds the open stage; then
    progress ``i / L``, layers left, stages opened ``/ D``, the open stage's size ``/ L``,
    FLOP share, load ``t / (t + T / D)`` (``t`` its microbatch time on its slowest replica,
    ``T`` the whole model's on the fastest device) and replicas ``/ D``, the worst load of
    the closed stages, the microbatch size ``log b / log B`` and whether the step chooses
    the microbatch count. With ``actions: stages`` three features per end slot follow
    (:func:`envs.mdp.end_features`): while a stage's end is chosen, ending it after layer
    ``k`` gives the stage the load ``t / (t + T / D)``, the share ``t / (t + r)`` against
    ``r``, the rest of the model spread over the free devices (0.5: balanced with them), and
    the cut's transfer against ``T / D``. With ``stage_sizes`` four features per allowed
    size follow (:func:`envs.mdp.size_features`, zeros unless a size is chosen): the
    stage's busy time over the whole batch (compute plus rule 2b's gradient accumulation,
    slowest replica) at its best size over that at this size, whether it is the shared
    size, ``log b / log B``, and that busy time's load against the whole model's.

    ## Rewards

    0 on every step but the last. The last is ``reference / value`` where ``value`` is the
    objective value of the plan (batch time for ``time``/``throughput``, $ per sample for
    ``cost``) and ``reference`` that of the whole batch computed at once on the best single
    device without communication or update; ``infeasible_reward`` (default 0) when the plan
    does not fit in memory or misses ``min_throughput``.

    ## Starting State

    No layer placed, no microbatch count chosen (unless fixed). With several profiles,
    ``reset`` picks one uniformly with ``self.np_random``. With ``exploring_starts: p``, an
    episode starts with probability ``p`` after ``1..start_steps`` random legal actions, each
    of a kind drawn first (open, twin open, replica, end, count, size: a replica as often as
    an end however many ends there are; :func:`envs.mdp.exploring_start`), drawn with
    ``self.np_random`` too. With
    ``elite_starts: q`` and elites given to :meth:`set_elites` (action sequences of earlier
    episodes, per profile name: a planner gives its best), an episode starts with
    probability ``q`` from a random proper prefix of a random elite
    (:func:`envs.mdp.elite_start`: Go-Explore's return to a promising state).

    ## Episode End

    Terminates when every layer is placed and the last stage takes no replica (none allowed,
    or the agent chose ``0``; ``stages``: its end is chosen, and with ``stage_sizes`` its
    size); ``info`` then holds ``plan``, ``estimate``
    (:class:`core.costmodel.Estimate`), ``value``, ``feasible`` and ``actions`` (every action of
    the episode, its start's included: what :meth:`set_elites` takes). Never truncated.

    ## Arguments

    ``config`` (a dict): ``profile`` (a ModelProfile, a path to a profile JSON, or a list of
    either), ``cluster`` (a ClusterSpec or a path), and the options of
    :class:`envs.config.EnvOptions` (their defaults there): ``objective`` (``time`` |
    ``throughput`` | ``cost``), ``global_batch``, ``microbatches`` (the count M; a list of
    counts, or None for every divisor of ``global_batch``: the first step chooses),
    ``schedule``, ``min_throughput`` (cost objective), ``min_stages``, ``max_stages`` (None =
    D), ``max_replicas`` (1: no replica actions), ``lookahead``, ``infeasible_reward``,
    ``actions`` (``layers``, the default, or ``stages``), ``exploring_starts``,
    ``start_steps``, ``elite_starts`` (default 0), ``stage_sizes`` (default False),
    ``twin_opens`` (default False). A bad key
    or value raises :class:`envs.config.EnvConfigError` naming it.
    """

    metadata: dict[str, Any] = {"render_modes": []}
    mdp = MDP(action_mask, observe, is_terminal, transition, to_plan, reward)
    action_space: spaces.Discrete
    observation_space: spaces.Dict

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.instances = instances_from_config(dict(config or {}))
        first = self.instances[0]
        n = first.n_actions
        self.action_space = spaces.Discrete(n)
        self.observation_space = spaces.Dict(
            {
                "observations": spaces.Box(-1.0, 1.0, (observation_size(first),), np.float32),
                "action_mask": spaces.Box(0.0, 1.0, (n,), np.float32),
            }
        )
        self.instance = first
        self.state = initial_state(first)
        self.actions: list[int] = []  # this episode's, its start's included
        self.elites: dict[str, tuple[tuple[int, ...], ...]] = {}
        self.mask = action_mask(first, self.state)

    def set_elites(self, elites: Mapping[str, Sequence[Sequence[int]]]) -> None:
        """The episodes (their ``info["actions"]``, per profile name) whose prefixes elite
        starts replay; replaces the previous ones."""
        self.elites = {
            str(name): tuple(tuple(int(a) for a in seq) for seq in seqs)
            for name, seqs in elites.items()
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        k = int(self.np_random.integers(len(self.instances))) if len(self.instances) > 1 else 0
        self.instance = self.instances[k]
        rng, elites = self.np_random, self.elites.get(self.instance.profile.name, ())
        if elites and self.instance.elite_starts > 0 and rng.random() < self.instance.elite_starts:
            self.state, start = elite_start(self.instance, elites[rng.integers(len(elites))], rng)
        else:
            self.state, start = exploring_start(self.instance, rng)
        self.actions = list(start)
        return self._obs(), {"profile": self.instance.profile.name}
