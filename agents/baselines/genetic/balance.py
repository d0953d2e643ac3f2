"""Min-max balanced stage boundaries for a given device assignment: the ``genetic``
planner's seeds, its re-balancing mutation and one of its neighbours.

The busiest resource of a plan (a stage's compute with its update and all-reduce, or the link
after it) bounds its steady-state batch time from below; :func:`balanced_cuts` places the
boundaries that minimise it by a dynamic program over contiguous splits. It is a guide, not
the cost model: the pipeline fill and the dependencies are left out. Boundaries that would
put a stage over its devices' memory (rule 9, :func:`stage_fits`) are ruled out, so the
balanced plans fit whenever some boundaries for those devices and microbatches do.
"""

from __future__ import annotations

import numpy as np

from pipeplan.agents.baselines.genetic.context import Context
from pipeplan.agents.baselines.genetic.genome import FloatArray, Genomes, IntArray
from pipeplan.core import rules

MEMO_SIZE = 4096
"""Stage tables kept (:func:`stage_cost`; each (L+1)^2 floats) before the memo is cleared."""


def stage_fits(ctx: Context, devices: IntArray, b: float, warmup: int) -> np.ndarray:
    """(L+1, L+1): whether layers ``[a, e)`` fit on every one of ``devices`` as one stage of
    microbatch ``b`` with ``warmup`` 1F1B warm-up forwards (ignored under GPipe): the cost
    model's memory rule (weights, gradients and optimizer state, plus the microbatches it
    holds of its replica share of the activations) against the smallest capacity, or rule
    9r's when the stage recomputes its activations (a decoded plan does where it must)."""
    tb, p = ctx.tables, ctx.problem
    held = rules.held_microbatches(p.schedule, b, p.global_batch, warmup)
    share = rules.replica_share(b, devices.size)
    need = rules.memory_bytes(tb.params_range, tb.acts_range, share, held)
    again = rules.recompute_memory_bytes(
        tb.params_range, tb.cuts[:, None], tb.acts_range, share, held
    )
    return np.asarray(np.minimum(need, again) <= tb.dev_capacity[devices].min())


def stage_cost(
    ctx: Context, devices: IntArray, b: float, after: IntArray | None, b_after: float
) -> FloatArray:
    """(L+1, L+1): the busiest resource of layers ``[a, e)`` as one stage on ``devices`` at
    microbatch ``b``: its compute ``M (F + B)`` plus its update and all-reduce, or the link to
    the stage after it on ``after`` (None: the last stage; an empty array: a stage not known
    yet, costed over the slower inter-node link) at that stage's microbatch ``b_after``."""
    key = (devices.tobytes(), b, None if after is None else after.tobytes(), b_after)
    if key not in ctx.stage_memo:
        if len(ctx.stage_memo) >= MEMO_SIZE:
            ctx.stage_memo.clear()
        ctx.stage_memo[key] = _stage_cost(ctx, devices, b, after, b_after)
    return ctx.stage_memo[key]


def _stage_cost(
    ctx: Context, devices: IntArray, b: float, after: IntArray | None, b_after: float
) -> FloatArray:
    tb, B = ctx.tables, ctx.problem.global_batch
    t = tb.dev_type[devices]
    m = B // b
    cost = m * rules.compute_s(
        ctx.fb_fixed[t], ctx.fb_per_sample[t], rules.replica_share(b, t.size)
    ).max(0)
    cost = cost + _update_time(ctx, devices) * tb.params_range  # step + all-reduce
    if after is None:
        return np.asarray(cost)
    both = np.concatenate([devices, after])
    cross = int(after.size == 0 or np.unique(tb.dev_node[both]).size > 1)
    link = m * rules.transfer_s(tb.cuts * max(b, b_after), tb.link_bps[cross], tb.link_lat[cross])
    return np.asarray(np.maximum(cost, link[None, :]))


def balanced_cuts(ctx: Context, assign: IntArray, mb: IntArray) -> tuple[IntArray, float, bool]:
    """Boundaries minimising the busiest resource (:func:`stage_cost`) for one device
    assignment and microbatch choice, among those that fit in memory (:func:`stage_fits`);
    a min-max dynamic program over contiguous splits, O(S L^2). Returns the boundaries,
    that time and whether they fit; when no boundaries fit, the balanced ones regardless
    of memory."""
    S = mb.size
    devs = [np.flatnonzero(assign == s) for s in range(S)]
    b = [float(ctx.sizes[i]) for i in mb]
    warm = ctx.warmups(mb)
    costs, fits = [], []
    for s in range(S):
        after = devs[s + 1] if s < S - 1 else None
        costs.append(stage_cost(ctx, devs[s], b[s], after, b[min(s + 1, S - 1)]))
        fits.append(stage_fits(ctx, devs[s], b[s], int(warm[s])))
    masked = [np.where(f, c, np.inf) for c, f in zip(costs, fits, strict=True)]
    cuts, time = _min_max(ctx, masked)
    if np.isfinite(time):
        return cuts, time, True
    cuts, time = _min_max(ctx, costs)
    return cuts, time, False


def _min_max(ctx: Context, costs: list[FloatArray]) -> tuple[IntArray, float]:
    """The contiguous split of the layers into ``len(costs)`` stages (stage ``s`` costs
    ``costs[s][a, e]`` for layers ``[a, e)``) with the smallest largest cost."""
    L, S = ctx.n_layers, len(costs)
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    back = np.zeros((S, L + 1), dtype=np.int64)
    for s, cost in enumerate(costs):
        worst = np.where(ctx.upper, np.maximum(best[:, None], cost), np.inf)
        back[s], best = worst.argmin(0), worst.min(0)
    cuts, e = [], L
    for s in range(S - 1, 0, -1):
        e = int(back[s, e])
        cuts.append(e)
    return np.array(cuts[::-1], dtype=np.int64), float(best[L])


def _update_time(ctx: Context, devices: IntArray) -> float:
    """Seconds per parameter byte of a stage's update and all-reduce on ``devices`` (rule 8
    for one byte). A guidance heuristic: the all-reduce's latency, paid once per step and not
    per byte, is left out."""
    tb, r = ctx.tables, devices.size
    update = float(rules.update_s(1.0, tb.dev_membw[devices].min()))
    if r == 1:
        return update
    cross = int(np.unique(tb.dev_node[devices]).size > 1)
    return update + float(rules.allreduce_s(1.0, r, tb.ring_bps[cross], 0.0))


def rebalance(ctx: Context, g: Genomes) -> Genomes:
    """The same individuals with :func:`balanced_cuts` boundaries."""
    out = g.take(np.arange(g.size))
    for i in range(g.size):
        out.cuts[i] = balanced_cuts(ctx, g.assign[i], g.mb[i])[0]
    return out
