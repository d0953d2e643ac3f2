"""Kind-level costing: plans whose stages are named by kind, costed without their devices.

Devices of one type are interchangeable, and so are nodes of one shape. The cost model reads
a stage's devices only through their type (rule 1's times, rule 8u's update bandwidth, rule
9's capacity, rule 10's price), their number (rule 2i's shares, rule 8's ring) and the nodes
they span (rule 4's link classes). A **kind-level plan** therefore says, per stage, its
layer range, microbatch size, device type, replica count and node count -- not which
devices. For **node-exclusive** stages (no node holds two stages: how the catalogue planners
make a plan concrete, each stage on the next free nodes of its kind) every cut between two
stages crosses nodes, and a stage's all-reduce stays inside a node exactly when it sits on
one node. :func:`evaluate_kinds` costs such plans from :class:`~core.tables.CostTables` with
the population evaluator's schedules, so its answer is the cost model's answer for any
concrete node-exclusive plan of those kinds (tested against :func:`core.costmodel.simulate`).

A stage's replicas are all of one type, so its slowest replica is the first one, whose share
is the largest (rule 2i): a stage's op times are read once, not once per replica.
A stage may recompute its activations (``recompute``, rules 2r and 9r): its backward is its
first replica's forward plus backward of its share, and its memory holds its inputs per
held microbatch and one microbatch's activations, as :mod:`core.costmodel` costs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.core import rules
from pipeplan.core.batch_eval import BatchResult, stage_ends
from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Schedule
from pipeplan.core.schedules import microbatch_count
from pipeplan.core.tables import INTER, INTRA, CostTables

IntArray = np.ndarray
FloatArray = np.ndarray


@dataclass(frozen=True)
class KindBatch:
    """``P`` kind-level plans of ``S`` node-exclusive stages each.

    bounds: (P, S+1) stage boundaries, ``bounds[:, 0] == 0``, increasing to the layer count.
    microbatch: (P, S) samples per microbatch of each stage.
    type_index: (P, S) each stage's device type, into :attr:`CostTables.types`.
    replicas: (P, S) devices of each stage.
    nodes: (P, S) nodes each stage's devices sit on (``1 <= nodes <= replicas``).
    recompute: (P, S) bool, whether each stage recomputes its activations (rules 2r and 9r);
    ``None``: no stage does.
    """

    bounds: IntArray
    microbatch: IntArray
    type_index: IntArray
    replicas: IntArray
    nodes: IntArray
    recompute: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.bounds.shape[0])


def evaluate_kinds(
    tables: CostTables, batch: KindBatch, global_batch: int, schedule: Schedule = Schedule.GPIPE
) -> BatchResult:
    """Batch time, memory fit and price of every kind-level plan of ``batch`` (see the module
    docstring): the cost model's figures for the plans made concrete on node-exclusive
    devices of those types."""
    _check(tables, batch, global_batch)
    B, mb, r = global_batch, batch.microbatch, batch.replicas
    cluster = tables.cluster
    membw = np.array([cluster.memory_bandwidth_gbps(t) for t in tables.types])
    capacity = np.array([cluster.device_types[t].memory_bytes for t in tables.types])
    price = np.array([cluster.device_types[t].price_per_hour for t in tables.types])
    m = microbatch_count(B, mb)
    n_last = B - (m - 1) * mb
    t, start, end = batch.type_index, batch.bounds[:, :-1], batch.bounds[:, 1:]
    fwd, bwd = _op_times(tables, t, start, end, rules.replica_samples(mb, r, 0))
    fwd_last, bwd_last = _op_times(tables, t, start, end, rules.replica_samples(n_last, r, 0))
    if batch.recompute is not None:  # rule 2r
        bwd = np.where(batch.recompute, rules.recompute_backward_s(fwd, bwd), bwd)
        bwd_last = np.where(
            batch.recompute, rules.recompute_backward_s(fwd_last, bwd_last), bwd_last
        )
    params = tables.params(start, end)
    update = rules.update_s(params, membw[t])
    cuts = (tables.cuts[batch.bounds[:, 1:-1]], tables.link_bps[INTER], tables.link_lat[INTER])
    accumulation = rules.accumulation_s(update, m)
    last, warmups = stage_ends(
        (fwd, fwd_last), (bwd, bwd_last), accumulation, cuts, mb, B, schedule
    )
    ring = np.where(batch.nodes > 1, INTER, INTRA)
    allreduce = rules.allreduce_s(params, r, tables.ring_bps[ring], tables.ring_lat[ring])
    batch_time = (last + update + allreduce).max(-1) + tables.step_overhead
    b = mb.astype(np.float64)
    held = rules.held_microbatches(schedule, b, B, warmups)
    acts, share = tables.acts(start, end), rules.replica_share(b, r)
    plain = memory = rules.memory_bytes(params, acts, share, held)
    recomputed = rules.recompute_memory_bytes(params, tables.cuts[start], acts, share, held)
    if batch.recompute is not None:  # rule 9r
        memory = np.where(batch.recompute, recomputed, plain)
    cap = capacity[t]
    return BatchResult(
        batch_time,
        (memory <= cap).all(-1),
        (memory / cap).max(-1),
        (r * price[t]).sum(-1),
        global_batch,
        (np.minimum(plain, recomputed) / cap).max(-1),
    )


def _op_times(
    tables: CostTables, t: IntArray, start: IntArray, end: IntArray, share: IntArray
) -> tuple[FloatArray, FloatArray]:
    """Rules 1, 1c and 2: (P, S) forward and backward times of each stage's busiest replica,
    which computes ``share`` samples."""
    fwd = rules.compute_s(
        tables.fwd_fixed_range[t, start, end], tables.fwd_per_sample_range[t, start, end], share
    )
    bwd = rules.compute_s(
        tables.bwd_fixed_range[t, start, end], tables.bwd_per_sample_range[t, start, end], share
    )
    return fwd, bwd


def _check(tables: CostTables, batch: KindBatch, global_batch: int) -> None:
    """A clear error for a batch the model cannot cost, naming the field and the value."""
    P, S = batch.microbatch.shape
    for name in ("type_index", "replicas", "nodes"):
        shape = getattr(batch, name).shape
        if shape != (P, S):
            raise PlanError(f"kind plans.{name}: shape {shape}, expected {(P, S)}")
    if batch.recompute is not None:
        if batch.recompute.shape != (P, S):
            raise PlanError(
                f"kind plans.recompute: shape {batch.recompute.shape}, expected {(P, S)}"
            )
        if batch.recompute.dtype != np.bool_:
            raise PlanError(f"kind plans.recompute: expected bools, got {batch.recompute.dtype}")
    if batch.bounds.shape != (P, S + 1):
        raise PlanError(f"kind plans.bounds: shape {batch.bounds.shape}, expected {(P, S + 1)}")
    L = len(tables.profile)
    if (batch.bounds[:, 0] != 0).any() or (batch.bounds[:, -1] != L).any():
        raise PlanError(f"kind plans.bounds: must run from 0 to the {L} layers")
    if (np.diff(batch.bounds, axis=1) < 1).any():
        raise PlanError("kind plans.bounds: every stage needs at least one layer")
    bad = [
        (name, int(getattr(batch, name).min()), low)
        for name, low in (("microbatch", 1), ("replicas", 1), ("nodes", 1))
        if (getattr(batch, name) < low).any()
    ]
    if bad:
        name, value, low = bad[0]
        raise PlanError(f"kind plans.{name}: must be >= {low}, got {value}")
    if (batch.microbatch > global_batch).any():
        raise PlanError(
            f"kind plans.microbatch: {int(batch.microbatch.max())} exceeds the global batch "
            f"{global_batch}"
        )
    if (batch.nodes > batch.replicas).any():
        raise PlanError("kind plans.nodes: a stage spans more nodes than it has replicas")
    T = len(tables.types)
    if ((batch.type_index < 0) | (batch.type_index >= T)).any():
        raise PlanError(
            f"kind plans.type_index: {int(batch.type_index.max())} is not a type of "
            f"{list(tables.types)}"
        )
