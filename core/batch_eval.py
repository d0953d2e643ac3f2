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

from core import rules
from core.cluster import ClusterSpec
from core.errors import PlanError
from core.objective import SECONDS_PER_HOUR
from core.plan import Plan, Schedule, Stage
from core.profile import ModelProfile
from core.schedules import stage_order, upstream_microbatch
from core.tables import CostTables

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
        return self.cost_per_hour * self.batch_time_s / SECONDS_PER_HOUR

    @property
    def cost_per_sample(self) -> FloatArray:
        return self.cost_per_batch / self.global_batch


class BatchEvaluator:
    """Costs populations of plans of one profile on one cluster from its :class:`CostTables`."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec) -> None:
        self.profile, self.cluster = profile, cluster
        self.tables = CostTables.of(profile, cluster)

    # --- per stage quantities --------------------------------------------------------------

    def _stage_times(self, batch: PlanBatch) -> tuple[FloatArray, FloatArray]:
        """Rule 2: (P, S) forward and backward time of each stage, slowest replica."""
        tb = self.tables
        start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
        valid = batch.devices >= 0
        n = batch.microbatch / valid.sum(-1)
        fwd = np.zeros(start.shape)
        bwd = np.zeros(start.shape)
        for k in range(batch.devices.shape[2]):
            ok = valid[:, :, k]
            t = tb.dev_type[np.where(ok, batch.devices[:, :, k], 0)]
            f = rules.compute_s(
                tb.fwd_fixed_range[t, start, end], tb.fwd_per_sample_range[t, start, end], n
            )
            b = rules.compute_s(
                tb.bwd_fixed_range[t, start, end], tb.bwd_per_sample_range[t, start, end], n
            )
            fwd = np.where(ok, np.maximum(fwd, f), fwd)
            bwd = np.where(ok, np.maximum(bwd, b), bwd)
        return fwd, bwd

    def _links(self, batch: PlanBatch) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """Rule 4: (P, S-1) latency and bytes/s between consecutive stages, and (P, S) those
        among each stage's replicas (its all-reduce), from the span of their nodes."""
        tb = self.tables
        valid = batch.devices >= 0
        node = tb.dev_node[np.where(valid, batch.devices, 0)]
        lo = np.where(valid, node, np.iinfo(np.int64).max).min(-1)
        hi = np.where(valid, node, -1).max(-1)
        cross = (np.maximum(hi[:, :-1], hi[:, 1:]) != np.minimum(lo[:, :-1], lo[:, 1:])).astype(int)
        inside = (hi != lo).astype(int)
        return tb.link_lat[cross], tb.link_bps[cross], tb.link_lat[inside], tb.link_bps[inside]

    # --- the whole model -------------------------------------------------------------------

    def evaluate(
        self, batch: PlanBatch, global_batch: int, schedule: Schedule = Schedule.GPIPE
    ) -> BatchResult:
        """Batch time, memory fit and price of every plan of the population."""
        _check_batch(batch, len(self.profile), global_batch, schedule)
        tb, S = self.tables, batch.num_stages
        fwd, bwd = self._stage_times(batch)
        lat, bps, rlat, rbps = self._links(batch)
        x = tb.cuts[batch.bounds[:, 1:-1]]  # (P, S-1) bytes per sample at each cut
        b = batch.microbatch.astype(np.float64)
        down = rules.transfer_s(x * b[:, :-1], bps, lat)  # (P, S-1) stage s's forward send
        up = rules.transfer_s(x * b[:, 1:], bps, lat)  # (P, S-1) stage s+1's gradient send
        m = global_batch // batch.microbatch
        start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
        valid = batch.devices >= 0
        dev = np.where(valid, batch.devices, 0)
        params = tb.params(start, end)
        update = rules.update_s(params, np.where(valid, tb.dev_membw[dev], np.inf).min(-1))
        bwd = bwd + rules.accumulation_s(update, m)
        if schedule is Schedule.GPIPE:
            last = _gpipe(fwd, bwd, down, up, b, m)
        else:
            last = np.zeros(fwd.shape)
            for mm in np.unique(m[:, 0]):
                rows = np.flatnonzero(m[:, 0] == mm)
                last[rows] = _one_f_one_b(fwd[rows], bwd[rows], down[rows], up[rows], int(mm))
        r = valid.sum(-1)
        batch_time = (last + update + rules.allreduce_s(params, r, rbps, rlat)).max(-1)
        batch_time = batch_time + tb.step_overhead  # rule 8c
        held = rules.in_flight(schedule, m, S - np.arange(S))
        memory = rules.memory_bytes(params, tb.acts(start, end), b / r, held)
        capacity = np.where(valid, tb.dev_capacity[dev], np.inf).min(-1)
        ratio = (memory / capacity).max(-1)
        price = np.where(valid, tb.dev_price[dev], 0.0).sum((-1, -2))
        return BatchResult(batch_time, (memory <= capacity).all(-1), ratio, price, global_batch)


def _send(ready: FloatArray, link_free: FloatArray, cost: FloatArray) -> FloatArray:
    return np.maximum(ready, link_free) + cost


def _gpipe(
    fwd: FloatArray, bwd: FloatArray, down: FloatArray, up: FloatArray, b: FloatArray, m: IntArray
) -> FloatArray:
    """GPipe with per-stage microbatches: forward sweep down the stages, backward sweep up.

    ``down[:, s]`` / ``up[:, s]``: one send across cut ``s`` forward / backward; ``b``
    samples per microbatch, ``m`` microbatches. Returns (P, S): the end of each stage's
    last backward.
    """
    fwd_end, free = _gpipe_forwards(fwd, down, b, m)
    return _gpipe_backwards(bwd, up, b, m, fwd_end, free)


def _gpipe_forwards(
    fwd: FloatArray, down: FloatArray, b: FloatArray, m: IntArray
) -> tuple[FloatArray, FloatArray]:
    """(S, P, max M) end of every forward, and (S, P) when each stage's last one ends."""
    P, S = fwd.shape
    rows = np.arange(P)
    mmax = int(m.max())
    fwd_end = np.zeros((S, P, mmax))
    delivered = np.zeros((S, P, mmax))
    free = np.zeros((S, P))
    for s in range(S):
        link_free, t = np.zeros(P), np.zeros(P)
        for j in range(mmax):
            act = j < m[:, s]
            dep: FloatArray | float = 0.0
            if s:
                k = np.minimum(
                    upstream_microbatch(j, b[:, s], b[:, s - 1]).astype(np.int64), mmax - 1
                )
                dep = delivered[s - 1, rows, k]
            end = np.maximum(t, dep) + fwd[:, s]
            t = np.where(act, end, t)
            fwd_end[s, :, j] = end
            if s < S - 1:
                sent = _send(end, link_free, down[:, s])
                link_free = np.where(act, sent, link_free)
                delivered[s, :, j] = sent
        free[s] = t
    return fwd_end, free


def _gpipe_backwards(
    bwd: FloatArray,
    up: FloatArray,
    b: FloatArray,
    m: IntArray,
    fwd_end: FloatArray,
    free: FloatArray,
) -> FloatArray:
    """(P, S) end of each stage's last backward, after its forwards (``free``)."""
    P, S = bwd.shape
    rows = np.arange(P)
    mmax = int(m.max())
    grads = np.zeros((S, P, mmax))
    last = np.zeros((P, S))
    for s in range(S - 1, -1, -1):
        link_free, t = np.zeros(P), free[s]
        for j in range(mmax):
            act = j < m[:, s]
            dep = fwd_end[s, :, j]
            if s < S - 1:
                k = np.minimum(
                    upstream_microbatch(j, b[:, s], b[:, s + 1]).astype(np.int64), mmax - 1
                )
                dep = np.maximum(dep, grads[s + 1, rows, k])
            end = np.maximum(t, dep) + bwd[:, s]
            t = np.where(act, end, t)
            if s:
                sent = _send(end, link_free, up[:, s - 1])
                link_free = np.where(act, sent, link_free)
                grads[s, :, j] = sent
        last[:, s] = t
    return last


def _one_f_one_b(
    fwd: FloatArray, bwd: FloatArray, down: FloatArray, up: FloatArray, m: int
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
                fwd_link[s] = _send(end, fwd_link[s], down[:, s])
                delivered[s, j] = fwd_link[s]
        else:
            dep = np.maximum(fwd_end[s, j], grads[s + 1, j]) if s < S - 1 else fwd_end[s, j]
            end = np.maximum(free[s], dep) + bwd[:, s]
            if s:
                grad_link[s] = _send(end, grad_link[s], up[:, s - 1])
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
