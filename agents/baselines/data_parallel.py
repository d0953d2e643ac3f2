"""``data_parallel``: one stage holding every layer, replicated on the chosen devices (TAPP's
"BSP" baseline: synchronous data parallelism, each replica a ``1 / r`` share of every
microbatch, gradients all-reduced once per batch).

Which devices:

- ``time``/``throughput``: every device, and also every prefix of the devices ordered
  fastest first. BSP waits for its slowest replica (cost model rule 2: a stage's time is the
  maximum over its replicas), so on a heterogeneous cluster adding a slow device can make the
  batch slower; the best prefix is the fairest BSP baseline, and "all devices" is among the
  prefixes, so TAPP's literal baseline is covered.
- ``cost``: every provisioning plan by type counts, HeterPS-style: for each count vector
  ``0 <= c_t <= n_t`` (not all zero), the first ``c_t`` devices of type ``t`` in the cluster's
  node-by-node order (devices of a type packed onto as few nodes as the order allows, so the
  all-reduce stays intra-node where it can). ``prod(n_t + 1) - 1`` sets, costed in chunks
  until the budget runs out.

Every allowed microbatch size is tried for each set; replica ``k`` computes ``b // r``
samples, one more for the first ``b % r`` replicas (cost model rule 2i: the executor's
split), so a size that ``r`` divides wastes nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from pipeplan.agents.baselines.common import devices_fastest_first, population
from pipeplan.agents.problem import Objective, Problem
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core.cluster import ClusterSpec

CHUNK = 256  # device sets per population


class DataParallelPlanner(Planner):
    name = "data_parallel"

    def search(self, problem: Problem, search: Search) -> None:
        n_layers = len(problem.profile)
        if problem.objective is Objective.COST:
            sets: Iterator[list[int]] = provisioning_sets(problem.cluster)
        else:
            order = devices_fastest_first(problem.cluster)
            sets = (order[:k] for k in range(len(order), 0, -1))
        while True:
            chunk = list(itertools.islice(sets, CHUNK))
            if not chunk:
                return
            bounds = [[0, n_layers]] * len(chunk)
            devices = [[d] for d in chunk]
            search.evaluate(population(bounds, devices, problem.microbatch_sizes()))
            if search.exhausted():
                return


def provisioning_sets(cluster: ClusterSpec) -> Iterator[list[int]]:
    """Device index sets, one per non-zero count vector over the cluster's device types.

    Types are taken in name order; the count vectors run in lexicographic order from all
    zeros (skipped) up. Each set lists, type by type, the first ``c_t`` devices of that type
    in ``cluster.device_ids`` order.
    """
    by_type: dict[str, list[int]] = {}
    for i, d in enumerate(cluster.device_ids):
        by_type.setdefault(cluster.device(d).type, []).append(i)
    types = sorted(by_type)
    ranges: Sequence[range] = [range(len(by_type[t]) + 1) for t in types]
    for counts in itertools.product(*ranges):
        if any(counts):
            yield [i for t, c in zip(types, counts, strict=True) for i in by_type[t][:c]]
