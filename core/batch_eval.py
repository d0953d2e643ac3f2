"""The cost model over a population of plans at once (TiDGAP's vectorised fitness).

Plans of one population share the stage count ``S``, the global batch and the schedule; they
are held as arrays (:class:`PlanBatch`) and costed by :class:`BatchEvaluator` with numpy
operations over the population, looping only over stages and microbatch indices. Results
agree with :func:`core.costmodel.simulate` to 1e-9 relative (tested with hypothesis).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core import rules
from core.cluster import ClusterSpec
from core.errors import PlanError
from core.objective import SECONDS_PER_HOUR
from core.plan import Plan, Schedule, Stage
from core.profile import ModelProfile
from core.schedules import (
    microbatch_count,
    population_warmups,
    stage_orders,
    upstream_microbatch,
)
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

    def _stage_times(self, batch: PlanBatch, samples: IntArray) -> tuple[FloatArray, FloatArray]:
        """Rule 2: (P, S) forward and backward time of each stage, slowest replica, for a
        microbatch of ``samples`` (P, S) samples."""
        tb = self.tables
        start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
        valid = batch.devices >= 0
        n = samples / valid.sum(-1)
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
        _check_batch(batch, len(self.profile), global_batch)
        tb, B = self.tables, global_batch
        mb = batch.microbatch
        m = microbatch_count(B, mb)
        n_last = B - (m - 1) * mb  # samples of each stage's last microbatch
        fwd, bwd = self._stage_times(batch, mb)
        fwd_last, bwd_last = self._stage_times(batch, n_last)
        lat, bps, rlat, rbps = self._links(batch)
        x = tb.cuts[batch.bounds[:, 1:-1]]  # (P, S-1) bytes per sample at each cut
        b, nl = mb.astype(np.float64), n_last.astype(np.float64)
        start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
        valid = batch.devices >= 0
        dev = np.where(valid, batch.devices, 0)
        params = tb.params(start, end)
        update = rules.update_s(params, np.where(valid, tb.dev_membw[dev], np.inf).min(-1))
        accumulation = rules.accumulation_s(update, m)
        times = _Times(
            fwd=(fwd, fwd_last),
            bwd=(bwd + accumulation, bwd_last + accumulation),
            down=(
                rules.transfer_s(x * b[:, :-1], bps, lat),
                rules.transfer_s(x * nl[:, :-1], bps, lat),
            ),
            up=(
                rules.transfer_s(x * b[:, 1:], bps, lat),
                rules.transfer_s(x * nl[:, 1:], bps, lat),
            ),
        )
        warmups = np.zeros(mb.shape, dtype=np.int64)
        if schedule is Schedule.GPIPE:
            last = _gpipe(times, mb, m, B)
        else:
            last = np.zeros(fwd.shape)
            sizes, group = np.unique(mb, axis=0, return_inverse=True)
            for g, key in enumerate(sizes):
                rows = np.flatnonzero(group.reshape(-1) == g)
                last[rows] = _one_f_one_b(times.rows(rows), tuple(int(v) for v in key), B)
            warmups = population_warmups(mb, B)
        r = valid.sum(-1)
        batch_time = (last + update + rules.allreduce_s(params, r, rbps, rlat)).max(-1)
        held = rules.held_microbatches(schedule, b, B, warmups)
        memory = rules.memory_bytes(params, tb.acts(start, end), b / r, held)
        capacity = np.where(valid, tb.dev_capacity[dev], np.inf).min(-1)
        ratio = (memory / capacity).max(-1)
        price = np.where(valid, tb.dev_price[dev], 0.0).sum((-1, -2))
        return BatchResult(batch_time, (memory <= capacity).all(-1), ratio, price, global_batch)


Pair = tuple[FloatArray, FloatArray]
"""A duration for a full microbatch and for the stage's last one (the remainder)."""


@dataclass(frozen=True)
class _Times:
    """Op and send durations: each a pair (full microbatch, last microbatch) of (P, S)
    arrays (``down``/``up``: (P, S-1), one send across cut ``s`` forward / backward)."""

    fwd: Pair
    bwd: Pair
    down: Pair
    up: Pair

    def rows(self, rows: IntArray) -> _Times:
        def cut(p: Pair) -> Pair:
            return p[0][rows], p[1][rows]

        return _Times(cut(self.fwd), cut(self.bwd), cut(self.down), cut(self.up))


def _pick(pair: Pair, s: int, final: np.ndarray) -> FloatArray:
    """Column ``s`` of the full or the last microbatch's durations, per plan."""
    return np.where(final, pair[1][:, s], pair[0][:, s])


def _send(ready: FloatArray, link_free: FloatArray, cost: FloatArray) -> FloatArray:
    return np.maximum(ready, link_free) + cost


def _gpipe(times: _Times, mb: IntArray, m: IntArray, B: int) -> FloatArray:
    """GPipe with per-stage microbatches: forward sweep down the stages, backward sweep up.

    ``mb`` samples per microbatch, ``m`` microbatches (P, S), the last one of each stage
    holding the remainder of ``B``. Returns (P, S): the end of each stage's last backward.
    """
    fwd_end, free = _gpipe_forwards(times, mb, m, B)
    return _gpipe_backwards(times, mb, m, B, fwd_end, free)


def _gpipe_forwards(
    times: _Times, mb: IntArray, m: IntArray, B: int
) -> tuple[FloatArray, FloatArray]:
    """(S, P, max M) end of every forward, and (S, P) when each stage's last one ends."""
    P, S = mb.shape
    rows = np.arange(P)
    mmax = int(m.max())
    fwd_end = np.zeros((S, P, mmax))
    delivered = np.zeros((S, P, mmax))
    free = np.zeros((S, P))
    for s in range(S):
        link_free, t = np.zeros(P), np.zeros(P)
        for j in range(mmax):
            act = j < m[:, s]
            final = j == m[:, s] - 1
            dep: FloatArray | float = 0.0
            if s:
                k = np.minimum(upstream_microbatch(j, mb[:, s], mb[:, s - 1], B), mmax - 1)
                dep = delivered[s - 1, rows, k]
            end = np.maximum(t, dep) + _pick(times.fwd, s, final)
            t = np.where(act, end, t)
            fwd_end[s, :, j] = end
            if s < S - 1:
                sent = _send(end, link_free, _pick(times.down, s, final))
                link_free = np.where(act, sent, link_free)
                delivered[s, :, j] = sent
        free[s] = t
    return fwd_end, free


def _gpipe_backwards(
    times: _Times,
    mb: IntArray,
    m: IntArray,
    B: int,
    fwd_end: FloatArray,
    free: FloatArray,
) -> FloatArray:
    """(P, S) end of each stage's last backward, after its forwards (``free``)."""
    P, S = mb.shape
    rows = np.arange(P)
    mmax = int(m.max())
    grads = np.zeros((S, P, mmax))
    last = np.zeros((P, S))
    for s in range(S - 1, -1, -1):
        link_free, t = np.zeros(P), free[s]
        for j in range(mmax):
            act = j < m[:, s]
            final = j == m[:, s] - 1
            dep = fwd_end[s, :, j]
            if s < S - 1:
                k = np.minimum(upstream_microbatch(j, mb[:, s], mb[:, s + 1], B), mmax - 1)
                dep = np.maximum(dep, grads[s + 1, rows, k])
            end = np.maximum(t, dep) + _pick(times.bwd, s, final)
            t = np.where(act, end, t)
            if s:
                sent = _send(end, link_free, _pick(times.up, s - 1, final))
                link_free = np.where(act, sent, link_free)
                grads[s, :, j] = sent
        last[:, s] = t
    return last


def _one_f_one_b(times: _Times, mb: tuple[int, ...], B: int) -> FloatArray:
    """1F1B for plans sharing the per-stage microbatch sizes ``mb``: ops in one
    dependency-respecting order (the same for all of them)."""
    P, S = times.fwd[0].shape
    m = [microbatch_count(B, b) for b in mb]
    mmax = max(m)
    fwd_end = np.zeros((S, mmax, P))
    delivered = np.zeros((S, mmax, P))
    grads = np.zeros((S, mmax, P))
    free = np.zeros((S, P))
    fwd_link, grad_link = np.zeros((S, P)), np.zeros((S, P))
    for s, kind, j, k in _topological_ops(mb, B):
        f = int(j == m[s] - 1)
        if kind == "F":
            dep = delivered[s - 1, k] if s else 0.0
            end = np.maximum(free[s], dep) + times.fwd[f][:, s]
            fwd_end[s, j] = end
            if s < S - 1:
                fwd_link[s] = _send(end, fwd_link[s], times.down[f][:, s])
                delivered[s, j] = fwd_link[s]
        else:
            dep = np.maximum(fwd_end[s, j], grads[s + 1, k]) if s < S - 1 else fwd_end[s, j]
            end = np.maximum(free[s], dep) + times.bwd[f][:, s]
            if s:
                grad_link[s] = _send(end, grad_link[s], times.up[f][:, s - 1])
                grads[s, j] = grad_link[s]
        free[s] = end
    return free.T.copy()


@functools.lru_cache(maxsize=1024)
def _topological_ops(mb: tuple[int, ...], B: int) -> list[tuple[int, str, int, int]]:
    """All 1F1B ops of all stages in an order where every dependency comes first, as
    ``(stage, "F"|"B", j, k)``: ``k`` the neighbour's microbatch the op waits for (rule 6)."""
    S = len(mb)
    orders = stage_orders(Schedule.ONE_F_ONE_B, mb, B)
    pos = [0] * S
    done: set[tuple[int, str, int]] = set()
    out: list[tuple[int, str, int, int]] = []
    total = sum(len(o) for o in orders)
    while len(out) < total:
        progressed = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                kind, j = orders[s][pos[s]]
                t = s - 1 if kind == "F" else s + 1
                k = upstream_microbatch(j, mb[s], mb[t], B) if 0 <= t < S else -1
                if 0 <= t < S and (t, kind, k) not in done:
                    break
                done.add((s, kind, j))
                out.append((s, kind, j, k))
                pos[s] += 1
                progressed = True
        if not progressed:  # pragma: no cover - rule 5's warm-ups cannot deadlock
            raise RuntimeError(f"1f1b schedule of microbatches {mb} deadlocked at {pos}")
    return out


def _check_batch(batch: PlanBatch, n_layers: int, global_batch: int) -> None:
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
    if (batch.microbatch < 1).any() or (batch.microbatch > global_batch).any():
        raise PlanError(f"population.microbatch: must be in [1, global_batch {global_batch}]")
    if ((batch.devices >= 0).sum(-1) == 0).any():
        raise PlanError("population.devices: every stage needs >= 1 device")
