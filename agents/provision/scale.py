"""Planning by kinds and counts on a large owned cluster: when the learned planners do, the
balanced kind-level splits they start from, and the kind-level MDP's config and actions.

A cluster given with counts (``count: N``, DESIGN.md) has interchangeable nodes; under the
time and throughput objectives ``tapp`` and ``ppo`` then search the kind-level space of
:mod:`agents.provision.kinds` (:func:`at_scale`). This module holds what both need without
torch or Ray: feasible starting plans (:func:`balanced_seeds`) and, for ``ppo``, the config
of :class:`envs.kind_env.KindPlacementEnv` and a kind-level plan as that MDP's actions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

import numpy as np

from pipeplan.agents.baselines.genetic import GeneticConfig
from pipeplan.agents.problem import Objective, Problem
from pipeplan.agents.provision.genetic_kinds import KindGenetic, KindPlan
from pipeplan.agents.provision.kinds import Catalogue
from pipeplan.agents.search import Search

Actions = tuple[int, ...]
MAX_MICROBATCHES = 64
"""Microbatch sizes searched at scale: those that split the batch into at most this many
microbatches. Twice the catalogue searches' cap: a pipeline of a dozen stages or more over
hundreds of devices pays its fill and drain ``(S - 1) / M`` in full, and on gpt-13b x dc-328
the best kind-level plan found takes 64 microbatches (32 at most left it 13% slower)."""


def at_scale(problem: Problem) -> bool:
    """Whether ``tapp`` searches kinds and counts for the batch time: under the time or
    throughput objective on a cluster with at least one node entry given with ``count``
    (its nodes are interchangeable; the cost objective on such a catalogue is the
    provisioning TAPP's)."""
    return problem.objective is not Objective.COST and any(
        n.kind is not None for n in problem.cluster.nodes
    )


BISECTIONS = 40
"""Halvings of the busy-time cap when a balanced split is sought."""


FIRST_MICROBATCHES = 32
"""The microbatch count whose balanced splits :func:`balanced_seeds` tries first."""


PPO_SEEDS = 8
"""Balanced splits ``ppo``'s episodes may start from (:func:`kind_env_config`)."""


def scale_space(problem: Problem, search: Search) -> KindGenetic:
    """The kind-level space of the catalogue searches with :data:`MAX_MICROBATCHES`."""
    space = KindGenetic(problem, search, GeneticConfig())
    space.sizes = sizes_at_scale(problem)
    return space


def sizes_at_scale(problem: Problem) -> list[int]:
    """The microbatch sizes of :func:`scale_space`, smallest first (the largest when none
    splits the batch into few enough microbatches)."""
    sizes = sorted(problem.microbatch_sizes())
    few = [b for b in sizes if problem.global_batch // b <= MAX_MICROBATCHES]
    return few or sizes[-1:]


def balanced_split(space: KindGenetic, b: int, order: Sequence[int]) -> KindPlan | None:
    """The kind-level plan that fills one node at a time, the nodes of each option of
    ``order`` after each other, each stage taking layers while its busy time on one node
    stays under a cap (memory included: :meth:`~agents.provision.kinds.StageCosts.busy` is
    ``inf`` where a stage does not fit), for the least cap (bisection) with which every
    layer is placed; its counts then chosen exactly (``recount``). None when no cap places
    every layer on the nodes there are. Memory is taken at the most stages there can be
    (1F1B holds more microbatches on earlier stages), so a split found fits."""
    costs, cat, L = space.costs(b), space.cat, space.L
    q = np.array([space.max_stages])
    tables: dict[tuple[int, int], np.ndarray] = {}

    def reach(i: int, o: int, cap: float) -> int:
        """Layers past ``i`` a stage on one node of option ``o`` takes under ``cap``."""
        if (i, o) not in tables:
            tables[i, o] = costs.busy(i, o, q)[:, 0, 0]
        return int(np.argmax(np.append(tables[i, o] > cap, True)))

    def split(cap: float) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        bounds, options, used = [0], [], [0] * len(cat.available)
        for o in order:
            kind = cat.options[o].kind
            while bounds[-1] < L and used[kind] < cat.available[kind]:
                n = reach(bounds[-1], o, cap)
                if n == 0:
                    break
                bounds.append(bounds[-1] + n)
                options.append(o)
                used[kind] += 1
        return (tuple(bounds), tuple(options)) if bounds[-1] == L else None

    lo, hi = 0.0, 1.0
    while split(hi) is None:
        hi *= 4
        if hi > 1e12:
            return None
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if split(mid) is not None else (mid, hi)
    got = split(hi)
    if got is None:
        return None
    bounds, options = got
    plan = space.recount(bounds, options, b)
    return plan if plan is not None else KindPlan(bounds, tuple((o, 1) for o in options), b)


def balanced_seeds(space: KindGenetic) -> Iterator[KindPlan]:
    """:func:`balanced_split` over the options by FLOP/s, by memory, and each option alone,
    each for every microbatch size, those nearest :data:`FIRST_MICROBATCHES` microbatches
    first (a caller short of time stops early with the likeliest ones); distinct plans."""
    types = space.problem.cluster.device_types
    opts = space.cat.options
    by_flops = sorted(range(len(opts)), key=lambda o: -types[opts[o].type].flops)
    by_memory = sorted(range(len(opts)), key=lambda o: -types[opts[o].type].memory_gb)
    orders = [by_flops, by_memory, *([o] for o in range(len(opts)))]
    B = space.problem.global_batch
    sizes = sorted(space.sizes, key=lambda b: abs(math.log(B / b / FIRST_MICROBATCHES)))
    seen: set[KindPlan] = set()
    for order in orders:
        for b in sizes:
            plan = balanced_split(space, b, order)
            if plan is not None and plan not in seen:
                seen.add(plan)
                yield plan


def kind_env_config(
    problem: Problem, search: Search, elite_starts: float
) -> tuple[dict[str, Any], list[Actions]]:
    """The config of :class:`envs.kind_env.KindPlacementEnv` for a problem at scale
    (:func:`at_scale`): the catalogue's options and nodes, and the
    microbatch sizes of the kind-level searches; and, as elites to start episodes from, the
    first :data:`PPO_SEEDS` balanced kind-level splits (:func:`balanced_seeds`) as action
    sequences (none without ``elite_starts``). The seeds are not evaluated: only PPO's own
    episodes are."""
    space = scale_space(problem, search)
    cat = space.cat
    config = {
        "profile": problem.profile,
        "cluster": problem.cluster,
        "options": [(o.type, o.kind) for o in cat.options],
        "kind_nodes": [[problem.cluster.nodes[i].name for i in nodes] for nodes in cat.nodes],
        "sizes": list(space.sizes),
        "objective": problem.objective.value,
        "global_batch": problem.global_batch,
        "schedule": problem.schedule.value,
        "min_throughput": problem.min_throughput,
        "elite_starts": elite_starts,
    }
    if elite_starts == 0:
        return config, []
    seeds = islice(balanced_seeds(space), PPO_SEEDS)
    return config, [kind_actions(space.sizes, cat, p) for p in seeds]


def kind_actions(sizes: Sequence[int], cat: Catalogue, plan: KindPlan) -> tuple[int, ...]:
    """A kind-level plan as the actions of :class:`envs.kind_env.KindPlacementEnv` that
    build it: its size (when there are several), then per stage option, nodes and end."""
    at_option = len(sizes)
    at_nodes = at_option + len(cat.options)
    at_end = at_nodes + max(cat.available)
    out = [sizes.index(plan.microbatch)] if len(sizes) > 1 else []
    for s, (o, m) in enumerate(plan.stages):
        out += [at_option + o, at_nodes + m - 1, at_end + plan.bounds[s + 1] - 1]
    return tuple(out)
