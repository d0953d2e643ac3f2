"""Min-max balanced stage boundaries for a given device assignment: the ``genetic``
planner's seeds, its re-balancing mutation and one of its neighbours.

The busiest resource of a plan (a stage's compute with its update and all-reduce, or the link
after it) bounds its steady-state batch time from below; :func:`balanced_cuts` places the
boundaries that minimise it by a dynamic program over contiguous splits. It is a guide, not
the cost model: the pipeline fill and the dependencies are left out.
"""

from __future__ import annotations

import numpy as np

from pipeplan.agents.baselines.genetic.context import Context
from pipeplan.agents.baselines.genetic.genome import Genomes, IntArray
from pipeplan.core import rules


def balanced_cuts(ctx: Context, assign: IntArray, mb: IntArray) -> tuple[IntArray, float]:
    """Boundaries minimising the busiest resource for one device assignment and microbatch
    choice: a stage's compute ``M_s (F_s + B_s)`` plus its update and all-reduce, or the link
    after it, ``M_s (latency + X b / bandwidth)`` (GPipe overlaps the two; the pipeline fill
    is ignored). A min-max dynamic program over contiguous splits, O(S L^2). Returns the
    boundaries and that time."""
    tb, L, B, S = ctx.tables, ctx.n_layers, ctx.problem.global_batch, mb.size
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    back = np.zeros((S, L + 1), dtype=np.int64)
    devs = [np.flatnonzero(assign == s) for s in range(S)]
    for s in range(S):
        t = tb.dev_type[devs[s]]
        b = float(ctx.sizes[mb[s]])
        m = B // b
        cost = m * rules.compute_s(
            ctx.fb_fixed[t], ctx.fb_per_sample[t], rules.replica_share(b, t.size)
        ).max(0)
        cost = cost + _update_time(ctx, devs[s]) * tb.params_range  # step + all-reduce
        if s < S - 1:  # the busier direction of the link to the next stage
            cross = int(np.unique(tb.dev_node[np.concatenate(devs[s : s + 2])]).size > 1)
            b_link = max(b, float(ctx.sizes[mb[s + 1]]))
            link = m * rules.transfer_s(tb.cuts * b_link, tb.link_bps[cross], tb.link_lat[cross])
            cost = np.maximum(cost, link[None, :])
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
