"""The cost model over a population of plans at once (TiDGAP's vectorised fitness).

Plans of one population share the stage count ``S``, the global batch and the schedule; they
are held as arrays (:class:`PlanBatch`) and costed by :class:`BatchEvaluator` with numpy
operations over the population, looping only over stages and microbatch indices. Results
agree with :func:`core.costmodel.simulate` to 1e-9 relative (tested with hypothesis).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.cluster import ClusterSpec
from core.costmodel import cut_bytes, layer_costs
from core.errors import PlanError
from core.plan import Plan, Schedule, Stage
from core.profile import ModelProfile
from core.schedules import stage_order

IntArray = np.ndarray
FloatArray = np.ndarray


@dataclass(frozen=True)
class PlanBatch:
    """``P`` plans with ``S`` stages each.

    bounds: (P, S+1) stage boundaries, ``bounds[:, 0] == 0``, increasing.
    microbatch: (P, S) samples per microbatch of each stage.
    devices: (P, S, R) indices into ``cluster.device_ids``; ``-1`` pads unused replica slots.
    """

    bounds: IntArray
    microbatch: IntArray
    devices: IntArray

    @property
    def size(self) -> int:
        return int(self.bounds.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.bounds.shape[1] - 1)

    @classmethod
    def from_plans(cls, plans: Sequence[Plan], cluster: ClusterSpec) -> PlanBatch:
        if not plans:
            raise PlanError("plans: empty population")
        S = plans[0].num_stages
        if any(p.num_stages != S for p in plans):
            raise PlanError(
                f"plans: a population needs one stage count, got "
                f"{sorted({p.num_stages for p in plans})}"
            )
        index = {d: i for i, d in enumerate(cluster.device_ids)}
        R = max(st.replicas for p in plans for st in p.stages)
        bounds = np.array([[0] + [st.end for st in p.stages] for p in plans], dtype=np.int64)
        mb = np.array([[st.microbatch for st in p.stages] for p in plans], dtype=np.int64)
        dev = np.full((len(plans), S, R), -1, dtype=np.int64)
        for i, p in enumerate(plans):
            p.validate(cluster=cluster)
            for s, st in enumerate(p.stages):
                dev[i, s, : st.replicas] = [index[d] for d in st.devices]
        return cls(bounds, mb, dev)

    def plan(
        self, i: int, cluster: ClusterSpec, global_batch: int, schedule: Schedule = Schedule.GPIPE
    ) -> Plan:
        ids = cluster.device_ids
        stages = tuple(
            Stage(
                (int(self.bounds[i, s]), int(self.bounds[i, s + 1])),
                tuple(ids[d] for d in self.devices[i, s] if d >= 0),
                int(self.microbatch[i, s]),
            )
            for s in range(self.num_stages)
        )
        return Plan(global_batch, stages, schedule)


@dataclass(frozen=True)
class BatchResult:
    """Per-plan results, each an array of length P."""

    batch_time_s: FloatArray
    fits: np.ndarray
    memory_ratio: FloatArray  # worst memory / capacity over the plan's devices
    cost_per_hour: FloatArray
    global_batch: int

    @property
    def throughput(self) -> FloatArray:
        with np.errstate(divide="ignore"):
            return self.global_batch / self.batch_time_s

    @property
    def cost_per_batch(self) -> FloatArray:
        return self.cost_per_hour * self.batch_time_s / 3600.0

    @property
    def cost_per_sample(self) -> FloatArray:
        return self.cost_per_batch / self.global_batch


class BatchEvaluator:
    """Precomputed tables for one profile on one cluster; :meth:`evaluate` costs populations."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec) -> None:
        self.profile, self.cluster = profile, cluster
        types = sorted(cluster.device_types)
        tindex = {t: i for i, t in enumerate(types)}
        devs = [cluster.device(d) for d in cluster.device_ids]
        nodes = {n.name: i for i, n in enumerate(cluster.nodes)}
        self.dev_type = np.array([tindex[d.type] for d in devs], dtype=np.int64)
        self.dev_node = np.array([nodes[d.node] for d in devs], dtype=np.int64)
        dts = [cluster.device_types[d.type] for d in devs]
        self.dev_membw = np.array([t.memory_bandwidth_gbps for t in dts])
        self.dev_capacity = np.array([t.memory_bytes for t in dts])
        self.dev_price = np.array([t.price_per_hour for t in dts])
        costs = [layer_costs(profile, cluster.device_types[t]) for t in types]
        # (T, L+1, L+1) range sums: table[t, a, b] = sum over layers a..b-1
        self.fwd_fixed = np.stack([_range_sums(c.fwd_fixed) for c in costs])
        self.fwd_ps = np.stack([_range_sums(c.fwd_per_sample) for c in costs])
        self.bwd_fixed = np.stack([_range_sums(c.bwd_fixed) for c in costs])
        self.bwd_ps = np.stack([_range_sums(c.bwd_per_sample) for c in costs])
        self.params = _range_sums(np.array([float(x.params_bytes) for x in profile.layers]))
        self.acts = _range_sums(np.array([float(x.activation_bytes) for x in profile.layers]))
        self.cuts = cut_bytes(profile)
        net = cluster.network
        self.link_lat = np.array([net.intra_node.latency_s, net.inter_node.latency_s])
        self.link_bps = np.array([net.intra_node.bytes_per_s, net.inter_node.bytes_per_s])

    # --- per stage quantities --------------------------------------------------------------

    def _stage_times(self, batch: PlanBatch) -> tuple[FloatArray, FloatArray]:
        """Rule 2: (P, S) forward and backward time of each stage, slowest replica."""
        start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
        valid = batch.devices >= 0
        n = batch.microbatch / valid.sum(-1)
        fwd = np.zeros(start.shape)
        bwd = np.zeros(start.shape)
        for k in range(batch.devices.shape[2]):
            ok = valid[:, :, k]
            t = self.dev_type[np.where(ok, batch.devices[:, :, k], 0)]
            f = self.fwd_fixed[t, start, end] + n * self.fwd_ps[t, start, end]
            b = self.bwd_fixed[t, start, end] + n * self.bwd_ps[t, start, end]
            fwd = np.where(ok, np.maximum(fwd, f), fwd)
            bwd = np.where(ok, np.maximum(bwd, b), bwd)
        return fwd, bwd

    def _node_span(self, batch: PlanBatch) -> tuple[IntArray, IntArray]:
        """(P, S) lowest and highest node index among each stage's replicas."""
        valid = batch.devices >= 0
        node = self.dev_node[np.where(valid, batch.devices, 0)]
        big = np.iinfo(np.int64).max
        return np.where(valid, node, big).min(-1), np.where(valid, node, -1).max(-1)

    # --- the whole model -------------------------------------------------------------------

    def evaluate(
        self, batch: PlanBatch, global_batch: int, schedule: Schedule = Schedule.GPIPE
    ) -> BatchResult:
        """Batch time, memory fit and price of every plan of the population."""
        _check_batch(batch, len(self.profile), global_batch, schedule)
        S = batch.num_stages
        fwd, bwd = self._stage_times(batch)
        lo, hi = self._node_span(batch)
        cross = np.maximum(hi[:, :-1], hi[:, 1:]) != np.minimum(lo[:, :-1], lo[:, 1:])
        lat, bps = self.link_lat[cross.astype(int)], self.link_bps[cross.astype(int)]
        x = self.cuts[batch.bounds[:, 1:-1]]  # (P, S-1) bytes per sample at each cut
        b = batch.microbatch.astype(np.float64)
        m = global_batch // batch.microbatch
        start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
        valid = batch.devices >= 0
        dev = np.where(valid, batch.devices, 0)
        params = self.params[start, end]
        membw = np.where(valid, self.dev_membw[dev], np.inf).min(-1)
        update = 4.0 * params / (membw * 1e9)
        bwd = bwd + (m - 1) / m * update  # rule 2: gradient accumulation
        if schedule is Schedule.GPIPE:
            last = _gpipe(fwd, bwd, x, lat, bps, b, m)
        else:
            last = np.zeros(fwd.shape)
            for mm in np.unique(m[:, 0]):
                rows = np.flatnonzero(m[:, 0] == mm)
                last[rows] = _one_f_one_b(
                    fwd[rows], bwd[rows], x[rows], lat[rows], bps[rows], b[rows], int(mm)
                )
        r = valid.sum(-1)
        rep_cross = (hi != lo).astype(int)
        rlat, rbps = self.link_lat[rep_cross], self.link_bps[rep_cross]
        allreduce = np.where(r > 1, 2 * (r - 1) / r * params / rbps + 2 * (r - 1) * rlat, 0.0)
        batch_time = (last + update + allreduce).max(-1)
        in_flight = m if schedule is Schedule.GPIPE else np.minimum(S - np.arange(S), m)
        memory = 4.0 * params + in_flight * (b / r) * self.acts[start, end]
        capacity = np.where(valid, self.dev_capacity[dev], np.inf).min(-1)
        ratio = (memory / capacity).max(-1)
        price = np.where(valid, self.dev_price[dev], 0.0).sum((-1, -2))
        return BatchResult(batch_time, (memory <= capacity).all(-1), ratio, price, global_batch)


def _range_sums(values: FloatArray) -> FloatArray:
    """``out[a, b] = values[a] + ... + values[b-1]`` summed left to right (0 when b <= a)."""
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for e in range(1, n + 1):
        out[:e, e] = out[:e, e - 1] + values[e - 1]
    return out


def _send(ready: FloatArray, link_free: FloatArray, cost: FloatArray) -> FloatArray:
    return np.maximum(ready, link_free) + cost


def _gpipe(
    fwd: FloatArray,
    bwd: FloatArray,
    x: FloatArray,
    lat: FloatArray,
    bps: FloatArray,
    b: FloatArray,
    m: IntArray,
) -> FloatArray:
    """GPipe with per-stage microbatches: forward sweep down the stages, backward sweep up.

    Returns (P, S): the end of each stage's last backward.
    """
    P, S = fwd.shape
    rows = np.arange(P)
    mmax = int(m.max())
    fwd_end = np.zeros((S, P, mmax))
    delivered = np.zeros((S, P, mmax))
    free = np.zeros((S, P))
    for s in range(S):
        link_free, t = np.zeros(P), np.zeros(P)
        cost = lat[:, s] + x[:, s] * b[:, s] / bps[:, s] if s < S - 1 else None
        for j in range(mmax):
            act = j < m[:, s]
            dep: FloatArray | float = 0.0
            if s:
                k = np.minimum(-(-(j + 1) * b[:, s] // b[:, s - 1]).astype(np.int64) - 1, mmax - 1)
                dep = delivered[s - 1, rows, k]
            end = np.maximum(t, dep) + fwd[:, s]
            t = np.where(act, end, t)
            fwd_end[s, :, j] = end
            if cost is not None:
                sent = _send(end, link_free, cost)
                link_free = np.where(act, sent, link_free)
                delivered[s, :, j] = sent
        free[s] = t
    grads = np.zeros((S, P, mmax))
    last = np.zeros((P, S))
    for s in range(S - 1, -1, -1):
        link_free, t = np.zeros(P), free[s]
        cost = lat[:, s - 1] + x[:, s - 1] * b[:, s] / bps[:, s - 1] if s else None
        for j in range(mmax):
            act = j < m[:, s]
            dep = fwd_end[s, :, j]
            if s < S - 1:
                k = np.minimum(-(-(j + 1) * b[:, s] // b[:, s + 1]).astype(np.int64) - 1, mmax - 1)
                dep = np.maximum(dep, grads[s + 1, rows, k])
            end = np.maximum(t, dep) + bwd[:, s]
            t = np.where(act, end, t)
            if cost is not None:
                sent = _send(end, link_free, cost)
                link_free = np.where(act, sent, link_free)
                grads[s, :, j] = sent
        last[:, s] = t
    return last


def _one_f_one_b(
    fwd: FloatArray,
    bwd: FloatArray,
    x: FloatArray,
    lat: FloatArray,
    bps: FloatArray,
    b: FloatArray,
    m: int,
) -> FloatArray:
    """1F1B with equal microbatches and ``m`` of them: ops in one dependency-respecting order."""
    P, S = fwd.shape
    fwd_end = np.zeros((S, m, P))
    delivered = np.zeros((S, m, P))
    grads = np.zeros((S, m, P))
    free = np.zeros((S, P))
    fwd_link, grad_link = np.zeros((S, P)), np.zeros((S, P))
    for s, kind, j in _topological_ops(S, m):
        if kind == "F":
            dep = delivered[s - 1, j] if s else 0.0
            end = np.maximum(free[s], dep) + fwd[:, s]
            fwd_end[s, j] = end
            if s < S - 1:
                fwd_link[s] = _send(end, fwd_link[s], lat[:, s] + x[:, s] * b[:, s] / bps[:, s])
                delivered[s, j] = fwd_link[s]
        else:
            dep = np.maximum(fwd_end[s, j], grads[s + 1, j]) if s < S - 1 else fwd_end[s, j]
            end = np.maximum(free[s], dep) + bwd[:, s]
            if s:
                cost = lat[:, s - 1] + x[:, s - 1] * b[:, s] / bps[:, s - 1]
                grad_link[s] = _send(end, grad_link[s], cost)
                grads[s, j] = grad_link[s]
        free[s] = end
    return free.T.copy()


def _topological_ops(S: int, m: int) -> list[tuple[int, str, int]]:  # (stage, "F"|"B", j)
    """All 1F1B ops of all stages in an order where every dependency comes first."""
    orders = [stage_order(Schedule.ONE_F_ONE_B, m, s, S) for s in range(S)]
    pos = [0] * S
    done: set[tuple[int, str, int]] = set()
    out: list[tuple[int, str, int]] = []
    while len(out) < 2 * S * m:
        for s in range(S):
            while pos[s] < len(orders[s]):
                kind, j = orders[s][pos[s]]
                need = (
                    (s - 1, "F", j)
                    if kind == "F" and s
                    else (s + 1, "B", j)
                    if kind == "B" and s < S - 1
                    else None
                )
                if need is not None and need not in done:
                    break
                done.add((s, kind, j))
                out.append((s, kind, j))
                pos[s] += 1
    return out


def _check_batch(batch: PlanBatch, n_layers: int, global_batch: int, schedule: Schedule) -> None:
    if (
        batch.bounds.ndim != 2
        or batch.microbatch.shape != (batch.size, batch.num_stages)
        or batch.devices.shape[:2] != (batch.size, batch.num_stages)
    ):
        raise PlanError(
            f"population: inconsistent shapes bounds {batch.bounds.shape}, "
            f"microbatch {batch.microbatch.shape}, devices {batch.devices.shape}"
        )
    if (batch.bounds[:, 0] != 0).any() or (batch.bounds[:, -1] != n_layers).any():
        raise PlanError(f"population.bounds: must run from 0 to {n_layers} layers")
    if (np.diff(batch.bounds, axis=1) <= 0).any():
        raise PlanError("population.bounds: every stage needs >= 1 layer")
    if (batch.microbatch < 1).any() or (global_batch % batch.microbatch).any():
        raise PlanError(f"population.microbatch: must divide global_batch {global_batch}")
    if ((batch.devices >= 0).sum(-1) == 0).any():
        raise PlanError("population.devices: every stage needs >= 1 device")
    if schedule is Schedule.ONE_F_ONE_B and (batch.microbatch != batch.microbatch[:, :1]).any():
        raise PlanError("population.microbatch: 1f1b needs equal microbatches per plan")
