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

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PlanError
from pipeplan.core.objective import SECONDS_PER_HOUR
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.core.schedules import (
    microbatch_count,
    population_warmups,
    stage_orders,
    upstream_microbatch,
)
from pipeplan.core.tables import CostTables

IntArray = np.ndarray
FloatArray = np.ndarray

CHUNK = 1024
"""Plans costed together: a population's (J, P) arrays of that many plans stay in the CPU's
caches (about 3x the plans per second of one 10,000-plan pass on the benchmark's case)."""


@dataclass(frozen=True)
class PlanBatch:
    """``P`` plans with ``S`` stages each.

    bounds: (P, S+1) stage boundaries, ``bounds[:, 0] == 0``, increasing.
    microbatch: (P, S) samples per microbatch of each stage.
    devices: (P, S, R) indices into ``cluster.device_ids``; ``-1`` pads unused replica slots.
    recompute: (P, S) whether each stage recomputes its activations (rules 2r and 9r of
    :mod:`core.costmodel`); None: no stage does.
    """

    bounds: IntArray
    microbatch: IntArray
    devices: IntArray
    recompute: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.bounds.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.bounds.shape[1] - 1)

    def rows(self, which: slice | IntArray) -> PlanBatch:
        """The plans ``which`` of the population."""
        recompute = None if self.recompute is None else self.recompute[which]
        return PlanBatch(self.bounds[which], self.microbatch[which], self.devices[which], recompute)

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
        recompute = None
        if any(p.recomputing for p in plans):
            recompute = np.array([[st.recompute for st in p.stages] for p in plans], dtype=bool)
        return cls(bounds, mb, dev, recompute)

    def plan(
        self, i: int, cluster: ClusterSpec, global_batch: int, schedule: Schedule = Schedule.GPIPE
    ) -> Plan:
        ids = cluster.device_ids
        stages = tuple(
            Stage(
                (int(self.bounds[i, s]), int(self.bounds[i, s + 1])),
                tuple(ids[d] for d in self.devices[i, s] if d >= 0),
                int(self.microbatch[i, s]),
                self.recompute is not None and bool(self.recompute[i, s]),
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
    recompute_ratio: FloatArray | None = None
    """The worst memory / capacity with each stage recomputing or not, whichever holds less
    (rules 9 and 9r): at most 1 where recomputation would make the plan fit."""

    @property
    def throughput(self) -> FloatArray:
        with np.errstate(divide="ignore", over="ignore"):  # a zero or subnormal time: inf
            return self.global_batch / self.batch_time_s

    @property
    def cost_per_batch(self) -> FloatArray:
        return self.cost_per_hour * self.batch_time_s / SECONDS_PER_HOUR

    @property
    def cost_per_sample(self) -> FloatArray:
        return self.cost_per_batch / self.global_batch


class BatchEvaluator:
    """Costs populations of plans of one profile on one cluster from its :class:`CostTables`.

    GPipe is vectorised over the population and, per stage, over the microbatches (TiDGAP's
    two levels): a stage's ops form the max-plus recurrence ``t_j = max(t_{j-1}, ready_j) +
    d_j``, whose durations are equal but for the last microbatch's, so every end is a
    cumulative maximum (:func:`_scan`). ``over_microbatches=False`` walks the microbatch
    indices one at a time instead (the evaluator before issue #16: a cross-check, and the
    benchmark's baseline). 1F1B walks its ops in one dependency order per group of plans
    sharing their microbatch sizes.
    """

    def __init__(
        self, profile: ModelProfile, cluster: ClusterSpec, over_microbatches: bool = True
    ) -> None:
        self.profile, self.cluster = profile, cluster
        self.tables = tb = CostTables.of(profile, cluster)
        self.over_microbatches = over_microbatches
        # rule 1's four range sums side by side, one row per (type, start, end): one gather
        # per replica slot instead of four
        self._ranges = np.stack(
            [
                tb.fwd_fixed_range,
                tb.fwd_per_sample_range,
                tb.bwd_fixed_range,
                tb.bwd_per_sample_range,
            ],
            axis=-1,
        ).reshape(-1, 4)

    # --- per stage quantities --------------------------------------------------------------

    def _stage_times(
        self, batch: PlanBatch, r: IntArray, samples: Sequence[IntArray]
    ) -> list[tuple[FloatArray, FloatArray]]:
        """Rule 2: (P, S) forward and backward time of each stage, slowest replica, for a
        microbatch of each ``samples`` (P, S) count; ``r`` (P, S) replicas, replica slot ``k``
        costed for its own share (rule 2i); a recomputing stage's backward (rule 2r) is each
        replica's forward plus its backward."""
        tb = self.tables
        side = len(self.profile) + 1
        span = batch.bounds[:, :-1] * side + batch.bounds[:, 1:]
        out: list[tuple[FloatArray, FloatArray]] = []
        for k in range(batch.devices.shape[2]):
            shares = [rules.replica_samples(n, r, k) for n in samples]
            ok = batch.devices[:, :, k] >= 0
            t = tb.dev_type[np.where(ok, batch.devices[:, :, k], 0)]
            sums = np.take(self._ranges, t * (side * side) + span, axis=0)
            ff, fp, bf, bp = sums[..., 0], sums[..., 1], sums[..., 2], sums[..., 3]
            for i, n in enumerate(shares):
                f, b = rules.compute_s(ff, fp, n), rules.compute_s(bf, bp, n)
                if batch.recompute is not None:
                    b = np.where(batch.recompute, rules.recompute_backward_s(f, b), b)
                if k == 0:  # every stage has its first replica slot
                    out.append((f, b))
                else:
                    fwd, bwd = out[i]
                    out[i] = (
                        np.where(ok, np.maximum(fwd, f), fwd),
                        np.where(ok, np.maximum(bwd, b), bwd),
                    )
        return out

    def _links(
        self, batch: PlanBatch, valid: np.ndarray, dev: IntArray
    ) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """Rule 4: (P, S-1) latency and bytes/s between consecutive stages, and rule 8: (P, S)
        the ring rounds' among each stage's replicas (its all-reduce), from the span of their
        nodes."""
        tb = self.tables
        node = tb.dev_node[dev]
        lo = _over_replicas(np.minimum, np.where(valid, node, np.iinfo(np.int64).max))
        hi = _over_replicas(np.maximum, np.where(valid, node, -1))
        cross = (np.maximum(hi[:, :-1], hi[:, 1:]) != np.minimum(lo[:, :-1], lo[:, 1:])).astype(int)
        inside = (hi != lo).astype(int)
        return tb.link_lat[cross], tb.link_bps[cross], tb.ring_lat[inside], tb.ring_bps[inside]

    # --- the whole model -------------------------------------------------------------------

    def evaluate(
        self, batch: PlanBatch, global_batch: int, schedule: Schedule = Schedule.GPIPE
    ) -> BatchResult:
        """Batch time, memory fit and price of every plan of the population, costed
        :data:`CHUNK` plans at a time (arrays that stay in the CPU's caches)."""
        _check_batch(batch, len(self.profile), global_batch)
        if batch.size <= CHUNK:
            return self._evaluate(batch, global_batch, schedule)
        parts = [
            self._evaluate(batch.rows(slice(a, a + CHUNK)), global_batch, schedule)
            for a in range(0, batch.size, CHUNK)
        ]
        return BatchResult(
            np.concatenate([p.batch_time_s for p in parts]),
            np.concatenate([p.fits for p in parts]),
            np.concatenate([p.memory_ratio for p in parts]),
            np.concatenate([p.cost_per_hour for p in parts]),
            global_batch,
            np.concatenate([p.recompute_ratio for p in parts if p.recompute_ratio is not None]),
        )

    def _evaluate(self, batch: PlanBatch, global_batch: int, schedule: Schedule) -> BatchResult:
        tb, B = self.tables, global_batch
        mb = batch.microbatch
        m = microbatch_count(B, mb)
        n_last = B - (m - 1) * mb  # samples of each stage's last microbatch
        valid = batch.devices >= 0
        dev = np.where(valid, batch.devices, 0)
        r = _over_replicas(np.add, valid.astype(np.int64))
        remainder = bool((n_last != mb).any())
        times_of = self._stage_times(batch, r, [mb, n_last] if remainder else [mb])
        (fwd, bwd), (fwd_last, bwd_last) = times_of[0], times_of[-1]
        lat, bps, rlat, rbps = self._links(batch, valid, dev)
        x = tb.cuts[batch.bounds[:, 1:-1]]  # (P, S-1) bytes per sample at each cut
        b = mb.astype(np.float64)
        start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
        params = tb.params(start, end)
        update = rules.update_s(
            params, _over_replicas(np.minimum, np.where(valid, tb.dev_membw[dev], np.inf))
        )
        last, warmups = stage_ends(
            (fwd, fwd_last),
            (bwd, bwd_last),
            rules.accumulation_s(update, m),
            (x, bps, lat),
            mb,
            B,
            schedule,
            self.over_microbatches,
        )
        batch_time = (last + update + rules.allreduce_s(params, r, rbps, rlat)).max(-1)
        batch_time = batch_time + tb.step_overhead  # rule 8c
        held = rules.held_microbatches(schedule, b, B, warmups)
        acts, share = tb.acts(start, end), rules.replica_share(b, r)
        plain = memory = rules.memory_bytes(params, acts, share, held)
        recomputed = rules.recompute_memory_bytes(params, tb.cuts[start], acts, share, held)
        if batch.recompute is not None:  # rule 9r
            memory = np.where(batch.recompute, recomputed, plain)
        capacity = _over_replicas(np.minimum, np.where(valid, tb.dev_capacity[dev], np.inf))
        ratio = (memory / capacity).max(-1)
        least = (np.minimum(plain, recomputed) / capacity).max(-1)
        price = _over_replicas(np.add, np.where(valid, tb.dev_price[dev], 0.0)).sum(-1)
        fits = (memory <= capacity).all(-1)
        return BatchResult(batch_time, fits, ratio, price, global_batch, least)


def stage_ends(
    fwd: Pair,
    bwd: Pair,
    accumulation: FloatArray,
    cuts: tuple[FloatArray, FloatArray, FloatArray],
    mb: IntArray,
    B: int,
    schedule: Schedule,
    over_microbatches: bool = True,
) -> tuple[FloatArray, IntArray]:
    """Rules 2b and 4-7 over a population: (P, S) the end of each stage's last backward, and
    (P, S) the 1F1B warm-ups (zeros under GPipe). ``fwd`` and ``bwd``: (P, S) op times of a
    full microbatch and of each stage's last one, before rule 2b's ``accumulation``; ``cuts``:
    (P, S-1) bytes per sample at each cut, and its link's bytes/s and latency. Shared by the
    device-level evaluator and the kind-level one (:mod:`core.kind_tables`)."""
    m = microbatch_count(B, mb)
    n_last = B - (m - 1) * mb
    remainder = bool((n_last != mb).any())
    x, bps, lat = cuts
    b, nl = mb.astype(np.float64), n_last.astype(np.float64)
    down = rules.transfer_s(x * b[:, :-1], bps, lat)
    up = rules.transfer_s(x * b[:, 1:], bps, lat)
    full = bwd[0] + accumulation
    times = _Times(
        fwd=fwd,
        bwd=(full, bwd[1] + accumulation if remainder else full),
        down=(down, rules.transfer_s(x * nl[:, :-1], bps, lat) if remainder else down),
        up=(up, rules.transfer_s(x * nl[:, 1:], bps, lat) if remainder else up),
    )
    warmups = np.zeros(mb.shape, dtype=np.int64)
    if schedule is Schedule.GPIPE:
        if over_microbatches:
            return _gpipe_scan(times, mb, m, B, remainder), warmups
        return _gpipe(times, mb, m, B), warmups
    last = np.zeros(fwd[0].shape)
    sizes, group = np.unique(mb, axis=0, return_inverse=True)
    for g, key in enumerate(sizes):
        rows = np.flatnonzero(group.reshape(-1) == g)
        last[rows] = _one_f_one_b(times.rows(rows), tuple(int(v) for v in key), B)
    return last, population_warmups(mb, B)


def _over_replicas(op: np.ufunc, a: np.ndarray) -> np.ndarray:
    """``op`` folded over the last (replica) axis, one slot at a time: numpy's reductions
    over a short last axis cost several times more than these few element-wise calls."""
    out = a[..., 0]
    for k in range(1, a.shape[-1]):
        out = op(out, a[..., k])
    return out


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
            final = np.equal(j, m[:, s] - 1)
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
            final = np.equal(j, m[:, s] - 1)
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


def _scan(
    ready: FloatArray, step: Pair, last: IntArray, remainder: bool, start: FloatArray | float = 0.0
) -> FloatArray:
    """(J, P) ends of ``t_j = max(t_{j-1}, ready_j) + d_j`` for ``j < J``, ``t_{-1} = start``:
    one stage's ops, or one link's sends, in order (``ready``: (J, P), overwritten). ``d_j``
    is ``step[0]`` except for ``j = last`` (the stage's last microbatch: ``step[1]``). With
    equal steps the recurrence is ``t_j = (j + 1) d + max(start, max_{i <= j} (ready_i - i
    d))``: a cumulative maximum over the microbatches. Entries past ``last`` are not the
    stage's ops (they are never read)."""
    d, d_last = step
    J, P = ready.shape
    jd = np.multiply(np.arange(J, dtype=np.float64)[:, None], d)
    ready -= jd
    np.maximum(ready[0], start, out=ready[0])
    for i in range(1, J):  # the cumulative maximum, row by row (contiguous rows of P)
        np.maximum(ready[i - 1], ready[i], out=ready[i])
    ready += jd
    ready += d
    if remainder:
        cols = np.arange(P)
        ready[last, cols] += d_last - d
    return ready


def _gpipe_scan(
    times: _Times, mb: IntArray, m: IntArray, B: int, remainder: bool = True
) -> FloatArray:
    """:func:`_gpipe`, vectorised over the microbatches of each stage as well (:func:`_scan`,
    on (J, P) arrays): a forward sweep down the stages, then a backward sweep up."""
    P, S = mb.shape
    J = int(m.max())
    cols, j = np.arange(P), np.arange(J)[:, None]
    final = m - 1

    def gather(a: FloatArray, s: int, other: int) -> FloatArray:
        """``a[k, p]`` for rule 6's neighbour microbatch ``k`` of every ``(j, p)``."""
        if (mb[:, s] == mb[:, other]).all():
            return a.copy()
        # ceil(min((j+1) b_s, B) / b_other) - 1 in floats: exact for these integer sizes
        end = np.minimum((j + 1.0) * mb[:, s], float(B))
        k = np.minimum(np.ceil(end / mb[:, other]) - 1, J - 1).astype(np.int64)
        return np.take(a, k * P + cols)  # a[k[j, p], p]

    fwd_end: list[FloatArray] = []
    delivered = np.zeros((J, P))
    for s in range(S):
        ready = gather(delivered, s, s - 1) if s else np.zeros((J, P))
        pair = (times.fwd[0][:, s], times.fwd[1][:, s])
        fwd_end.append(_scan(ready, pair, final[:, s], remainder))
        if s < S - 1:
            send = (times.down[0][:, s], times.down[1][:, s])
            delivered = _scan(fwd_end[s].copy(), send, final[:, s], remainder)
    last = np.zeros((P, S))
    grads = np.zeros((J, P))
    for s in range(S - 1, -1, -1):
        if s < S - 1:
            ready = gather(grads, s, s + 1)
            np.maximum(ready, fwd_end[s], out=ready)
        else:
            ready = fwd_end[s].copy()
        free = fwd_end[s][final[:, s], cols]
        pair = (times.bwd[0][:, s], times.bwd[1][:, s])
        ends = _scan(ready, pair, final[:, s], remainder, free)
        last[:, s] = ends[final[:, s], cols]
        if s:
            send = (times.up[0][:, s - 1], times.up[1][:, s - 1])
            grads = _scan(ends, send, final[:, s], remainder)
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
    if batch.recompute is not None and batch.recompute.shape != batch.microbatch.shape:
        raise PlanError(
            f"population.recompute: shape {batch.recompute.shape}, expected "
            f"{batch.microbatch.shape} (one flag per plan and stage)"
        )
