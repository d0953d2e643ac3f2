"""``provision_dp``: exact over kind-count vectors -- how many nodes of each kind, and the
stages on them -- exploiting that identical nodes are interchangeable.

**Exact for:** the least ``price x bottleneck`` (cost objective; the bottleneck under the
time objectives) over the node-exclusive space of :mod:`agents.provision.kinds` (contiguous
stages, each on every device of one type on ``m`` whole nodes of one kind, equal
microbatches), where the bottleneck is the ``overlap`` lower bound on the batch time and the
throughput floor is applied to that bound. As :mod:`agents.baselines.dp`, the simulated batch
time adds fill, drain and dependencies; the ``candidates`` best plans of the DP are
simulated through ``search.evaluate`` and the cost model chooses. Outside the space (a stage
mixing kinds, two stages sharing a node, part of a node's devices, unequal microbatches) other
planners may find cheaper plans.

**The DP** runs from the last layer backwards, once per microbatch size. A label at layer
``i`` is ``(q, u, t)``: the suffix ``[i, L)`` covered by ``q`` stages using ``u`` nodes per
option (kind x type), at bottleneck ``t``. A stage ``[i, j)`` on ``m`` nodes of option ``o``
extends every label at ``j``: ``u + m e_o`` (within each kind's count), ``t' = max(t, W, T_j)``.
Labels with equal ``(q, u)`` keep the least ``t`` -- this is the symmetry: a vector of counts
stands for every way of picking those nodes, so the state grows with the counts, not with
the nodes (``prod (count + 1)`` vectors at most, versus ``2^nodes`` subsets). Price is a
function of ``u``, so pruning is exact: a label is dropped when its bound misses the
throughput floor, or when ``price(u) x t`` already reaches the best complete plan's
(the incumbent starts at the best single-stage plan). ``q`` is only kept for 1F1B, whose
memory depends on the stages after a stage.

Refused (a :class:`~agents.problem.ProblemError` naming the option) when the labels at one
layer exceed ``max_labels``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipeplan.agents.problem import InfeasibleError, Objective, Problem, ProblemError
from pipeplan.agents.provision.kinds import Catalogue, StageCosts
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.plan import Schedule
from pipeplan.core.tables import CostTables

Stage = tuple[int, int]  # (option, nodes)
REPAIRS = 16
"""Rounds that raise the bound's throughput target when every simulated candidate missed it."""
REPAIR_STEP = (1.05, 1.3)
"""Least and most factor by which a round raises it (the miss ratio, clipped): small steps
keep the cheapest plans that do meet the target in reach."""


@dataclass(frozen=True)
class ProvisionDPConfig:
    """Options of ``provision_dp``."""

    candidates: int = 512
    """Best plans of the DP simulated (the cost model chooses among them)."""
    max_labels: int = 2_000_000
    """Refuse instances whose DP holds more labels than this at one layer."""
    max_stages: int = 8
    """At most this many stages under 1F1B (whose memory depends on the stage count)."""
    slack: float = 1.0
    """Keep plans up to this fraction above the best value, as candidates to simulate."""
    beam: int = 256
    """Labels per layer of the quick first pass that finds a plan to prune against (0: none)."""

    def __post_init__(self) -> None:  # TypeError: the registry reports it as a ProblemError
        for key in ("candidates", "max_labels", "max_stages"):
            if getattr(self, key) < 1:
                raise TypeError(f"{key}: must be >= 1, got {getattr(self, key)!r}")
        if not self.slack >= 0:
            raise TypeError(f"slack: must be >= 0, got {self.slack!r}")
        if self.beam < 0:
            raise TypeError(f"beam: must be >= 0, got {self.beam!r}")


@dataclass(frozen=True)
class Found:
    """One plan of the DP: its value (price x bottleneck, or the bottleneck), bound, price."""

    value: float
    bound: float
    price: float
    bounds: tuple[int, ...]
    stages: tuple[Stage, ...]
    microbatch: int


@dataclass
class _Labels:
    """Labels at one layer: stage count, counts per option, bottleneck, and the stage that
    led here (end layer, option, nodes, index of the label at the end layer)."""

    q: np.ndarray
    u: np.ndarray  # (N, O)
    t: np.ndarray
    j: np.ndarray
    o: np.ndarray
    m: np.ndarray
    parent: np.ndarray

    @classmethod
    def empty(cls, n_options: int) -> _Labels:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, np.zeros((0, n_options), dtype=np.int64), np.zeros(0), z, z, z, z)

    @property
    def size(self) -> int:
        return len(self.t)


class ProvisionDP:
    """The DP of one problem (see the module docstring)."""

    def __init__(self, problem: Problem, catalogue: Catalogue, config: ProvisionDPConfig):
        self.problem, self.catalogue, self.config = problem, catalogue, config
        opts = catalogue.options
        self.O = len(opts)
        self.kind_of = np.array([o.kind for o in opts], dtype=np.int64)
        self.limit = np.array(catalogue.available, dtype=np.int64)
        self.node_price = np.array([o.node_price for o in opts])
        self.radix = self.limit[self.kind_of] + 1
        self.stride = np.cumprod(np.concatenate([[1], self.radix[:-1]])).astype(np.int64)
        self.cost = problem.objective is Objective.COST
        self.one_f_one_b = problem.schedule is Schedule.ONE_F_ONE_B
        tp = problem.min_throughput if self.cost else None
        self.t_max = problem.global_batch / tp if tp else np.inf

    def value(self, u: np.ndarray, t: np.ndarray) -> np.ndarray:
        return (u @ self.node_price) * t if self.cost else t

    def solve(self, costs: StageCosts, incumbent: float = np.inf) -> list[Found]:
        """The best plans for one microbatch size, best first (at most ``candidates``), of
        those within ``slack`` of ``incumbent`` (the value of a plan known to exist)."""
        L = costs.L
        Q = min(L, self.config.max_stages) if self.one_f_one_b else 1
        qs = np.arange(Q + 1)
        busy = {(i, o): costs.busy(i, o, qs) for i in range(L) for o in range(self.O)}
        t_lb = self._prefix_bound(busy, costs)
        p_lb = float(self.node_price.min())
        incumbent = min(incumbent, self._single_stage(busy, L))
        if np.isinf(incumbent) and self.config.beam:  # a quick feasible plan bounds the search
            seeded = self._run(costs, busy, t_lb, p_lb, np.inf, Q, self.config.beam)
            incumbent = min((f.value for f in seeded), default=np.inf)
        cap = incumbent * (1 + self.config.slack)
        return self._run(costs, busy, t_lb, p_lb, cap, Q, None)

    def _run(
        self,
        costs: StageCosts,
        busy: dict[tuple[int, int], np.ndarray],
        t_lb: np.ndarray,
        p_lb: float,
        cap: float,
        Q: int,
        beam: int | None,
    ) -> list[Found]:
        """The DP from the last layer back; labels whose bound on the final value exceeds
        ``cap`` are dropped; with ``beam``, only that many best-bounded labels per layer are
        kept (a heuristic that finds a feasible plan fast)."""
        L = costs.L
        labels: list[_Labels] = [_Labels.empty(self.O) for _ in range(L + 1)]
        z = np.zeros(1, dtype=np.int64)
        labels[L] = _Labels(z, np.zeros((1, self.O), dtype=np.int64), np.zeros(1), z, z, z, z)
        for i in range(L - 1, -1, -1):
            parts = []
            for j in range(i + 1, L + 1):
                here = labels[j]
                if not here.size:
                    continue
                link = costs.link[j]
                for o in range(self.O):
                    parts.append(self._extend(here, busy[i, o][j - i - 1], link, j, o, Q))
            merged = self._merge(parts)
            bound = self._bound(merged, t_lb[i], p_lb if i > 0 else 0.0)
            keep = bound <= cap
            if beam is not None and keep.sum() > beam:
                keep &= bound <= np.partition(bound, beam - 1)[beam - 1]
            labels[i] = _Labels(*(getattr(merged, f)[keep] for f in _FIELDS))
            if labels[i].size > self.config.max_labels:
                raise ProblemError(
                    f"provision_dp: {labels[i].size:,} labels at layer {i} of "
                    f"{self.problem.profile.name!r} on {self.problem.cluster.name!r}, more than "
                    f"max_labels {self.config.max_labels:,}: raise max_labels or lower max_stages"
                )
        return self._answers(labels, costs)

    def _bound(self, lab: _Labels, t_prefix: float, p_prefix: float) -> np.ndarray:
        """A lower bound on the final value of every completion of each label."""
        t = np.maximum(lab.t, t_prefix)
        return (lab.u @ self.node_price + p_prefix) * t if self.cost else t

    def _prefix_bound(
        self, busy: dict[tuple[int, int], np.ndarray], costs: StageCosts
    ) -> np.ndarray:
        """``t_lb[i]``: the least bottleneck of layers ``[0, i)`` in any stages, nodes unlimited
        by the counts used elsewhere (a lower bound for what a label at ``i`` still needs)."""
        L = costs.L
        t_lb = np.full(L + 1, np.inf)
        t_lb[0] = 0.0
        for j in range(1, L + 1):
            for i in range(j):
                if np.isinf(t_lb[i]):
                    continue
                w = min(float(busy[i, o][j - i - 1].min()) for o in range(self.O))
                t_lb[j] = min(t_lb[j], max(t_lb[i], w, float(costs.link[i])))
        return t_lb

    def _single_stage(self, busy: dict[tuple[int, int], np.ndarray], L: int) -> float:
        """The best one-stage plan's value (a plan that exists: the search prunes against it)."""
        best = np.inf
        for o in range(self.O):
            t = busy[0, o][L - 1, :, 1]  # (m,)
            t = np.where(t <= self.t_max, t, np.inf)
            m = np.arange(1, len(t) + 1)
            v = m * self.node_price[o] * t if self.cost else t
            best = min(best, float(v.min(initial=np.inf)))
        return best

    def _extend(
        self, here: _Labels, busy: np.ndarray, link: float, j: int, o: int, Q: int
    ) -> _Labels:
        """Every label at ``j`` after a stage on ``m`` nodes of option ``o`` (``busy``: its
        (m, Q+1) busy times); an ``m`` is kept only where it lowers the bottleneck below every
        smaller ``m`` (more nodes at the same bottleneck only cost more)."""
        k = self.kind_of[o]
        used = here.u[:, self.kind_of == k].sum(1)  # nodes of the kind already taken
        m = np.arange(1, busy.shape[0] + 1)
        q_new = here.q + 1
        if self.one_f_one_b:  # memory depends on the stages from here to the end
            ok_q = here.q < Q
            w = busy[:, np.minimum(q_new, Q)].T  # (N, m)
        else:
            ok_q = np.ones(here.size, dtype=bool)
            w = np.broadcast_to(busy[:, 1], (here.size, len(m)))
        t = np.maximum(np.maximum(here.t[:, None], w), link)
        t = np.where(used[:, None] + m[None, :] <= self.limit[k], t, np.inf)
        better = np.ones_like(t, dtype=bool)
        better[:, 1:] = t[:, 1:] < np.minimum.accumulate(t, axis=1)[:, :-1]
        # finite: with no throughput floor t_max is infinite, and an infinite time is a
        # stage over memory or past its kind's nodes
        fits = ok_q[:, None] & better & np.isfinite(t) & (t <= self.t_max)
        n, mm = np.nonzero(fits)
        u = here.u[n].copy()
        u[:, o] += m[mm]
        full = np.zeros(len(n), dtype=np.int64)
        return _Labels(q_new[n], u, t[n, mm], full + j, full + o, m[mm], n)

    def _merge(self, parts: list[_Labels]) -> _Labels:
        """Concatenate, keep the least ``t`` per ``(q, u)`` (``u`` alone for GPipe)."""
        if not parts:
            return _Labels.empty(self.O)
        cat = _Labels(*(np.concatenate([getattr(p, f) for p in parts]) for f in _FIELDS))
        q_key = cat.q if self.one_f_one_b else np.zeros_like(cat.q)
        key = cat.u @ self.stride
        order = np.lexsort((cat.t, key, q_key))
        k_sorted, q_sorted = key[order], q_key[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = (k_sorted[1:] != k_sorted[:-1]) | (q_sorted[1:] != q_sorted[:-1])
        pick = order[first]
        return _Labels(*(getattr(cat, f)[pick] for f in _FIELDS))

    def _answers(self, labels: list[_Labels], costs: StageCosts) -> list[Found]:
        top = labels[0]
        if not top.size:
            return []
        values = self.value(top.u, top.t)
        out = []
        for n in np.argsort(values, kind="stable")[: self.config.candidates]:
            bounds, stages = [0], []
            i, idx = 0, int(n)
            while i < costs.L:
                lab = labels[i]
                stages.append((int(lab.o[idx]), int(lab.m[idx])))
                i, idx = int(lab.j[idx]), int(lab.parent[idx])
                bounds.append(i)
            price = float(top.u[n] @ self.node_price)
            out.append(
                Found(
                    float(values[n]), float(top.t[n]), price, tuple(bounds), tuple(stages), costs.b
                )
            )
        return out


_FIELDS = ("q", "u", "t", "j", "o", "m", "parent")


def found_batch(catalogue: Catalogue, found: list[Found]) -> PlanBatch:
    """Plans of one stage count as a population, each stage on the next free nodes of its kind."""
    S = len(found[0].stages)
    devs = [catalogue.devices(list(f.stages)) for f in found]
    R = max(len(d) for ds in devs for d in ds)
    dev = np.full((len(found), S, R), -1, dtype=np.int64)
    for p, ds in enumerate(devs):
        for s, d in enumerate(ds):
            dev[p, s, : len(d)] = d
    bounds = np.array([f.bounds for f in found], dtype=np.int64)
    mb = np.array([[f.microbatch] * S for f in found], dtype=np.int64)
    return PlanBatch(bounds, mb, dev)


def by_stage_count(search: Search, found: list[Found]) -> dict[int, list[Found]]:
    """The plans of ``found`` that the search's evaluation budget leaves room for, grouped
    by stage count (a population each: one batch evaluation holds one stage count)."""
    left = search.remaining_evaluations
    if left is not None:
        found = found[:left]
    groups: dict[int, list[Found]] = {}
    for f in found:
        groups.setdefault(len(f.stages), []).append(f)
    return groups


def evaluate_found(search: Search, catalogue: Catalogue, found: list[Found]) -> float:
    """Simulate plans through ``search`` (one population per stage count), budget allowing;
    the highest throughput among those that fit in memory (0 when none)."""
    by_stages = by_stage_count(search, found)
    p, reached = search.problem, 0.0
    for S in sorted(by_stages):
        if search.exhausted():
            break
        batch = found_batch(catalogue, by_stages[S])
        search.evaluate(batch)
        raw = search.evaluator.evaluate(batch, p.global_batch, p.schedule)
        if raw.fits.any():
            reached = max(reached, float(raw.throughput[raw.fits].max()))
    return reached


def solve(
    problem: Problem, catalogue: Catalogue, config: ProvisionDPConfig, tables: CostTables
) -> list[Found]:
    """Every microbatch size's best plans, best first overall."""
    dp = ProvisionDP(problem, catalogue, config)
    found: list[Found] = []
    best = np.inf
    for b in sorted(problem.microbatch_sizes(), reverse=True):  # few overheads first
        more = dp.solve(StageCosts(problem, tables, catalogue, b), best)
        best = min([best, *(f.value for f in more)])
        found += more
    cap = best * (1 + config.slack)
    ranked = sorted((f for f in found if f.value <= cap), key=lambda f: (f.value, f.bound))
    return ranked[: config.candidates]


class ProvisionDPPlanner(Planner):
    """Exact over kind-count vectors for the bottleneck (see the module docstring)."""

    name = "provision_dp"
    Config = ProvisionDPConfig
    config: ProvisionDPConfig

    def search(self, problem: Problem, search: Search) -> None:
        tables = search.evaluator.tables
        catalogue = Catalogue.of(problem.cluster, tables)
        found = solve(problem, catalogue, self.config, tables)
        reached = evaluate_found(search, catalogue, found)
        target = problem.min_throughput if problem.objective is Objective.COST else None
        tp = target
        for _ in range(REPAIRS):  # the bound is optimistic: ask it for more where all missed
            if search.best_plan is not None or not target or not tp or not reached > 0:
                break
            tp *= min(max(target / reached, REPAIR_STEP[0]), REPAIR_STEP[1])
            found = solve(replace(problem, min_throughput=tp), catalogue, self.config, tables)
            reached = evaluate_found(search, catalogue, found)
        if search.best_plan is None and not found:
            why = (
                f"no plan's bottleneck bound reaches min_throughput {problem.min_throughput:g} "
                "samples/s"
                if problem.min_throughput
                else "no plan fits in memory"
            )
            raise InfeasibleError(
                f"provision_dp on {problem.profile.name!r} / cluster {problem.cluster.name!r}: "
                f"{why} among node-exclusive one-kind stages, microbatch sizes "
                f"{problem.microbatch_sizes()}"
            )
