"""Plans of the ``genetic`` planner that fit in memory: seeds built to fit, and the repair
that keeps its children fitting.

At production scale (tens of layers of gigabytes, hundreds of devices) almost every random
genome is over some device's memory, and a search that starts from them spends its budget
ranking infeasible plans. Two kinds of seed fit by construction:

- **group splits** (:func:`group_split`): the devices are cut into groups -- each device
  class (one type on one node) whole, in halves, quarters, ... or one device each, the
  fastest types first -- and a min-max dynamic program chooses which groups serve as stages
  and where the stages' boundaries fall, so that each stage's weights, optimizer state and
  activations fit the memory of its group's devices (the cost model's rule 9, through
  :func:`~agents.baselines.genetic.balance.stage_fits`) at each microbatch size, a stage
  recomputing its activations where only that makes it fit (rule 9r);
- **greedy's plan** (:func:`greedy_seeds`): :func:`agents.baselines.greedy.climb` within a
  share of the budget, at every microbatch size.

:func:`repair_memory` keeps children within memory: a child over memory has its boundaries
re-balanced within memory, then gains replicas from the unused devices with the most memory,
then tries nearby microbatch sizes; one that still does not fit is replaced by a fitting
parent (already costed, so no evaluation is spent on it), unless the island has none. Every
step counts a stage as fitting when it fits with recomputation: a decoded plan recomputes
on exactly the stages that need it (:func:`~agents.baselines.genetic.context.with_recompute`),
the cheapest memory to win, since it costs one forward per microbatch and no device.
"""

from __future__ import annotations

import numpy as np

from pipeplan.agents.baselines.genetic.balance import (
    balanced_cuts,
    stage_cost,
    stage_fits,
)
from pipeplan.agents.baselines.genetic.context import Context, memory_ratio, with_recompute
from pipeplan.agents.baselines.genetic.genome import Genomes, IntArray, canonical, decode
from pipeplan.agents.baselines.greedy import climb
from pipeplan.core.schedules import microbatch_count

GREEDY_SHARE = 0.2
"""Share of the budget (seconds and evaluations) greedy's seed may take."""
GROUP_PARTS = (1, 2, 4, 8, 0, -2, -4)
"""Each device class is cut into this many groups (0: one group per device); -m: ``m``
classes of one type (on ``m`` nodes) make one group."""
GROUP_SHARE = 0.3
"""Share of a seconds budget the group splits may take."""
MAX_GROUPS_PER_LAYER = 4
"""Group cuts with more groups than this many per layer are not tried."""
REPLICA_STEPS = 8
"""Most replicas :func:`repair_memory` adds to one child."""
MICROBATCH_STEPS = 1
"""Microbatch-size steps (each way) :func:`repair_memory` tries."""


Layout = tuple[tuple[int, int], ...]
"""Device types in pipeline order, each with how its classes are cut (:data:`GROUP_PARTS`)."""


def groups_of(ctx: Context, layout: Layout) -> list[IntArray]:
    """The devices of the layout's types (in its order) as groups: each device class (one
    type on one node) cut into ``parts`` groups of near-equal size (0: a group per device;
    -m: ``m`` classes of the type, on ``m`` nodes, one group), the groups of one node next
    to each other so that their links stay inside the node."""
    tb = ctx.tables
    out: list[IntArray] = []
    for t, parts in layout:
        nodes = np.unique(tb.dev_node[tb.dev_type == t])
        classes = [np.flatnonzero((tb.dev_type == t) & (tb.dev_node == n)) for n in nodes]
        if parts < 0:
            out.extend(
                np.concatenate(classes[i : i - parts]) for i in range(0, len(classes), -parts)
            )
            continue
        for cls in classes:
            k = cls.size if parts == 0 else min(parts, cls.size)
            out.extend(np.array_split(cls, k))
    return out


def group_split(ctx: Context, groups: list[IntArray], k: int) -> Genomes | None:
    """One genome at microbatch size index ``k``: the groups that serve as stages, in order,
    and their boundaries, minimising the busiest resource (compute, update and all-reduce,
    or the next link) subject to every stage fitting its devices' memory; a min-max dynamic
    program in which a group may be skipped (its devices unused). None when nothing fits.

    1F1B's warm-up count is taken as if every later group were a stage (the most it can
    be), so a stage that fits here fits in the plan."""
    L, G, N = ctx.n_layers, len(groups), ctx.n_devices
    b = float(ctx.sizes[k])
    m = int(microbatch_count(ctx.problem.global_batch, int(ctx.sizes[k])))
    none = np.zeros(0, dtype=np.int64)
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    back = np.full((G, L + 1), -1, dtype=np.int64)  # -1: group skipped
    tb = ctx.tables
    tables: dict[tuple[bytes, int, int], tuple[np.ndarray, np.ndarray]] = {}
    for g, devs in enumerate(groups):
        # groups alike in types and node count cost alike (the next link is not known)
        warm = min(G - g - 1, m)
        key = (tb.dev_type[devs].tobytes(), np.unique(tb.dev_node[devs]).size, warm)
        if key not in tables:
            tables[key] = (stage_cost(ctx, devs, b, none, b), stage_fits(ctx, devs, b, warm))
        cost, fits = tables[key]
        worst = np.where(ctx.upper & fits, np.maximum(best[:, None], cost), np.inf)
        take = worst.min(0)
        use = take < best
        back[g] = np.where(use, worst.argmin(0), -1)
        best = np.where(use, take, best)
    if not np.isfinite(best[L]):
        return None
    stages: list[tuple[int, int]] = []  # (group, start layer), last stage first
    e = L
    for g in range(G - 1, -1, -1):
        if back[g, e] >= 0:
            stages.append((g, int(back[g, e])))
            e = int(back[g, e])
    stages.reverse()
    S = len(stages)
    assign = np.full((1, N), -1, dtype=np.int64)
    for s, (g, _) in enumerate(stages):
        assign[0, groups[g]] = s
    cuts = np.array([[a for _, a in stages[1:]]], dtype=np.int64).reshape(1, S - 1)
    mb = np.full((1, S), k, dtype=np.int64)
    return Genomes(cuts, canonical(assign, ctx.classes), mb)


def group_seeds(ctx: Context) -> list[Genomes]:
    """:func:`group_split` genomes, distinct, each a one-individual population (costed):
    for the fastest 1, 2, ... device types, every cut of the classes into groups
    (:data:`GROUP_PARTS`, the same for every type) at every microbatch size (one for all
    stages); then, from the best of those, one pass of coordinate descent that tries each
    type's cut on its own, and the next type added with each cut (with the neighbouring
    microbatch sizes too), keeping what lowers the objective. Cuts into more than
    :data:`MAX_GROUPS_PER_LAYER` groups per layer are left out (the split uses at most one
    group per layer; the rest only cost time), and the whole stops after
    :data:`GROUP_SHARE` of a seconds budget."""
    tb, types = ctx.tables, ctx.problem.cluster.device_types
    flops = [types[name].flops for name in tb.types]
    present = sorted({int(t) for t in tb.dev_type}, key=lambda t: (-flops[t], t))
    out: dict[bytes, Genomes] = {}
    best: tuple[float, Layout, int] = (np.inf, (), 0)
    search, seconds = ctx.search, ctx.problem.budget.seconds
    until = None if seconds is None else search.elapsed + GROUP_SHARE * seconds

    def over() -> bool:
        return search.exhausted() or (until is not None and search.elapsed >= until)

    def attempt(layout: Layout, k: int) -> None:
        nonlocal best
        groups = groups_of(ctx, layout)
        if len(groups) > MAX_GROUPS_PER_LAYER * ctx.n_layers:
            return
        g = group_split(ctx, groups, k)
        if g is None:
            return
        value = float(ctx.fitness(g)[0][0])
        out.setdefault(g.keys()[0], g)
        if value < best[0]:
            best = (value, layout, k)

    K = len(ctx.sizes)
    for n_types in range(1, len(present) + 1):
        for parts in GROUP_PARTS:
            for k in range(K):
                if over():
                    return list(out.values())
                attempt(tuple((t, parts) for t in present[:n_types]), k)
    if not np.isfinite(best[0]):
        return list(out.values())
    for pos in range(len(present)):
        _, layout, k = best
        if pos > len(layout):
            break
        for parts in GROUP_PARTS:
            if pos < len(layout) and parts == layout[pos][1]:
                continue
            changed = (*layout[:pos], (present[pos], parts), *layout[pos + 1 :])
            for step in (0, -1, 1):
                if over():
                    return list(out.values())
                if 0 <= k + step < K:
                    attempt(changed, k + step)
    return list(out.values())


def greedy_seeds(ctx: Context) -> Genomes | None:
    """Greedy's plan (:func:`agents.baselines.greedy.climb`, within :data:`GREEDY_SHARE` of
    the budget; its evaluations count against the search's) at every microbatch size."""
    search, budget = ctx.search, ctx.problem.budget
    seconds = None if budget.seconds is None else search.elapsed + GREEDY_SHARE * budget.seconds
    evals = (
        None
        if budget.evaluations is None
        else search.evaluations + int(GREEDY_SHARE * budget.evaluations)
    )

    def stop() -> bool:
        return (seconds is not None and search.elapsed >= seconds) or (
            evals is not None and search.evaluations >= evals
        )

    bounds, devices = climb(ctx.problem, search, stop=stop)
    S, N, K = len(devices), ctx.n_devices, len(ctx.sizes)
    if min(len(ctx.problem.profile), N) < S:
        return None
    assign = np.full((K, N), -1, dtype=np.int64)
    for s, devs in enumerate(devices):
        assign[:, list(devs)] = s
    cuts = np.repeat(np.array([bounds[1:-1]], dtype=np.int64), K, axis=0).reshape(K, S - 1)
    mb = np.repeat(np.arange(K, dtype=np.int64)[:, None], S, axis=1)
    return Genomes(cuts, canonical(assign, ctx.classes), mb)


def fits(ctx: Context, g: Genomes) -> np.ndarray:
    """Whether each individual fits in memory (rule 9; 9r on the stages that recompute),
    without simulating it."""
    if g.size == 0:
        return np.zeros(0, dtype=bool)
    return np.asarray(_ratio(ctx, g).max(-1) <= 1.0)


def _ratio(ctx: Context, g: Genomes) -> np.ndarray:
    """(P, S) memory over capacity of each stage, recomputing where that fits it."""
    return memory_ratio(ctx, with_recompute(ctx, decode(g, ctx.sizes, ctx.n_layers)))


def repair_memory(ctx: Context, g: Genomes, fallback: Genomes) -> Genomes:
    """``g`` with every individual over memory repaired where a repair is found: boundaries
    re-balanced within memory, then replicas added (unused devices, most memory first),
    then nearby microbatch sizes; one that still does not fit is replaced by a random
    individual of ``fallback`` (plans that fit), or kept when ``fallback`` is empty."""
    out = g.take(np.arange(g.size))
    for i in np.flatnonzero(~fits(ctx, g)):
        fixed = _repair_one(ctx, out.take(np.array([i])))
        if fixed is None and fallback.size:
            fixed = fallback.take(ctx.rng.integers(0, fallback.size, size=1))
        if fixed is not None:
            out.cuts[i], out.assign[i], out.mb[i] = fixed.cuts[0], fixed.assign[0], fixed.mb[0]
    return out


def _repair_one(ctx: Context, g: Genomes) -> Genomes | None:
    """One individual within memory, or None (:func:`repair_memory`'s steps; at most
    ``2 + 2 MICROBATCH_STEPS`` boundary balancings)."""
    one = _rebalanced(ctx, g)
    if one is not None:
        return one
    tb = ctx.tables
    assign = g.assign[0].copy()
    for _ in range(REPLICA_STEPS):  # replicas for the fullest stage, its boundaries kept
        now = Genomes(g.cuts, assign[None], g.mb)
        ratio = _ratio(ctx, now)[0]
        free = np.flatnonzero(assign < 0)
        if ratio.max() <= 1.0 or free.size == 0:
            break
        s = int(ratio.argmax())
        floor = tb.dev_capacity[assign == s].min()
        same = tb.dev_type[free] == tb.dev_type[assign == s][0]
        score = np.where(tb.dev_capacity[free] >= floor, 1.0, 0.0) + same
        assign[free[np.lexsort((-tb.dev_capacity[free], -score))[0]]] = s
    if not np.array_equal(assign, g.assign[0]):
        one = _rebalanced(ctx, Genomes(g.cuts, canonical(assign[None], ctx.classes), g.mb))
        if one is not None:
            return one
    K = len(ctx.sizes)
    for step in (1, -1, 2, -2)[: 2 * MICROBATCH_STEPS]:
        mb = np.clip(g.mb + step, 0, K - 1)
        if not np.array_equal(mb, g.mb):
            one = _rebalanced(ctx, Genomes(g.cuts, g.assign, mb))
            if one is not None:
                return one
    return None


def _rebalanced(ctx: Context, g: Genomes) -> Genomes | None:
    """The individual as is if it fits, else with boundaries balanced within memory, or
    None when no boundaries fit its devices and microbatches."""
    if fits(ctx, g)[0]:
        return g
    cuts, _, ok = balanced_cuts(ctx, g.assign[0], g.mb[0])
    return Genomes(cuts[None], g.assign.copy(), g.mb.copy()) if ok else None
