"""The ``genetic`` planner's operators on whole populations: repair, selection, crossover,
mutation, duplicate detection, ranking, and the neighbourhood of one individual.

Repair makes any genome valid and canonical (sorted distinct cuts, a device for every stage,
interchangeable devices in canonical order, equal microbatches where required), so the
operators may produce anything. Ranking puts feasible individuals first by value, then
infeasible ones by how far they miss (a penalty, not a death sentence).
"""

from __future__ import annotations

import itertools

import numpy as np

from pipeplan.agents.baselines.genetic.balance import rebalance
from pipeplan.agents.baselines.genetic.context import Context
from pipeplan.agents.baselines.genetic.genome import FloatArray, Genomes, IntArray, canonical

DEVICE_MOVES = 3.0
"""Most devices a mutation moves on average: on large clusters the per-device rate is
lowered to this many over the devices, so a child stays near its parents."""
NEIGHBOURS = 512
"""Most one-step neighbours :func:`neighbours` returns (a random choice beyond it): on
large clusters device moves and swaps number in the tens of thousands."""


def repair_cuts(cuts: IntArray, n_layers: int) -> IntArray:
    """Sorted, distinct boundaries in ``[1, L)``: every stage keeps at least one layer."""
    k = cuts.shape[1]
    c = np.sort(np.clip(cuts, 1, n_layers - 1), axis=1)
    for i in range(1, k):
        c[:, i] = np.maximum(c[:, i], c[:, i - 1] + 1)
    for i in range(k - 1, -1, -1):
        top = n_layers - 1 if i == k - 1 else c[:, i + 1] - 1
        c[:, i] = np.minimum(c[:, i], top)
    return c


def repair_devices(assign: IntArray, stages: int, rng: np.random.Generator) -> IntArray:
    """Give every stage a device: an unused one if any, else a spare replica of another stage.

    Always succeeds when ``stages <= N`` (pigeonhole). Stage genes beyond ``stages - 1``
    (from a larger-S parent) are first wrapped into range.
    """
    a = np.where(assign >= stages, assign % stages, assign)
    used = np.nonzero(a >= 0)
    counts = np.zeros((a.shape[0], stages), dtype=np.int64)  # (P, S) devices per stage
    np.add.at(counts, (used[0], a[used]), 1)
    for s in range(stages):
        rows = np.flatnonzero(counts[:, s] == 0)
        if rows.size == 0:
            continue
        sub, c = a[rows], counts[rows]
        peers = np.where(sub >= 0, np.take_along_axis(c, np.maximum(sub, 0), 1), 0)
        priority = np.where(sub < 0, 0.0, np.where(peers >= 2, 1.0, np.inf))
        pick = np.argmin(priority + rng.random(sub.shape), axis=1)
        old = sub[np.arange(rows.size), pick]
        moved = old >= 0
        counts[rows[moved], old[moved]] -= 1
        counts[rows, s] += 1
        a[rows, pick] = s
    return a


def repair(ctx: Context, g: Genomes) -> Genomes:
    """A valid, canonical individual: sorted distinct cuts, a device for every stage, equal
    microbatches where required."""
    cuts = repair_cuts(g.cuts, ctx.n_layers)
    assign = canonical(repair_devices(g.assign, g.stages, ctx.rng), ctx.classes)
    mb = np.repeat(g.mb[:, :1], g.stages, axis=1) if ctx.equal else g.mb
    return Genomes(cuts, assign, mb)


def tournament(rank: IntArray, n: int, k: int, rng: np.random.Generator) -> IntArray:
    """``n`` winners of ``k``-way tournaments (lower rank wins)."""
    contestants = rng.integers(0, rank.size, size=(n, k))
    return np.take_along_axis(contestants, rank[contestants].argmin(1)[:, None], 1)[:, 0]


def crossover(a: Genomes, b: Genomes, rate: float, rng: np.random.Generator) -> Genomes:
    """Uniform crossover of each chromosome, each crossed with probability ``rate``."""

    def mix(x: IntArray, y: IntArray) -> IntArray:
        crossed = rng.random((x.shape[0], 1)) < rate
        pick = crossed & (rng.random(x.shape) < 0.5)
        return np.where(pick, y, x)

    structure = rng.random((a.size, 1)) < rate  # cuts and devices cross together
    cut_pick = structure & (rng.random(a.cuts.shape) < 0.5)
    dev_pick = structure & (rng.random(a.assign.shape) < 0.5)
    return Genomes(
        np.where(cut_pick, b.cuts, a.cuts), np.where(dev_pick, b.assign, a.assign), mix(a.mb, b.mb)
    )


def mutate(ctx: Context, g: Genomes) -> Genomes:
    """Cut shifts (geometric steps), device moves (to a stage or out) and swaps, and
    microbatch-size steps, each at its configured rate; then :func:`repair`."""
    rng, c, S, K = ctx.rng, ctx.config, g.stages, len(ctx.sizes)
    P, N = g.assign.shape
    hit = rng.random(g.cuts.shape) < c.cut_mutation
    step = rng.choice([-1, 1], size=g.cuts.shape) * rng.geometric(0.5, size=g.cuts.shape)
    cuts = g.cuts + hit * step
    assign = g.assign.copy()
    rate = min(c.device_mutation, DEVICE_MOVES / N)
    move = rng.random((P, N)) < rate
    fresh = np.where(rng.random((P, N)) < c.unused_rate, -1, rng.integers(0, S, size=(P, N)))
    assign = np.where(move, fresh, assign)
    swap = np.flatnonzero(rng.random(P) < c.device_mutation * 2)
    i, j = rng.integers(0, N, size=swap.size), rng.integers(0, N, size=swap.size)
    assign[swap, i], assign[swap, j] = assign[swap, j], assign[swap, i]
    mb_hit = rng.random(g.mb.shape) < c.microbatch_mutation
    mb = np.clip(g.mb + mb_hit * rng.choice([-1, 1], size=g.mb.shape), 0, K - 1)
    return repair(ctx, Genomes(cuts, assign, mb))


def duplicates(ctx: Context, g: Genomes) -> np.ndarray:
    """Individuals already costed, or repeated within ``g``."""
    seen: set[bytes] = set()
    out = np.zeros(g.size, dtype=bool)
    for i, key in enumerate(g.keys()):
        out[i] = key in ctx.cache or key in seen
        seen.add(key)
    return out


def ranking(value: FloatArray, viol: FloatArray) -> IntArray:
    """Rank of each individual: feasible ones by value, then infeasible ones by violation."""
    feasible = np.isfinite(value)
    order = np.lexsort((np.where(feasible, value, viol), ~feasible))
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank


def neighbours(ctx: Context, g: Genomes) -> Genomes:
    """Every one-step change of one individual: a boundary shifted by 1 or 2 layers, a device
    moved to another stage (or out), two devices' stages swapped, a microbatch-size step or
    one stage's size for all, and the boundaries re-balanced. Device moves and swaps beyond
    :data:`NEIGHBOURS` are a random choice of them."""
    S, K = g.stages, len(ctx.sizes)
    out: list[Genomes] = []
    for i, step in itertools.product(range(S - 1), (-2, -1, 1, 2)):
        n = g.take(np.zeros(1, dtype=np.int64))
        n.cuts[0, i] += step
        out.append(n)
    out.append(_device_steps(ctx, g))
    for s, step in itertools.product(range(1 if ctx.equal else S), (-1, 0, 1)):
        n = g.take(np.zeros(1, dtype=np.int64))
        size = min(max(n.mb[0, s] + step, 0), K - 1)
        if step:
            n.mb[0, s] = size
        else:  # every stage takes this stage's size
            n.mb[0, :] = size
        out.append(n)
    out.append(rebalance(ctx, g))
    return repair(ctx, Genomes.concat(out))


def _device_steps(ctx: Context, g: Genomes) -> Genomes:
    """One individual's device moves (a device to another stage, or out) and swaps (two
    devices of different stages), at most :data:`NEIGHBOURS` of them (a random choice)."""
    S, a = g.stages, g.assign[0]
    dev, slot = np.divmod(np.arange(a.size * (S + 1)), S + 1)
    slot = slot - 1
    keep = slot != a[dev]
    dev, slot = dev[keep], slot[keep]
    d, e = np.triu_indices(a.size, 1)
    keep = a[d] != a[e]
    d, e = d[keep], e[keep]
    total = dev.size + d.size
    pick = np.arange(total)
    if total > NEIGHBOURS:
        pick = np.sort(ctx.rng.choice(total, NEIGHBOURS, replace=False))
    moves, swaps = pick[pick < dev.size], pick[pick >= dev.size] - dev.size
    assign = np.repeat(a[None], moves.size + swaps.size, axis=0)
    assign[np.arange(moves.size), dev[moves]] = slot[moves]
    rows = moves.size + np.arange(swaps.size)
    assign[rows, d[swaps]], assign[rows, e[swaps]] = a[e[swaps]], a[d[swaps]]
    n = assign.shape[0]
    return Genomes(np.repeat(g.cuts, n, axis=0), assign, np.repeat(g.mb, n, axis=0))
