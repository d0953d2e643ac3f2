"""Initial populations of the ``genetic`` planner: seeded and random genomes.

Per island, half the population is seeded: candidate device assignments (every one when few,
else the fastest and random ones) get :func:`~agents.baselines.genetic.balance.balanced_cuts`
boundaries and are ranked by that busiest-resource proxy; the best are costed and kept
(:func:`seed_genomes`). The other half is random (:func:`random_genomes`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from pipeplan.agents.baselines.genetic.balance import balanced_cuts, rebalance
from pipeplan.agents.baselines.genetic.context import Context
from pipeplan.agents.baselines.genetic.genome import Genomes, IntArray, canonical
from pipeplan.agents.baselines.genetic.operators import ranking, repair, repair_devices
from pipeplan.agents.problem import Objective


def _one_per_stage(ctx: Context, S: int, n: int) -> IntArray:
    """Up to ``n`` assignments of ``S`` distinct devices to the ``S`` stages: every ordered
    choice when there are at most ``n``, else the measured-fastest first and random ones."""
    N = ctx.n_devices
    if math.perm(N, S) <= n:
        picks = np.array(list(itertools.permutations(range(N), S)), dtype=np.int64)
    else:
        speed = ctx.fb_per_sample[ctx.tables.dev_type][:, 0, ctx.n_layers]
        fastest = np.argsort(speed, kind="stable")[:S]
        rand = np.argsort(ctx.rng.random((n - 2, N)), axis=1)[:, :S]
        picks = np.concatenate([fastest[None], fastest[None, ::-1], rand])
    assign = np.full((picks.shape[0], N), -1, dtype=np.int64)
    np.put_along_axis(assign, picks, np.arange(S)[None, :], axis=1)
    return assign


def candidates(ctx: Context, S: int, n: int, deadline: float | None = None) -> Genomes:
    """The ``n`` most promising structures by a cheap proxy, middle microbatch size.

    Candidate device assignments -- one device per stage (every ordered choice when few) and
    any with replicas and unused devices (all of them when few, else random ones) -- each get
    :func:`balanced_cuts` boundaries and are ranked by that busiest-resource time (times the
    price for the cost objective, those surely below the throughput target last), those
    that fit in memory first. The proxy stops at ``deadline`` (the search's seconds; the
    candidates not reached are left out): on large clusters it is the costly part.
    """
    N, mid = ctx.n_devices, len(ctx.sizes) // 2
    if (S + 1) ** N <= 2048:  # every assignment (stages or unused), repaired and canonical
        every = np.array(list(itertools.product(range(-1, S), repeat=N)), dtype=np.int64)
        spread = repair_devices(every, S, ctx.rng)
    else:
        spread = random_genomes(ctx, 512, S).assign
    assign = canonical(np.concatenate([_one_per_stage(ctx, S, 256), spread]), ctx.classes)
    mb = np.full(S, mid, dtype=np.int64)
    proxy = np.empty(assign.shape[0])
    fit = np.zeros(assign.shape[0], dtype=bool)
    cuts = np.empty((assign.shape[0], S - 1), dtype=np.int64)
    done = assign.shape[0]
    for i, a in enumerate(assign):
        if i and deadline is not None and ctx.search.elapsed >= deadline:
            done = i
            break
        cuts[i], proxy[i], fit[i] = balanced_cuts(ctx, a, mb)
    assign, cuts, proxy, fit = assign[:done], cuts[:done], proxy[:done], fit[:done]
    if ctx.problem.objective is Objective.COST:
        price = np.where(assign >= 0, ctx.tables.dev_price[None, :], 0.0).sum(1)
        busy = proxy
        proxy = busy * price + 1e-9 * busy
        if ctx.problem.min_throughput:  # rough: the busiest resource is a lower bound
            proxy[ctx.problem.global_batch / busy < ctx.problem.min_throughput] = np.inf
    g = Genomes(cuts, assign, np.repeat(mb[None], assign.shape[0], axis=0))
    _, first = np.unique(np.array(g.keys()), return_index=True)
    return g.take(first[np.lexsort((proxy[first], ~fit[first]))][:n])


def seed_genomes(ctx: Context, S: int, deadline: float | None = None) -> Genomes:
    """Sensible starting points, at most half the population: the ``seed_candidates`` best
    :func:`candidates` are costed (the proxy misses the pipeline fill and the dependencies),
    the best of those kept, and the very best also with every microbatch size."""
    K, half = len(ctx.sizes), max(ctx.config.population // 2, 1)
    g = candidates(ctx, S, ctx.config.seed_candidates, deadline)
    g = g.take(np.argsort(ranking(*ctx.fitness(g)))[: max(half - K, 1)])
    top = g.take(np.zeros(K, dtype=np.int64))
    top.mb[:] = np.arange(K)[:, None]
    g = Genomes.concat([rebalance(ctx, top), g])
    return g.take(np.arange(min(g.size, half)))


def random_genomes(ctx: Context, n: int, S: int) -> Genomes:
    rng, L, N, K = ctx.rng, ctx.n_layers, ctx.n_devices, len(ctx.sizes)
    cuts = np.sort(np.argsort(rng.random((n, L - 1)), axis=1)[:, : S - 1] + 1, axis=1)
    assign = rng.integers(0, S, size=(n, N))
    assign[rng.random((n, N)) < ctx.config.unused_rate] = -1
    base = rng.integers(0, K, size=(n, 1))
    step = rng.integers(-1, 2, size=(n, S)) * (rng.random((n, S)) < 0.3)
    mb = np.clip(base + step, 0, K - 1)
    return repair(ctx, Genomes(cuts, assign, mb))
