"""``balanced``: equal parameter bytes per stage, one device per stage (DeepSpeed's
``partition_method="parameters"``).

For each stage count ``S`` the layers are cut into ``S`` contiguous, non-empty stages whose
heaviest stage holds as few parameter bytes as possible (DeepSpeed's ``partition_balanced``
searches the same bottleneck); among the cuts that reach it, each cut is placed so that the
stages left of it share the remaining bytes as evenly as possible. Stage ``s`` runs on the
``s``-th fastest device. Every stage count and every allowed microbatch size is tried and the
best plan for the objective is kept, as in ``uniform``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeplan.agents.baselines.common import devices_fastest_first, population
from pipeplan.agents.problem import Problem
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search


class BalancedPlanner(Planner):
    name = "balanced"

    def search(self, problem: Problem, search: Search) -> None:
        order = devices_fastest_first(problem.cluster)
        weights = [layer.params_bytes for layer in problem.profile.layers]
        for S in range(1, min(len(order), len(weights)) + 1):
            bounds = [balanced_bounds(weights, S)]
            devices = [[[order[s]] for s in range(S)]]
            search.evaluate(population(bounds, devices, problem.microbatch_sizes()))
            if search.exhausted():
                return


def balanced_bounds(weights: Sequence[int], parts: int) -> list[int]:
    """Stage boundaries ``[0, ..., len(weights)]`` of ``parts`` contiguous non-empty stages
    whose largest weight sum is the smallest possible.

    A dynamic program over prefix sums finds that bottleneck exactly (``O(parts * n^2)``
    vectorised over the cut position); the cuts are then chosen from the last stage back, each
    as close as the bottleneck allows to an even share of what is left of it.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"parts: must be in [1, {n}] for {n} layers, got {parts}")
    prefix = np.concatenate([[0], np.cumsum(np.asarray(weights, dtype=np.int64))])
    inf = np.iinfo(np.int64).max
    # best[s, j]: smallest bottleneck of the first j layers in s non-empty stages
    best = np.full((parts + 1, n + 1), inf, dtype=np.int64)
    best[0, 0] = 0
    for s in range(1, parts + 1):
        for j in range(s, n + 1):
            i = np.arange(s - 1, j)
            best[s, j] = np.maximum(best[s - 1, i], prefix[j] - prefix[i]).min()
    bottleneck = best[parts, n]
    bounds = [n]
    j = n
    for s in range(parts, 0, -1):
        i = np.arange(s - 1, j)
        ok = i[(best[s - 1, i] <= bottleneck) & (prefix[j] - prefix[i] <= bottleneck)]
        # closest to an even share of the bytes of layers [0, j) over the s stages left;
        # on ties (parameter-free layers), closest to an even share of the layer count
        by_bytes = np.abs(prefix[j] - prefix[ok] - prefix[j] / s)
        by_count = np.abs(j - ok - j / s)
        cut = ok[np.lexsort((by_count, by_bytes))[0]]
        bounds.append(int(cut))
        j = int(cut)
    return bounds[::-1]
