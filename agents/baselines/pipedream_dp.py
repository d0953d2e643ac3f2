"""``pipedream_dp``: PipeDream's partitioning DP, applied blindly to a heterogeneous cluster.

PipeDream (Narayanan et al., SOSP'19, section 3.1) splits a model into stages, each
replicated over some workers, to minimise the slowest stage, assuming identical workers on a
flat interconnect. With ``T(i -> j, m) = max(sum of T_l, sum of W_l^m) / m`` the time of
layers ``i..j`` replicated over ``m`` workers (``T_l`` a layer's forward + backward time,
``W_l^m = 4 (m - 1) |w_l| / (m B)`` its weight synchronisation) and ``C_i`` the time to send
the activations after layer ``i``::

    A(j, m) = min( T(1 -> j, m),
                   min over i < j, 1 <= m' < m of max(A(i, m - m'), 2 C_i, T(i+1 -> j, m')) )

Assumptions made here, as PipeDream's would be on this cluster (documented, not hidden):

- every worker is the cluster's most common device type (most devices; ties: the type of
  the first such device in cluster order), or ``assume``; its per-layer times come from the
  profile (or FLOPs, DESIGN.md rule 1) at the microbatch size;
- one flat interconnect of bandwidth ``B``: the intra-node link on a one-node cluster, else
  the inter-node link; the boundary bytes are the cost model's (skips relayed);
- memory: the SOSP'19 optimiser has none, and without one no plan of a model of billions of
  parameters fits. A stage is allowed only where it fits (:class:`StageMemory`, the cost
  model's rule 9) on the devices it will be mapped onto -- known in the DP, as stages take
  devices in cluster order: the last stage of ``A(j, m)`` takes devices ``m - m'`` to
  ``m - 1``. Its held microbatches are GPipe's (the most any schedule holds), so a stage
  that fits here fits under 1F1B too.

The DP runs for every allowed microbatch size. Stages are then mapped onto the actual
devices in cluster order (stage 0 takes the first ``m_0`` devices of ``cluster.device_ids``,
and so on) and every plan is costed by the real cost model, which picks the best; each
size's plans are costed before the next size's DP runs, so a budget that ends early still
leaves an answer. For the ``time`` objective PipeDream uses all ``N`` workers; for ``cost``
(provisioning) it is also run for ``m = 1 .. N`` workers, the first ``m`` devices in cluster
order.

Complexity: ``O(L^2 N^2)`` per microbatch size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from pipeplan.agents.problem import Objective, Problem, ProblemError
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core import rules
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.plan import Schedule

FloatArray = np.ndarray

SYNC_FACTOR = 4.0
"""The 4 of PipeDream's weight synchronisation time ``W_l^m = 4 (m - 1) |w_l| / (m B)``
(SOSP'19, section 3.1): its own model, not this project's all-reduce rule."""


@dataclass(frozen=True)
class PipeDreamConfig:
    """Options of ``pipedream_dp``."""

    assume: str | None = None
    """The device type every worker is assumed to be; None: the most common one."""


def assumed_type(problem: Problem, assume: str | None) -> str:
    """The type PipeDream takes every worker for: ``assume`` or the most common type."""
    cluster = problem.cluster
    if assume is not None:
        if assume not in cluster.device_types:
            raise ProblemError(
                f"pipedream_dp.assume: unknown device type {assume!r} (one of "
                f"{', '.join(sorted(cluster.device_types))})"
            )
        return assume
    types = [cluster.device(d).type for d in cluster.device_ids]
    counts = Counter(types)
    most = max(counts.values())
    return next(t for t in types if counts[t] == most)


@dataclass(frozen=True)
class StageMemory:
    """Rule 9 for the DP's stages: layers ``[i, j)`` on ``r`` replicas that are devices
    ``first .. first + r - 1`` in cluster order, at one microbatch size."""

    params_prefix: FloatArray
    """(L+1,) parameter bytes of layers ``[0, l)``."""
    acts_prefix: FloatArray
    """(L+1,) activation bytes per sample of layers ``[0, l)``."""
    capacity: FloatArray
    """(N,) each device's memory in bytes, in cluster order."""
    microbatch: int
    held: float
    """Microbatches a stage holds at its peak (GPipe's ``B / b``)."""

    def smallest(self) -> FloatArray:
        """(N+1, N+1): the smallest capacity of devices ``[a, e)`` (inf when empty)."""
        n = self.capacity.size
        out = np.full((n + 1, n + 1), np.inf)
        for a in range(n):
            out[a, a + 1 :] = np.minimum.accumulate(self.capacity[a:])
        return out

    def need(self, i: ArrayLike, j: int, replicas: ArrayLike) -> FloatArray:
        """Bytes per device of layers ``[i, j)`` on ``replicas`` replicas."""
        p, a = self.params_prefix, self.acts_prefix
        i = np.asarray(i)
        share = rules.replica_share(self.microbatch, np.asarray(replicas))
        return np.asarray(rules.memory_bytes(p[j] - p[i], a[j] - a[i], share, self.held))


def pipedream_partition(
    layer_time: ArrayLike,
    params: ArrayLike,
    comm: ArrayLike,
    workers: int,
    bandwidth: float,
    memory: StageMemory | None = None,
) -> list[tuple[int, int, int]]:
    """PipeDream's DP over ``L`` layers and ``workers`` identical workers.

    layer_time: (L,) forward + backward seconds of each layer; params: (L,) weight bytes;
    comm: (L+1,) seconds to send the activations crossing the cut before layer ``c``;
    bandwidth: bytes/s; memory: where stages must fit (None: anywhere). Returns stages as
    ``(start, end, replicas)`` using all the workers, or no stages when none fit.
    """
    comm = np.asarray(comm, dtype=np.float64)
    t_sum = np.concatenate([[0.0], np.cumsum(np.asarray(layer_time, dtype=np.float64))])
    w_sum = np.concatenate([[0.0], np.cumsum(np.asarray(params, dtype=np.float64))])
    L = len(t_sum) - 1

    def stage(i: np.ndarray, j: int, m: np.ndarray) -> FloatArray:  # layers [i, j) on m
        sync = SYNC_FACTOR * (m - 1) * (w_sum[j] - w_sum[i]) / (m * bandwidth)
        return np.maximum(t_sum[j] - t_sum[i], sync) / m

    smallest = None if memory is None else memory.smallest()

    def over(i: ArrayLike, j: int, mm: np.ndarray, m: int) -> np.ndarray:
        """Whether layers [i, j) on the mm devices before worker m are over memory."""
        if memory is None or smallest is None:
            return np.zeros(np.broadcast_shapes(np.shape(i), mm.shape), dtype=bool)
        return np.asarray(memory.need(i, j, mm) > smallest[m - mm, m])

    A = np.full((L + 1, workers + 1), np.inf)
    choice = np.zeros((L + 1, workers + 1, 2), dtype=np.int64)  # (i, m') of the last stage
    for j in range(1, L + 1):
        ii = np.arange(1, j)[:, None]
        for m in range(1, workers + 1):
            best, arg = float(stage(np.array(0), j, np.array(m))), (0, m)
            if over(0, j, np.array(m), m):
                best = np.inf
            if j > 1 and m > 1:
                mm = np.arange(1, m)[None, :]
                v = np.maximum(np.maximum(A[ii, m - mm], 2.0 * comm[ii]), stage(ii, j, mm))
                v = np.where(over(ii, j, mm, m), np.inf, v)
                k = int(v.argmin())
                if v.flat[k] < best:
                    best, arg = float(v.flat[k]), (k // (m - 1) + 1, k % (m - 1) + 1)
            A[j, m], choice[j, m] = best, arg
    stages: list[tuple[int, int, int]] = []
    if not np.isfinite(A[L, workers]):
        return stages
    end, left = L, workers
    while end > 0:
        start, r = (int(x) for x in choice[end, left])
        stages.append((start, end, r))
        end, left = start, left - r
    return stages[::-1]


class PipeDreamDPPlanner(Planner):
    """PipeDream's DP assuming identical workers; the real cost model judges its plans."""

    name = "pipedream_dp"
    Config = PipeDreamConfig
    config: PipeDreamConfig

    def search(self, problem: Problem, search: Search) -> None:
        tb, cluster = search.evaluator.tables, problem.cluster
        t = tb.type_index[assumed_type(problem, self.config.assume)]
        net = cluster.links
        link = net.intra_node if len(cluster.nodes) == 1 else net.inter_node
        N = len(cluster.device_ids)
        params = np.diff(tb.params_prefix)
        acts = np.concatenate(
            [[0.0], np.cumsum([x.activation_bytes for x in problem.profile.layers])]
        )
        workers = range(1, N + 1) if problem.objective is Objective.COST else range(N, N + 1)
        B = problem.global_batch
        for b in problem.microbatch_sizes():
            fwd = rules.compute_s(tb.fwd_fixed[t], tb.fwd_per_sample[t], b)
            per_layer = rules.compute_s(fwd + tb.bwd_fixed[t], tb.bwd_per_sample[t], b)
            comm = rules.transfer_s(tb.cuts * b, link.bytes_per_s, link.latency_s)
            held = rules.held_microbatches(Schedule.GPIPE, b, B, 0)
            memory = StageMemory(tb.params_prefix, acts, tb.dev_capacity, b, float(held))
            plans: dict[int, list[tuple[list[tuple[int, int, int]], int]]] = {}
            for m in workers:
                stages = pipedream_partition(per_layer, params, comm, m, link.bytes_per_s, memory)
                if stages:
                    plans.setdefault(len(stages), []).append((stages, b))
                if search.exhausted():
                    break
            for S in sorted(plans):
                search.evaluate(_batch(plans[S], S))
            if search.exhausted():
                return


def _batch(plans: list[tuple[list[tuple[int, int, int]], int]], S: int) -> PlanBatch:
    """Stages onto devices in cluster order: stage 0 takes the first replicas, and so on."""
    R = max(r for stages, _ in plans for _, _, r in stages)
    dev = np.full((len(plans), S, R), -1, dtype=np.int64)
    bounds = np.zeros((len(plans), S + 1), dtype=np.int64)
    mb = np.zeros((len(plans), S), dtype=np.int64)
    for p, (stages, b) in enumerate(plans):
        first = 0
        for s, (start, end, r) in enumerate(stages):
            dev[p, s, :r] = np.arange(first, first + r)
            bounds[p, s], bounds[p, s + 1] = start, end
            first += r
        mb[p] = b
    return PlanBatch(bounds, mb, dev)
