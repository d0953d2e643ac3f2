"""``genetic`` on a catalogue: the genetic search at the level of node kinds and counts.

On a catalogue (nodes with ``count: N``, DESIGN.md) the device-level genome of
:mod:`agents.baselines.genetic` (one gene per device: 112 genes on ``cloud-catalogue``) sees
every way of picking the same nodes as a different point, and misses throughput targets
that need a pipeline over many nodes (``bench/provisioning.py``). Here an individual is a
**kind-level plan** (:class:`KindPlan`): stage boundaries, each stage's option (a device type
on a node kind, :mod:`agents.provision.kinds`) and node count, and one microbatch size. It
is made concrete canonically -- each stage takes the first free nodes of its kind
(:meth:`~agents.provision.kinds.Catalogue.devices`) -- so plans equal up to renaming
identical nodes are one individual, and one entry of the fitness cache.

The loop is the genetic planner's (:class:`~agents.baselines.genetic.GeneticConfig`'s
``population``, ``generations``, ``elite``, ``tournament``, ``crossover_rate``,
``patience``, ``restart_after``, ``min_stages``/``max_stages`` apply): tournament selection
on (violation, value), one-point crossover on a layer, mutation, repair to the catalogue's
counts, elitism; a stalled population is polished by steepest descent and restarted; the best
plan is polished at the end. Mutations shift, add or remove a boundary, change a stage's
option or count, step the microbatch size, or **recount**: every stage's count chosen exactly
for the bottleneck of the structure (:func:`~agents.provision.counts.best_counts`) at the
throughput target raised by a random slack (the bound leaves out the pipeline's fill). Seeds
are recounted random structures and every one-stage plan. Infeasible plans are ranked by how
far they miss memory and the throughput target. Seeded (numpy, from the problem's seed).

The space is :mod:`agents.provision.kinds`' node-exclusive one-kind stages with equal
microbatches, as ``provision_dp``'s (whose exact answer is the reference in
``bench/provisioning.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.agents.baselines.genetic import GeneticConfig
from pipeplan.agents.baselines.genetic import GeneticPlanner as DeviceGeneticPlanner
from pipeplan.agents.problem import Objective, Problem
from pipeplan.agents.provision.counts import best_counts
from pipeplan.agents.provision.exact import Found, found_batch
from pipeplan.agents.provision.kinds import Catalogue, StageCosts
from pipeplan.agents.search import Search
from pipeplan.core.tables import CostTables

SLACK = (1.0, 1.6)
"""Range of the factor by which a recount raises the throughput target (uniform)."""
LAMARCK = 0.75
"""Probability that a child whose structure (boundaries, options, size) changed takes the
counts chosen for it (:meth:`KindGenetic.recount`) instead of its parent's."""
MAX_MICROBATCHES = 32
"""Microbatch sizes searched: those that split the batch into at most this many microbatches
(the simulation's cost grows with the count; more only pays on very deep pipelines)."""


class CachedStageCosts(StageCosts):
    """:class:`StageCosts` that keeps every busy-time table it computed: recounts ask for the
    same stages again and again."""

    def __init__(self, problem: Problem, tables: CostTables, catalogue: Catalogue, b: int):
        super().__init__(problem, tables, catalogue, b)
        self._busy: dict[tuple[int, int, bytes], np.ndarray] = {}

    def busy(self, i: int, o: int, stages_from_here: np.ndarray) -> np.ndarray:
        q = np.asarray(stages_from_here)
        key = (i, o, q.tobytes())
        if key not in self._busy:
            self._busy[key] = super().busy(i, o, q)
        return self._busy[key]


@dataclass(frozen=True)
class KindPlan:
    """A plan by kind: stage boundaries, ``(option, nodes)`` per stage, microbatch size."""

    bounds: tuple[int, ...]
    stages: tuple[tuple[int, int], ...]
    microbatch: int

    def found(self) -> Found:
        return Found(0.0, 0.0, 0.0, self.bounds, self.stages, self.microbatch)


def is_catalogue(problem: Problem) -> bool:
    """Whether the cost objective runs on a catalogue (a node entry with ``count``): there
    the kind-level searches replace the device-level ones."""
    return problem.objective is Objective.COST and any(
        n.kind is not None for n in problem.cluster.nodes
    )


class KindGenetic:
    """The kind-level genetic search of one problem (see the module docstring)."""

    def __init__(self, problem: Problem, search: Search, config: GeneticConfig):
        self.problem, self.search, self.config = problem, search, config
        self.rng = np.random.default_rng(problem.seed)
        self.tables = search.evaluator.tables
        self.cat = Catalogue.of(problem.cluster, self.tables)
        self.L = len(problem.profile)
        sizes = sorted(problem.microbatch_sizes())
        few = [b for b in sizes if problem.global_batch // b <= MAX_MICROBATCHES]
        self.sizes = few or sizes[-1:]
        self.O = len(self.cat.options)
        self.kind_of = np.array([o.kind for o in self.cat.options])
        self.limit = np.array(self.cat.available)
        self.max_stages = min(
            self.L,
            int(self.limit.sum()),
            config.max_stages if config.max_stages is not None else self.L,
        )
        self.min_stages = min(config.min_stages, self.max_stages)
        tp = problem.min_throughput if problem.objective is Objective.COST else None
        self.target = tp or 0.0
        self._costs: dict[int, CachedStageCosts] = {}
        self.generations = 0
        self.cache: dict[KindPlan, tuple[float, float]] = {}
        self.proxy: dict[KindPlan, float] = {}  # price x bottleneck bound of recounted plans

    # --- costs ---------------------------------------------------------------------------

    def costs(self, b: int) -> StageCosts:
        if b not in self._costs:
            self._costs[b] = CachedStageCosts(self.problem, self.tables, self.cat, b)
        return self._costs[b]

    def fitness(self, plans: list[KindPlan]) -> tuple[np.ndarray, np.ndarray]:
        """(value, violation) per plan; each distinct plan simulated once, budget allowing."""
        todo = list(dict.fromkeys(p for p in plans if p not in self.cache))
        by_stages: dict[int, list[KindPlan]] = {}
        for p in todo:
            by_stages.setdefault(len(p.stages), []).append(p)
        for group in by_stages.values():
            left = self.search.remaining_evaluations
            if self.search.exhausted() or left == 0:
                break
            group = group if left is None else group[:left]
            batch = found_batch(self.cat, [p.found() for p in group])
            values = self.search.evaluate(batch)
            viol = np.zeros(len(group))
            bad = ~np.isfinite(values)
            if bad.any():
                pb = self.problem
                raw = self.search.evaluator.evaluate(batch, pb.global_batch, pb.schedule)
                miss = np.maximum(raw.memory_ratio - 1.0, 0.0)
                if self.target:
                    tp = pb.global_batch / np.maximum(raw.batch_time_s, 1e-12)
                    miss = miss + np.maximum(self.target / tp - 1.0, 0.0)
                viol = np.where(bad, miss + 1e-9, 0.0)
            for p, v, w in zip(group, values, viol, strict=True):
                self.cache[p] = (float(v), float(w))
        value = np.array([self.cache.get(p, (np.inf, np.inf))[0] for p in plans])
        viol = np.array([self.cache.get(p, (np.inf, np.inf))[1] for p in plans])
        return value, viol

    # --- building plans ------------------------------------------------------------------

    def recount(self, bounds: tuple[int, ...], options: tuple[int, ...], b: int) -> KindPlan | None:
        """Counts chosen exactly for the structure's bottleneck at a slackened target."""
        slack = self.rng.uniform(*SLACK)
        t_max = self.problem.global_batch / (self.target * slack) if self.target else np.inf
        f = best_counts(self.problem, self.cat, self.costs(b), bounds, options, t_max)
        if f is None:
            return None
        plan = KindPlan(f.bounds, f.stages, b)
        self.proxy[plan] = f.value
        return plan

    def random_structure(
        self, stages: int | None = None
    ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Random boundaries (``stages`` of them, or a random count, mostly 1 to 4), options
        and microbatch size."""
        S = int(self.rng.integers(self.min_stages, self.max_stages + 1))
        S = min(S, int(self.rng.integers(1, 5)) if self.rng.random() < 0.7 else S)
        S = max(S, self.min_stages) if stages is None else stages
        cuts = sorted(self.rng.choice(np.arange(1, self.L), S - 1, replace=False).tolist())
        options = tuple(int(o) for o in self.rng.integers(0, self.O, S))
        b = int(self.rng.choice(self.sizes))
        return (0, *cuts, self.L), options, b

    def repair(self, p: KindPlan) -> KindPlan:
        """Counts within each kind's nodes: the largest stage of an over-used kind shrinks, a
        one-node stage moves to a kind with room, and stages merge when none has room."""
        bounds, stages = list(p.bounds), [list(s) for s in p.stages]
        for _ in range(4 * len(stages) + int(self.limit.sum())):
            used = np.zeros(len(self.limit), dtype=np.int64)
            for o, m in stages:
                used[self.kind_of[o]] += m
            over = np.flatnonzero(used > self.limit)
            if not over.size:
                break
            k = int(over[0])
            mine = [i for i, (o, _) in enumerate(stages) if self.kind_of[o] == k]
            big = max(mine, key=lambda i: stages[i][1])
            if stages[big][1] > 1:
                stages[big][1] -= 1
                continue
            room = [o for o in range(self.O) if used[self.kind_of[o]] < self.limit[self.kind_of[o]]]
            if room:
                stages[big][0] = int(self.rng.choice(room))
            else:  # more stages than nodes: merge this one into a neighbour
                drop = big if big > 0 else 1
                del bounds[drop]
                del stages[big]
        n = len(stages)
        if not self.min_stages <= n <= self.max_stages:
            f = self.recount((0, self.L), (stages[0][0],), p.microbatch)
            return f if f is not None else KindPlan((0, self.L), ((stages[0][0], 1),), p.microbatch)
        return KindPlan(tuple(bounds), tuple((int(o), int(m)) for o, m in stages), p.microbatch)

    # --- operators -----------------------------------------------------------------------

    def mutate(self, p: KindPlan) -> KindPlan:
        rng = self.rng
        bounds, stages, b = list(p.bounds), [list(s) for s in p.stages], p.microbatch
        n = len(stages)
        move = rng.choice(["recount", "cut", "split", "merge", "option", "same", "count", "size"],
                          p=[0.2, 0.2, 0.1, 0.1, 0.12, 0.08, 0.15, 0.05])  # fmt: skip
        if move == "recount":
            options = tuple(o for o, _ in stages)
            got = self.recount(tuple(bounds), options, b)
            if got is not None:
                return got
            move = "count"
        if move == "cut" and n > 1:
            s = int(rng.integers(1, n))
            lo, hi = bounds[s - 1] + 1, bounds[s + 1] - 1
            if hi >= lo:
                bounds[s] = int(np.clip(bounds[s] + rng.choice([-2, -1, 1, 2]), lo, hi))
        elif move == "split" and n < self.max_stages:
            s = int(rng.integers(n))
            if bounds[s + 1] - bounds[s] >= 2:
                at = int(rng.integers(bounds[s] + 1, bounds[s + 1]))
                bounds.insert(s + 1, at)
                stages.insert(s + 1, [int(rng.integers(self.O)), 1])
        elif move == "merge" and n > max(1, self.min_stages):
            s = int(rng.integers(1, n))
            del bounds[s]
            keep = stages[s - 1] if rng.random() < 0.5 else stages[s]
            stages[s - 1 : s + 1] = [keep]
        elif move == "option":
            s = int(rng.integers(n))
            stages[s][0] = int(rng.integers(self.O))
        elif move == "same":  # every stage on one stage's option
            o = stages[int(rng.integers(n))][0]
            stages = [[o, m] for _, m in stages]
        elif move == "size":
            i = self.sizes.index(b) + int(rng.choice([-1, 1]))
            b = self.sizes[int(np.clip(i, 0, len(self.sizes) - 1))]
        else:  # count
            s = int(rng.integers(n))
            m = stages[s][1]
            stages[s][1] = max(1, int(rng.choice([m - 1, m + 1, m // 2, 2 * m])))
        out = self.repair(KindPlan(tuple(bounds), tuple((int(o), int(m)) for o, m in stages), b))
        if move != "count" and rng.random() < LAMARCK:  # a new structure: its own counts
            got = self.recount(out.bounds, tuple(o for o, _ in out.stages), out.microbatch)
            if got is not None:
                return got
        return out

    def crossover(self, a: KindPlan, b: KindPlan) -> KindPlan:
        """A's stages before a random layer ``x``, B's from ``x`` on (the stages holding ``x``
        cut there); the microbatch of either."""
        x = int(self.rng.integers(1, self.L))

        def part(p: KindPlan, lo: int, hi: int) -> list[tuple[int, int, int]]:
            out = []
            for s, st in enumerate(p.stages):
                start, end = max(p.bounds[s], lo), min(p.bounds[s + 1], hi)
                if start < end:
                    out.append((start, st[0], st[1]))
            return out

        pieces = part(a, 0, x) + part(b, x, self.L)
        bounds = (*(s for s, _, _ in pieces), self.L)
        stages = tuple((o, m) for _, o, m in pieces)
        mb = a.microbatch if self.rng.random() < 0.5 else b.microbatch
        return self.repair(KindPlan(bounds, stages, mb))

    def neighbours(self, p: KindPlan) -> list[KindPlan]:
        """One-step moves: a stage one node fewer or more, another option, a boundary moved by
        one, the next microbatch size."""
        out = []
        S = len(p.stages)
        for s in range(S):
            o, m = p.stages[s]
            for mm in (m - 1, m + 1):
                if mm >= 1:
                    out.append(p.stages[:s] + ((o, mm),) + p.stages[s + 1 :])
            for oo in range(self.O):
                if oo != o:
                    out.append(p.stages[:s] + ((oo, m),) + p.stages[s + 1 :])
        plans = [KindPlan(p.bounds, st, p.microbatch) for st in out]
        for s in range(1, S):
            for d in (-1, 1):
                c = p.bounds[s] + d
                if p.bounds[s - 1] < c < p.bounds[s + 1]:
                    bounds = p.bounds[:s] + (c,) + p.bounds[s + 1 :]
                    plans.append(KindPlan(bounds, p.stages, p.microbatch))
        i = self.sizes.index(p.microbatch)
        for j in (i - 1, i + 1):
            if 0 <= j < len(self.sizes):
                plans.append(KindPlan(p.bounds, p.stages, self.sizes[j]))
        return list(dict.fromkeys(self.repair(q) for q in plans))

    def polish(self, p: KindPlan) -> KindPlan:
        """Steepest descent over :meth:`neighbours` while the budget lasts."""
        value = self.fitness([p])[0][0]
        while not self.search.exhausted():
            near = self.neighbours(p)
            v, _ = self.fitness(near)
            j = int(np.argmin(v)) if len(near) else -1
            if j < 0 or not v[j] < value * (1 - 1e-12):
                break
            p, value = near[j], float(v[j])
        return p

    # --- the loop ------------------------------------------------------------------------

    def seeds(self, n: int) -> list[KindPlan]:
        """The ``n`` best by the bound (price x bottleneck, no simulation) of
        ``seed_candidates`` recounted structures: every one-stage plan, pipelines of 2 to 4
        stages on one option, random structures; filled up with random plans."""
        want = max(self.config.seed_candidates, n)
        cands: list[KindPlan] = []
        for o in range(self.O):
            for b in self.sizes:
                got = self.recount((0, self.L), (o,), b) if self.min_stages <= 1 else None
                if got is not None:
                    cands.append(got)
        for _ in range(2):
            for o in range(self.O):  # pipelines on one option
                for S in range(max(2, self.min_stages), min(4, self.max_stages) + 1):
                    bounds, _, b = self.random_structure(S)
                    got = self.recount(bounds, (o,) * S, b)
                    if got is not None:
                        cands.append(got)
        tries = 0
        while len(cands) < want and tries < 2 * want:
            tries += 1
            got = self.recount(*self.random_structure())
            if got is not None:
                cands.append(got)
        cands = [self.repair(c) for c in dict.fromkeys(cands)]
        cands = sorted(dict.fromkeys(cands), key=lambda c: self.proxy.get(c, np.inf))[:n]
        while len(cands) < n:
            bounds, options, b = self.random_structure()
            cands.append(self.repair(KindPlan(bounds, tuple((o, 1) for o in options), b)))
        return cands

    def pick(self, pop: list[KindPlan], rank: np.ndarray) -> KindPlan:
        """Tournament selection: the best-ranked of ``tournament`` random individuals."""
        idx = self.rng.integers(0, len(pop), self.config.tournament)
        return pop[int(idx[np.argmin(rank[idx])])]

    def run(self) -> None:
        c, rng = self.config, self.rng
        pop = self.seeds(c.population)
        value, viol = self.fitness(pop)
        best, since, stalled = float(value.min(initial=np.inf)), 0, 0
        for _ in range(c.generations):
            if self.search.exhausted():
                return
            self.generations += 1
            rank = np.argsort(np.lexsort((value, viol)))  # position in (viol, value) order
            elite = [pop[i] for i in np.argsort(rank)[: c.elite]]

            children: list[KindPlan] = []
            while len(children) < len(pop) - len(elite):
                a, b = self.pick(pop, rank), self.pick(pop, rank)
                child = self.crossover(a, b) if rng.random() < c.crossover_rate else a
                children.append(self.mutate(child))
            pop = elite + children
            value, viol = self.fitness(pop)
            now = float(value.min(initial=np.inf))
            if now < best * (1 - 1e-12):
                best, since, stalled = now, 0, 0
            else:
                since, stalled = since + 1, stalled + 1
            if since >= c.patience:
                break
            if stalled >= c.restart_after:
                top = pop[int(np.lexsort((value, viol))[0])]
                kept = self.polish(top)
                pop = [kept, *self.seeds(c.population - 1)]
                value, viol = self.fitness(pop)
                best, stalled = min(best, float(value.min(initial=np.inf))), 0
        top = pop[int(np.lexsort((value, viol))[0])]
        self.polish(top)


class GeneticPlanner(DeviceGeneticPlanner):
    """``genetic``: the kind-level search on a catalogue under the cost objective
    (:func:`is_catalogue`), the device-level one of :mod:`agents.baselines.genetic`
    everywhere else (unchanged)."""

    def search(self, problem: Problem, search: Search) -> None:
        if not is_catalogue(problem):
            super().search(problem, search)
            return
        config: GeneticConfig = self.config
        KindGenetic(problem, search, config).run()
