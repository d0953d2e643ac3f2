"""The catalogue seen by kind, and the cost of a stage staffed from it.

Identical nodes (a catalogue entry's ``count: N``, DESIGN.md) are interchangeable: which
``p4d`` a stage runs on changes nothing but names. The provisioning planners therefore reason
about **options** -- a device type on the nodes of one kind -- and **how many nodes** of it a
stage takes, never about individual devices; a plan is made concrete only at the end, each
stage taking the next free nodes of its kind (:meth:`Catalogue.devices`).

The space they share (``node-exclusive stages``): contiguous stages; a stage runs on every
device of one type on ``m`` whole nodes of one kind (``m x per_node`` replicas), no node
holds two stages; equal microbatches. Its **bottleneck** is the ``overlap`` model of
:mod:`agents.baselines.dp`: ``max(max_s W_s, max_s T_s)`` with a stage's busy time ``W_s = M
(F_s + Bk_s) + update_s + allreduce_s`` and a cut's transfer time ``T_s = M (latency + X_s b
/ bandwidth)``, a lower bound on the simulated batch time. Two stages are on different nodes,
so every cut is inter-node; a stage's all-reduce is intra-node when it takes one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.agents.problem import Problem
from pipeplan.agents.provision.rental import kind_of
from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.tables import INTER, INTRA, CostTables

FloatArray = np.ndarray


@dataclass(frozen=True)
class Option:
    """A way to staff a stage: the devices of ``type`` on nodes of kind ``kind``."""

    kind: int  # index into Catalogue.kinds
    type: str
    type_index: int  # into CostTables.types
    per_node: int  # devices of the type on one node of the kind
    node_price: float  # $ per hour of those devices on one node

    def label(self, catalogue: Catalogue) -> str:
        return f"{catalogue.kinds[self.kind]}/{self.type}"


@dataclass(frozen=True)
class Catalogue:
    """The kinds of a cluster (catalogue entries; a plain node is a kind of one node), how
    many nodes each has, its options, and every node's devices by type."""

    cluster: ClusterSpec
    kinds: tuple[str, ...]
    available: tuple[int, ...]  # nodes per kind
    options: tuple[Option, ...]
    nodes: tuple[tuple[int, ...], ...]  # per kind: node indices into cluster.nodes, in order

    @classmethod
    def of(cls, cluster: ClusterSpec, tables: CostTables) -> Catalogue:
        members: dict[str, list[int]] = {}
        for i, node in enumerate(cluster.nodes):
            members.setdefault(kind_of(node), []).append(i)
        kinds = tuple(members)
        options = []
        for k, kind in enumerate(kinds):
            first = cluster.nodes[members[kind][0]]
            for t in sorted(first.devices):
                c = first.devices[t]
                if c > 0:
                    price = c * cluster.device_types[t].price_per_hour
                    options.append(Option(k, t, tables.type_index[t], c, price))
        return cls(
            cluster,
            kinds,
            tuple(len(members[k]) for k in kinds),
            tuple(options),
            tuple(tuple(members[k]) for k in kinds),
        )

    def devices(self, stages: list[tuple[int, int]]) -> list[tuple[int, ...]]:
        """Device indices (into ``cluster.device_ids``) of stages given as ``(option, nodes)``:
        each takes the next free nodes of its kind, in the catalogue's order."""
        index = {d: i for i, d in enumerate(self.cluster.device_ids)}
        taken = [0] * len(self.kinds)
        out = []
        for o, m in stages:
            opt = self.options[o]
            picked = self.nodes[opt.kind][taken[opt.kind] : taken[opt.kind] + m]
            if len(picked) < m:
                raise ValueError(
                    f"{self.kinds[opt.kind]}: {taken[opt.kind] + m} nodes asked, "
                    f"{self.available[opt.kind]} in the catalogue"
                )
            taken[opt.kind] += m
            names = [self.cluster.nodes[n].name for n in picked]
            out.append(
                tuple(
                    index[f"{name}/{opt.type}:{c}"] for name in names for c in range(opt.per_node)
                )
            )
        return out


class StageCosts:
    """Busy times of stages and transfer times of cuts for one microbatch size (see the
    module docstring), from the problem's :class:`CostTables`.

    With ``recompute`` a stage that does not fit in memory as it is recomputes its
    activations (rules 2r and 9r) where that makes it fit: its busy time is then the
    recomputing one. Recomputation only adds time, so recomputing exactly where memory needs
    it is each stage's best choice; :meth:`recomputes` says where that is. Off, a stage that
    does not fit is ``inf`` (the provisioning planners' space)."""

    def __init__(
        self,
        problem: Problem,
        tables: CostTables,
        catalogue: Catalogue,
        b: int,
        recompute: bool = False,
    ):
        self.problem, self.tables, self.catalogue, self.b = problem, tables, catalogue, b
        self.recompute = recompute
        self.M = problem.global_batch // b
        self.L = len(problem.profile)
        inter = rules.transfer_s(tables.cuts * b, tables.link_bps[INTER], tables.link_lat[INTER])
        self.link = self.M * inter  # (L+1,): the cut before layer j, both directions alike
        self.link[0] = self.link[self.L] = 0.0

    def busy(self, i: int, o: int, stages_from_here: np.ndarray) -> FloatArray:
        """(J, m_max, Q): busy time of stage ``[i, j)`` for ``j = i+1 .. L`` on ``m = 1 ..
        available`` nodes of option ``o``, at ``q`` stages from it to the end (1F1B memory);
        ``inf`` where it does not fit in memory (recomputing, when on: the class docstring)."""
        jj = np.arange(i + 1, self.L + 1)
        m = np.arange(1, self.catalogue.available[self.catalogue.options[o].kind] + 1)
        busy, fits, busy_r, fits_r = self._stage(i, jj, o, m, np.asarray(stages_from_here))
        out = np.where(fits, busy, np.inf)
        if self.recompute:
            out = np.where(~fits & fits_r, busy_r, out)
        return out

    def recomputes(self, i: int, j: int, o: int, m: int, stages_from_here: int) -> bool:
        """Whether stage ``[i, j)`` on ``m`` nodes of option ``o``, at ``stages_from_here``
        stages from it to the end, recomputes under :meth:`busy`: recomputation is on and the
        stage does not fit in memory without it (whether it fits with it or not)."""
        _, fits, _, _ = self._stage(
            i, np.array([j]), o, np.array([m]), np.array([stages_from_here])
        )
        return self.recompute and not bool(fits[0, 0, 0])

    def _stage(
        self, i: int, jj: np.ndarray, o: int, m: np.ndarray, q: np.ndarray
    ) -> tuple[FloatArray, np.ndarray, FloatArray, np.ndarray]:
        """(J, m, Q) busy time and memory fit of stage ``[i, j)`` for each ``j`` of ``jj`` on
        each ``m`` nodes of option ``o`` at each ``q`` stages from here: as it is, then
        recomputing (rules 2r and 9r)."""
        tb, opt, M, b = self.tables, self.catalogue.options[o], self.M, self.b
        t = opt.type_index
        jj = jj[:, None]
        m = m[None, :]
        r = m * opt.per_node
        n = rules.replica_share(b, r)
        f = rules.compute_s(tb.fwd_fixed_range[t, i, jj], tb.fwd_per_sample_range[t, i, jj], n)
        bk = rules.compute_s(tb.bwd_fixed_range[t, i, jj], tb.bwd_per_sample_range[t, i, jj], n)
        cluster = self.problem.cluster
        dtype = cluster.device_types[opt.type]
        params = tb.params(i, jj)
        update = rules.update_s(params, cluster.memory_bandwidth_gbps(opt.type))
        cls = np.where(m == 1, INTRA, INTER)
        allreduce = rules.allreduce_s(params, r, tb.ring_bps[cls], tb.ring_lat[cls])
        accumulation = rules.accumulation_s(update, M)
        busy = M * (f + (bk + accumulation)) + (update + allreduce)
        busy_r = M * (f + (rules.recompute_backward_s(f, bk) + accumulation)) + (update + allreduce)
        q = q[None, None, :]
        held = np.broadcast_to(rules.in_flight(self.problem.schedule, M, q), q.shape)
        acts, share, p = tb.acts(i, jj)[..., None], n[..., None], params[..., None]
        plain = rules.memory_bytes(p, acts, share, held)
        recomputed = rules.recompute_memory_bytes(p, float(tb.cuts[i]), acts, share, held)
        shape = plain.shape
        return (
            np.broadcast_to(busy[..., None], shape),
            plain <= dtype.memory_bytes,
            np.broadcast_to(busy_r[..., None], shape),
            recomputed <= dtype.memory_bytes,
        )
