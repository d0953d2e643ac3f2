"""Counts for a fixed layer schedule: given stages (layer ranges, each on an option of the
catalogue), how many nodes each stage takes -- exactly, for the bottleneck.

The stage structure fixed, the bottleneck is ``max(max_s W_s(m_s), links)``; for a cap ``T``
the cheapest counts take each stage's least ``m`` with ``W_s(m) <= T``, so trying every ``T``
among the stages' busy times (and the links) gives the least ``price x bottleneck`` that
respects each kind's count. HeterPS's two baselines share it: ``heterps_cpu_gpu`` (first
layer on the CPU) and ``heterps_rl`` (layers to kinds by a policy).
"""

from __future__ import annotations

import numpy as np

from pipeplan.agents.problem import Objective, Problem
from pipeplan.agents.provision.exact import Found
from pipeplan.agents.provision.kinds import Catalogue, StageCosts


def best_counts(
    problem: Problem,
    catalogue: Catalogue,
    costs: StageCosts,
    bounds: tuple[int, ...],
    options: tuple[int, ...],
    t_max: float,
    fill: bool = True,
) -> Found | None:
    """The least ``price x bottleneck`` (the bottleneck, for the time objectives) over the
    counts of a fixed structure, its bound ``<= t_max``; None when no counts fit. With
    ``fill``, the cap allows for the pipeline's fill and drain (``t_max x M / (M + S - 1)``,
    a heuristic: the simulated batch time is what finally counts)."""
    S = len(options)
    if fill:  # GPipe-like fill and drain: S - 1 more microbatch slots than the bound counts
        t_max = t_max * costs.M / (costs.M + S - 1)
    qs = np.arange(S + 1)
    W = []
    for s, o in enumerate(options):
        w = costs.busy(bounds[s], o, qs)[bounds[s + 1] - bounds[s] - 1, :, S - s]
        W.append(np.minimum.accumulate(w))  # more nodes never needed for the same cap
    link = max((float(costs.link[b]) for b in bounds[1:-1]), default=0.0)
    caps = np.unique(np.concatenate([w[np.isfinite(w)] for w in W] + [np.array([link])]))
    caps = caps[(caps >= link) & (caps <= t_max)]
    kinds = np.array([catalogue.options[o].kind for o in options])
    prices = np.array([catalogue.options[o].node_price for o in options])
    limit = np.array(catalogue.available)
    best: Found | None = None
    for T in caps:
        m = np.array([int(np.searchsorted(-w, -T, side="left")) + 1 for w in W])
        if any(m[s] > len(W[s]) for s in range(S)):
            continue
        if (np.bincount(kinds, weights=m, minlength=len(limit)) > limit).any():
            continue
        bound = max(max(float(W[s][m[s] - 1]) for s in range(S)), link)
        price = float(m @ prices)
        value = price * bound if problem.objective is Objective.COST else bound
        if best is None or value < best.value:
            stages = tuple((int(o), int(k)) for o, k in zip(options, m, strict=True))
            best = Found(value, bound, price, bounds, stages, costs.b)
    return best
