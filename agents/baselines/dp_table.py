"""The table of ``dp`` (see :mod:`agents.baselines.dp` for what it minimises).

State of the suffix DP (1F1B memory depends on the stages *after* a stage, ``min(S - s, M)``
microbatches in flight, so it runs from the last layer backwards)::

    V[i, u, g, q, b] = least bottleneck of layers [i, L) in q stages using exactly the device
                       counts u (per class: one type on one node), whose first stage sits on
                       node g (or on several nodes), with microbatch size b

A stage that does not fit in memory on its type is not allowed. Every finite ``V[0, u, ., q,
b]`` gives a candidate: the best plan with exactly those devices, stage count and microbatch
size. Candidates are ranked by the bottleneck (``cost``: price x bottleneck, dropping those
whose ``overlap`` bound already misses ``min_throughput`` -- exact, the bound is optimistic;
price depends on ``u`` only, so this is the exact DP for price x bottleneck under the
throughput constraint) and simulated through ``search.evaluate``, which picks the plan.

Complexity, per model: ``(L+1) P G Q k`` table entries, ``P = prod over classes (count + 1)``,
``G = nodes + 2``, ``Q = min(L, devices) + 1``, ``k`` microbatch sizes; for each layer ``i``
and each replica choice (``C = sum over types of prod over its nodes (count + 1) - 1``) one
numpy operation over ``O(L P G Q k)`` entries: ``O(L^2 C P G Q k)`` time, ``16 (L+1) P G Q k``
bytes. Refused beyond ``max_states`` entries (timings: ``bench/results/plan_quality/``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from itertools import product

import numpy as np

from pipeplan.agents.baselines.brute import device_classes
from pipeplan.agents.problem import Problem, ProblemError
from pipeplan.core import rules
from pipeplan.core.tables import INTER, INTRA, CostTables

FloatArray = np.ndarray


class Space(StrEnum):
    """Which table ``dp`` fills."""

    AUTO = "auto"  # the device-level table when it has at most max_states entries, else kinds
    DEVICES = "devices"  # the device-level table (refused beyond max_states)
    KINDS = "kinds"  # node kinds and counts (agents.baselines.dp_kinds)


class StageModel(StrEnum):
    """How a stage's time counts its transfers (see the module docstring)."""

    OVERLAP = "overlap"  # max of stages and links: a lower bound on the batch time
    SERIAL = "serial"  # each stage plus its outgoing transfers


@dataclass(frozen=True)
class DPConfig:
    """Options of ``dp``."""

    max_states: int = 4_000_000
    """Refuse instances whose DP table has more entries than this."""
    max_replicas: int | None = None
    """At most this many devices per stage; None: no cap."""
    models: tuple[StageModel, ...] = (StageModel.OVERLAP, StageModel.SERIAL)
    """Bottleneck models to optimise; the candidates of all are simulated."""
    space: Space = Space.AUTO
    """The device-level table, or node kinds and counts (``auto``: kinds only where the
    device-level table has more than ``max_states`` entries)."""
    simulated: int = 16
    """Kind-level search: its best plans by kind-level cost made concrete and evaluated."""

    def __post_init__(self) -> None:
        try:
            models = tuple(StageModel(m) for m in self.models)
        except ValueError:
            raise ProblemError(
                f"dp.models: expected some of {[m.value for m in StageModel]}, got "
                f"{list(self.models)}"
            ) from None
        if not models:
            raise ProblemError("dp.models: empty; name at least one bottleneck model")
        object.__setattr__(self, "models", models)
        try:
            object.__setattr__(self, "space", Space(self.space))
        except ValueError:
            raise ProblemError(
                f"dp.space: expected one of {[m.value for m in Space]}, got {self.space!r}"
            ) from None
        if self.simulated < 1:
            raise ProblemError(f"dp.simulated: must be >= 1, got {self.simulated}")
        if self.max_states < 1:
            raise ProblemError(f"dp.max_states: must be >= 1, got {self.max_states}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ProblemError(f"dp.max_replicas: must be >= 1, got {self.max_replicas}")


@dataclass(frozen=True)
class Choice:
    """Devices of one stage: how many of each class (all of one type)."""

    type_index: int  # into sorted(cluster.device_types), the evaluator's order
    delta: tuple[int, ...]  # devices per class
    replicas: int
    node: int  # node index when all on one node, else MULTI


@dataclass(frozen=True)
class Candidate:
    """The DP's best plan for one (devices used, stage count, microbatch size)."""

    model: StageModel
    bound: float  # the bottleneck in that model (for OVERLAP a lower bound on the batch time)
    price: float  # per hour
    bounds: tuple[int, ...]
    devices: tuple[tuple[int, ...], ...]  # per stage, indices into cluster.device_ids
    microbatch: int


def table_size(problem: Problem) -> int:
    """Entries of the device-level table of ``problem`` (module docstring), counted without
    building anything."""
    cluster = problem.cluster
    L = len(problem.profile)
    P = math.prod(c.count + 1 for c in device_classes(cluster))
    Q = min(L, len(cluster.device_ids)) + 1
    return (L + 1) * P * (len(cluster.nodes) + 2) * Q * len(problem.microbatch_sizes())


class BottleneckDP:
    """The table and its candidates for one problem (see the module docstring)."""

    def __init__(self, problem: Problem, tables: CostTables, config: DPConfig) -> None:
        self.problem, self.tables = problem, tables
        cluster = problem.cluster
        self.classes = device_classes(cluster)
        self.types = sorted(cluster.device_types)
        self.nodes = [n.name for n in cluster.nodes]
        self.MULTI, self.NONE = len(self.nodes), len(self.nodes) + 1
        self.G = len(self.nodes) + 2
        self.L = len(problem.profile)
        self.S_max = min(self.L, len(cluster.device_ids))
        self.Q = self.S_max + 1
        self.sizes = np.asarray(problem.microbatch_sizes(), dtype=np.float64)
        self.M = problem.global_batch / self.sizes
        radix = [c.count + 1 for c in self.classes]
        self.P = math.prod(radix)  # counted before anything is built: a catalogue's is huge
        self.states = table_size(problem)
        if self.states > config.max_states:
            raise ProblemError(
                f"dp: the table for {problem.profile.name!r} ({self.L} layers) on cluster "
                f"{cluster.name!r} has {self.states:,} entries ({self.L + 1} layer prefixes x "
                f"{self.P:,} device-count vectors x {self.G} node states x {self.Q} stage counts "
                f"x {len(self.sizes)} microbatch sizes), more than max_states "
                f"{config.max_states:,}: fix the microbatch count, use fewer layers, raise "
                "max_states, or search by kind (space: kinds)"
            )
        self.used = np.array(list(product(*(range(r) for r in radix))), dtype=np.int64)
        self.stride = np.array(
            [math.prod(radix[k + 1 :]) for k in range(len(radix))], dtype=np.int64
        )
        self.choices = self._choices(config.max_replicas)

    def _choices(self, max_replicas: int | None) -> list[Choice]:
        out = []
        for t, name in enumerate(self.types):
            ks = [k for k, c in enumerate(self.classes) if c.type == name]
            for counts in product(*(range(self.classes[k].count + 1) for k in ks)):
                r = sum(counts)
                if r == 0 or (max_replicas is not None and r > max_replicas):
                    continue
                delta = [0] * len(self.classes)
                for k, n in zip(ks, counts, strict=True):
                    delta[k] = n
                on = {self.classes[k].node for k, n in zip(ks, counts, strict=True) if n}
                node = self.nodes.index(on.pop()) if len(on) == 1 else self.MULTI
                out.append(Choice(t, tuple(delta), r, node))
        return out

    # --- costs ------------------------------------------------------------------------------

    def _links(self) -> FloatArray:
        """(L+1, G, G, k): link cost at the cut before layer j, stage on g then on f."""
        tb, b = self.tables, self.sizes
        out = np.zeros((self.L + 1, self.G, self.G, len(b)))
        g = np.arange(self.G)
        cross = (g[:, None] != g[None, :]) | (g[:, None] == self.MULTI) | (g == self.MULTI)
        lat, bps = (
            tb.link_lat[cross.astype(int)][..., None],
            tb.link_bps[cross.astype(int)][..., None],
        )
        for j in range(1, self.L):
            out[j] = self.M * rules.transfer_s(tb.cuts[j] * b, bps, lat)
        return out

    def _busy(self, i: int, c: Choice) -> FloatArray:
        """(J, Q, k): busy time of a stage [i, j) for j = i+1..L, by stages from it to the
        end (1F1B memory); inf where it does not fit in memory."""
        tb, b, M = self.tables, self.sizes, self.M
        t, r = c.type_index, c.replicas
        jj = np.arange(i + 1, self.L + 1)
        n = rules.replica_share(b, r)
        f = rules.compute_s(
            tb.fwd_fixed_range[t, i, jj][:, None], tb.fwd_per_sample_range[t, i, jj][:, None], n
        )
        bk = rules.compute_s(
            tb.bwd_fixed_range[t, i, jj][:, None], tb.bwd_per_sample_range[t, i, jj][:, None], n
        )
        cluster = self.problem.cluster
        dtype = cluster.device_types[self.types[t]]
        params = tb.params(i, jj)
        update = rules.update_s(params, cluster.memory_bandwidth_gbps(self.types[t]))
        cls = INTER if c.node == self.MULTI else INTRA
        allreduce = rules.allreduce_s(params, r, tb.ring_bps[cls], tb.ring_lat[cls])
        bk = bk + rules.accumulation_s(update[:, None], M)
        busy = M * (f + bk) + (update + allreduce)[:, None]
        q = np.arange(self.Q)[:, None]  # stages from this one to the end
        held = np.broadcast_to(rules.in_flight(self.problem.schedule, M, q), (self.Q, len(b)))
        acts = tb.acts(i, jj)[:, None, None]
        memory = rules.memory_bytes(params[:, None, None], acts, n, held)
        return np.where(memory <= dtype.memory_bytes, busy[:, None, :], np.inf)

    # --- the table --------------------------------------------------------------------------

    def run(self, model: StageModel) -> None:
        L, P, G, Q, k = self.L, self.P, self.G, self.Q, len(self.sizes)
        self.V = np.full((L + 1, P, G, Q, k), np.inf)
        self.V[L, 0, self.NONE, 0] = 0.0
        self.par_choice = np.full((L + 1, P, G, Q, k), -1, dtype=np.int32)
        self.par_jf = np.zeros((L + 1, P, G, Q, k), dtype=np.int32)
        links = self._links()
        counts = np.array([c.count for c in self.classes], dtype=np.int64)
        moves = []
        for c in self.choices:
            d = np.asarray(c.delta, dtype=np.int64)
            src = np.flatnonzero((self.used + d <= counts).all(-1))
            moves.append((src, src + int(d @ self.stride)))
        for i in range(L - 1, -1, -1):
            for ci, c in enumerate(self.choices):
                src, dst = moves[ci]
                if not len(src):
                    continue
                busy = self._busy(i, c)[:, 1:, :]  # target q' = q + 1 for q = 0..Q-2
                prev = self.V[i + 1 :, src][:, :, :, : Q - 1, :]  # (J, Us, G, Q-1, k)
                link = links[i + 1 :, c.node][:, None, :, None, :]  # (J, 1, G, 1, k)
                if model is StageModel.SERIAL:
                    cand = np.maximum(prev, busy[:, None, None, :, :] + link)
                else:
                    cand = np.maximum(np.maximum(prev, busy[:, None, None, :, :]), link)
                J = cand.shape[0]
                flat = cand.transpose(1, 3, 4, 0, 2).reshape(len(src), Q - 1, k, J * G)
                arg = flat.argmin(-1)
                best = np.take_along_axis(flat, arg[..., None], -1)[..., 0]
                here = self.V[i, dst, c.node, 1:, :]
                better = best < here
                self.V[i, dst, c.node, 1:, :] = np.where(better, best, here)
                pc = self.par_choice[i, dst, c.node, 1:, :]
                self.par_choice[i, dst, c.node, 1:, :] = np.where(better, ci, pc)
                pj = self.par_jf[i, dst, c.node, 1:, :]
                self.par_jf[i, dst, c.node, 1:, :] = np.where(better, arg, pj)

    # --- answers ----------------------------------------------------------------------------

    def candidates(self, model: StageModel) -> list[Candidate]:
        """The best plan for every (devices used, stage count, microbatch size) that fits,
        from the table :meth:`run` filled for ``model``."""
        top = self.V[0]  # (P, G, Q, k)
        g_best = top.argmin(1)  # (P, Q, k)
        prices = self._prices()
        out = []
        for u, q, bi in zip(*np.nonzero(np.isfinite(top.min(1))), strict=True):
            g = int(g_best[u, q, bi])
            out.append(self._rebuild(model, int(u), g, int(q), int(bi), float(prices[u])))
        return out

    def _prices(self) -> FloatArray:
        cluster = self.problem.cluster
        per_class = np.array([cluster.device_types[c.type].price_per_hour for c in self.classes])
        return self.used @ per_class

    def _rebuild(
        self, model: StageModel, u: int, g: int, q: int, bi: int, price: float
    ) -> Candidate:
        bound = float(self.V[0, u, g, q, bi])
        i, bounds, devices = 0, [0], []
        taken = [0] * len(self.classes)
        while i < self.L:
            c = self.choices[int(self.par_choice[i, u, g, q, bi])]
            jf = int(self.par_jf[i, u, g, q, bi])
            j, f = i + 1 + jf // self.G, jf % self.G
            stage: list[int] = []
            for k, n in enumerate(c.delta):
                stage += self.classes[k].devices[taken[k] : taken[k] + n]
                taken[k] += n
            devices.append(tuple(stage))
            bounds.append(j)
            u -= int(np.dot(c.delta, self.stride))
            i, g, q = j, f, q - 1
        return Candidate(model, bound, price, tuple(bounds), tuple(devices), int(self.sizes[bi]))
