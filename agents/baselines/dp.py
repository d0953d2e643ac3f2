"""``dp``: an exact dynamic program for heterogeneous devices, on the steady-state bottleneck.

Space: contiguous stages; each stage on devices of ONE type -- any number of replicas of that
type, from any nodes that hold it (up to ``max_replicas``); devices may stay unused; equal
microbatches of one size from ``Problem.microbatch_sizes()``.

What the DP minimises, for each microbatch size ``b`` (``M = B / b`` microbatches), with a
stage's busy time ``W_s = M (F_s + Bk_s) + update_s + allreduce_s`` and a cut's transfer time
``T_s = M (latency + X_s b / bandwidth)`` (one direction: activations and gradients go on
separate directions and carry the same bytes with equal microbatches):

- ``overlap``: ``max(max_s W_s, max_s T_s)``, the busiest stage or link direction. The cost
  model runs each of these one piece at a time, so this is a lower bound on the plan's
  simulated batch time (:func:`bottleneck`, tested). It leaves out fill and drain, and on
  fast compute with slow links it happily cuts where the link is just as busy as a stage --
  the transfers then sit on the critical path;
- ``serial``: ``max_s (W_s + T_s)``, each stage also pays the transfer of its activations
  (the "F + B + boundary transfer" stage time). Not a bound; it shuns chatty cuts.

Each model has its exact optimum; both are run by default and the simulation chooses among
their candidates (either model wins some instances: ``bench/results/plan_quality.json``).

Link classes follow the cost model: a stage whose replicas span nodes all-reduces over the
inter-node class, and two consecutive stages talk intra-node only when both sit on one and the
same node -- so the state remembers the node of the next stage.

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
bytes. Refused beyond ``max_states`` entries (timings: ``bench/results/plan_quality.json``).

Limits: exact for the bottleneck, not for the batch time (the simulation adds fill, drain and
dependencies; it only chooses among the DP's candidates); no mixed-type stages (one fast and
one slow replica -- ``brute`` finds those); equal microbatches only; the table grows as the
product of the class sizes, so clusters of many distinct (node, type) classes are out of
reach (e.g. 9 classes of 2 devices: P = 19683).

So ``dp`` equals ``brute`` except where ``brute``'s optimum has a mixed-type stage, or where
the bottleneck optimum is not the simulated optimum (then ``brute``'s plan has a bottleneck
no better than the DP's in every model). :func:`explain_gap` says which applies to a given
plan, or that the DP missed a better bottleneck (a bug); the tests and
``bench/plan_quality.py`` hold every gap to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from itertools import product

import numpy as np

from agents.baselines.brute import DeviceClass, device_classes
from agents.problem import InfeasibleError, Objective, Problem, ProblemError
from agents.registry import Planner
from agents.search import Search
from core import rules
from core.batch_eval import BatchEvaluator, PlanBatch
from core.cluster import ClusterSpec
from core.costmodel import simulate
from core.plan import Plan
from core.profile import ModelProfile
from core.tables import INTER, INTRA, CostTables

FloatArray = np.ndarray


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


def bottleneck(
    plan: Plan,
    profile: ModelProfile,
    cluster: ClusterSpec,
    model: StageModel = StageModel.OVERLAP,
) -> float:
    """A plan's bottleneck in ``model``, from its Estimate; inf when it does not fit.

    ``overlap`` is a lower bound on ``simulate(plan).batch_time_s``: a stage runs its ops,
    update and all-reduce one at a time, and a link direction its sends.
    """
    est = simulate(plan, profile, cluster)
    if not est.fits:
        return float("inf")
    worst = 0.0
    for s, st in enumerate(est.stages):
        busy = st.microbatches * (st.forward_s + st.backward_s) + st.update_s + st.allreduce_s
        out = back = 0.0
        if s + 1 < plan.num_stages:
            nxt = est.stages[s + 1]
            link = cluster.link(st.devices, nxt.devices)
            out = st.microbatches * link.transfer_s(st.boundary_bytes * st.microbatch)
            back = nxt.microbatches * link.transfer_s(st.boundary_bytes * nxt.microbatch)
        if model is StageModel.SERIAL:
            worst = max(worst, busy + out)
        else:
            worst = max(worst, busy, out, back)
    return worst


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
        self.used = np.array(list(product(*(range(r) for r in radix))), dtype=np.int64)
        self.stride = np.array(
            [int(np.prod(radix[k + 1 :])) for k in range(len(radix))], dtype=np.int64
        )
        self.P = len(self.used)
        self.choices = self._choices(config.max_replicas)
        self.states = (self.L + 1) * self.P * self.G * self.Q * len(self.sizes)
        if self.states > config.max_states:
            raise ProblemError(
                f"dp: the table for {problem.profile.name!r} ({self.L} layers) on cluster "
                f"{cluster.name!r} has {self.states:,} entries ({self.L + 1} layer prefixes x "
                f"{self.P:,} device-count vectors x {self.G} node states x {self.Q} stage counts "
                f"x {len(self.sizes)} microbatch sizes), more than max_states "
                f"{config.max_states:,}: fix the microbatch count, use fewer layers, or raise "
                "max_states"
            )

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
        n = b / r
        f = rules.compute_s(
            tb.fwd_fixed_range[t, i, jj][:, None], tb.fwd_per_sample_range[t, i, jj][:, None], n
        )
        bk = rules.compute_s(
            tb.bwd_fixed_range[t, i, jj][:, None], tb.bwd_per_sample_range[t, i, jj][:, None], n
        )
        dtype = self.problem.cluster.device_types[self.types[t]]
        params = tb.params(i, jj)
        update = rules.update_s(params, dtype.memory_bandwidth_gbps)
        cls = INTER if c.node == self.MULTI else INTRA
        allreduce = rules.allreduce_s(params, r, tb.link_bps[cls], tb.link_lat[cls])
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


def memory_hint(problem: Problem, classes: list[DeviceClass]) -> str:
    """Why nothing fits: a layer whose memory alone beats every device type, if there is one."""
    profile, cluster = problem.profile, problem.cluster
    b = min(problem.microbatch_sizes())
    held = rules.in_flight(problem.schedule, problem.global_batch // b, 1)
    most = {t: sum(c.count for c in classes if c.type == t) for t in cluster.device_types}
    worst, where = 0.0, ""
    for layer in profile.layers:
        ratio = min(
            rules.memory_bytes(layer.params_bytes, layer.activation_bytes, b / r, held)
            / cluster.device_types[t].memory_bytes
            for t, r in most.items()
            if r
        )
        if ratio > worst:
            worst, where = ratio, layer.name
    if worst <= 1.0:
        return ""
    return (
        f"; layer {where!r} alone needs {worst:.2f}x the memory of the best device type for it "
        f"(microbatch {b})"
    )


class DPPlanner(Planner):
    """Exact bottleneck DP over one-type stages; the simulation picks among its candidates."""

    name = "dp"
    Config = DPConfig
    config: DPConfig

    def solve(self, problem: Problem, ev: BatchEvaluator) -> list[Candidate]:
        """Every candidate of the DP, for each configured model (see :class:`BottleneckDP`)."""
        dp = BottleneckDP(problem, ev.tables, self.config)
        out = []
        for model in self.config.models:
            dp.run(model)
            out += dp.candidates(model)
        return out

    def search(self, problem: Problem, search: Search) -> None:
        cands = self.solve(problem, search.evaluator)
        if not cands:
            raise InfeasibleError(
                f"dp on {problem.profile.name!r} / cluster {problem.cluster.name!r}: no plan "
                "with one device type per stage fits in memory for any microbatch size "
                f"{problem.microbatch_sizes()}"
                + memory_hint(problem, device_classes(problem.cluster))
            )
        ranked = _ranked(problem, cands)
        if not ranked:  # only when every candidate is an OVERLAP one that misses the target
            reach = max(problem.global_batch / c.bound for c in cands)
            raise InfeasibleError(
                f"dp on {problem.profile.name!r} / cluster {problem.cluster.name!r}: no plan "
                f"reaches min_throughput {problem.min_throughput:g} samples/s; even the "
                f"bottleneck bound of the fastest fitting plan allows only {reach:.4g} samples/s"
            )
        cands = ranked
        left = search.remaining_evaluations
        if left is not None:
            cands = cands[:left]
        by_stages: dict[int, list[Candidate]] = {}
        for c in cands:
            by_stages.setdefault(len(c.devices), []).append(c)
        for S in sorted(by_stages):
            search.evaluate(_batch(by_stages[S]))
            if search.exhausted():
                return


def _ranked(problem: Problem, cands: list[Candidate]) -> list[Candidate]:
    """Distinct plans, best first for the objective in each model, the models taking turns;
    drops sure misses of the throughput target (by the optimistic OVERLAP bound only)."""
    B, tp = problem.global_batch, problem.min_throughput
    if problem.objective is Objective.COST and tp:
        cands = [
            c
            for c in cands
            if c.model is not StageModel.OVERLAP or c.bound == 0 or B / c.bound >= tp
        ]

    def value(c: Candidate) -> tuple[float, float]:
        return (c.price * c.bound, c.bound) if problem.objective is Objective.COST else (c.bound, 0)

    per_model: dict[StageModel, list[Candidate]] = {}
    for c in cands:
        per_model.setdefault(c.model, []).append(c)
    rank = {
        id(c): (r, m)
        for m, group in enumerate(per_model.values())
        for r, c in enumerate(sorted(group, key=value))
    }
    out, seen = [], set()
    for c in sorted(cands, key=lambda c: rank[id(c)]):
        key = (c.bounds, c.devices, c.microbatch)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _batch(cands: list[Candidate]) -> PlanBatch:
    S = len(cands[0].devices)
    R = max(len(d) for c in cands for d in c.devices)
    dev = np.full((len(cands), S, R), -1, dtype=np.int64)
    for i, c in enumerate(cands):
        for s, d in enumerate(c.devices):
            dev[i, s, : len(d)] = d
    bounds = np.array([c.bounds for c in cands], dtype=np.int64)
    mb = np.array([[c.microbatch] * S for c in cands], dtype=np.int64)
    return PlanBatch(bounds, mb, dev)


def explain_gap(problem: Problem, plan: Plan, cands: list[Candidate]) -> tuple[bool, str]:
    """Why ``plan`` (e.g. ``brute``'s optimum) can beat ``dp``'s answer, and whether that is
    consistent with ``dp`` being exact for its bottleneck: ``(consistent, reason)``.

    Legitimate: the plan has a stage of two device types or unequal microbatches (outside the
    DP's space), or its bottleneck is no better than the DP's optimum in every model (the
    simulated batch time adds fill, drain and dependencies that the bottleneck leaves out).
    A plan of the DP's space whose bottleneck beats the DP's optimum would be a DP bug
    (``cost``: price x the ``overlap`` bottleneck under the throughput target, the quantity
    the DP ranks by).
    """
    cluster, profile = problem.cluster, problem.profile
    mixed = [
        s
        for s, st in enumerate(plan.stages)
        if len({cluster.device(d).type for d in st.devices}) > 1
    ]
    if mixed:
        return True, f"outside dp's space: stage {mixed[0]} mixes device types"
    if len({st.microbatch for st in plan.stages}) > 1:
        return True, "outside dp's space: unequal microbatches"
    price = sum(cluster.device_type(d).price_per_hour for d in plan.devices)
    cost = problem.objective is Objective.COST
    models = [StageModel.OVERLAP] if cost else list(StageModel)
    B, tp = problem.global_batch, problem.min_throughput or 0.0
    for model in models:
        pool = [c for c in cands if c.model is model]
        if cost:
            pool = [c for c in pool if c.bound == 0 or B / c.bound >= tp]
        best = min(((c.price if cost else 1.0) * c.bound for c in pool), default=float("inf"))
        mine = (price if cost else 1.0) * bottleneck(plan, profile, cluster, model)
        if mine < best * (1 - 1e-9):
            return False, (
                f"DP NOT EXACT: the plan's {model.value} bottleneck {mine:.6g} beats the DP's "
                f"optimum {best:.6g}"
            )
    return True, (
        "in dp's space with a bottleneck no better than dp's optimum: the simulated batch "
        "time adds fill, drain and dependencies the bottleneck leaves out"
    )
