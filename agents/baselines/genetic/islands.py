"""The ``genetic`` planner's loop: one island (population) per stage count, evolved side by
side, stalled islands polished and restarted, far-behind ones dropped.

Stage counts are **islands**: one population per ``S`` in ``[min_stages, max_stages]`` (a
:class:`PlanBatch` holds one stage count); after ``prune_after`` generations, islands whose
best is worse than ``prune_ratio`` x the global best are dropped. Seeds that fit in memory
(:mod:`.feasible`) come first: their stage counts get the first islands (at most
``max_islands`` in all, nearest to them), the best seed is polished at once, and islands
are started only within a share of a seconds budget, so that at scale (where a generation
costs seconds) the rest of it evolves them. Per generation and island:
elitism, tournament selection, crossover, mutation, now and then boundaries re-balanced for
the child's devices, repair, and duplicates re-mutated. An island that stalls for
``restart_after`` generations is polished by steepest descent over one-step neighbours and
restarted afresh; the search stops after ``patience`` generations without a better plan, or
when ``search.exhausted()``. Children over memory are repaired or replaced by a fitting
parent before they are costed (:func:`~.feasible.repair_memory`).

Two phases when unequal microbatches are allowed: the islands first evolve with equal
microbatches (until ``patience``, or half the problem's budget), then the same populations
go on with per-stage sizes. Searching the larger space from the start lost to the equal
search on some instances (``bench/plan_quality.py``, bench/results/plan_quality/);
widening a converged equal population keeps the equal optimum found and spends the rest on
what unequal sizes add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeplan.agents.baselines.genetic.balance import rebalance
from pipeplan.agents.baselines.genetic.context import Context, GeneticConfig
from pipeplan.agents.baselines.genetic.feasible import (
    fits,
    greedy_seeds,
    group_seeds,
    repair_memory,
)
from pipeplan.agents.baselines.genetic.genome import FloatArray, Genomes, IntArray
from pipeplan.agents.baselines.genetic.operators import (
    crossover,
    duplicates,
    mutate,
    neighbours,
    ranking,
    repair,
    tournament,
)
from pipeplan.agents.baselines.genetic.seeds import random_genomes, seed_genomes
from pipeplan.agents.problem import Problem, ProblemError
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search

POLISH_SHARE = 0.1
"""Share of a seconds budget spent polishing the best seed before the islands evolve: at
scale a generation costs seconds, and the seed's one-step neighbours are the cheapest gain."""
START_SHARE = 0.3
"""Share of a seconds budget that starting islands may take, all together (at least one is
started): past it, the islands started evolve with the rest of the budget."""


@dataclass
class Island:
    """The population of one stage count."""

    stages: int
    genomes: Genomes
    value: FloatArray
    viol: FloatArray
    stalled: int = 0  # generations since the population's best improved
    record: float = math.inf  # the best before the last restart

    @property
    def best(self) -> float:
        return min(float(self.value.min()), self.record)

    @classmethod
    def start(
        cls, ctx: Context, S: int, fitting: Genomes | None = None, deadline: float | None = None
    ) -> Island:
        """A population of ``S`` stages: the ``fitting`` seeds (:mod:`.feasible`, at most
        half the population), :func:`seed_genomes` (their proxy work stops at ``deadline``,
        the search's seconds) and random genomes, repaired; those over memory are replaced
        by fitting ones where the island has any."""
        pop = ctx.config.population
        first = [] if fitting is None else [fitting.take(np.arange(min(fitting.size, pop // 2)))]
        seeds = Genomes.concat([*first, seed_genomes(ctx, S, deadline)])
        seeds = seeds.take(np.arange(min(seeds.size, pop)))
        g = Genomes.concat([seeds, random_genomes(ctx, pop - seeds.size, S)])
        g = repair(ctx, g)
        ok = fits(ctx, g)
        g = repair_memory(ctx, g, g.take(np.flatnonzero(ok))) if ok.any() else g
        value, viol = ctx.fitness(g)
        return cls(S, g, value, viol)

    def step(self, ctx: Context) -> None:
        """One generation: elitism, tournaments, crossover, mutation, repair, fitness."""
        c, rng = ctx.config, ctx.rng
        rank = ranking(self.value, self.viol)
        elite = np.argsort(rank)[: c.elite]
        n = self.genomes.size - c.elite
        a = self.genomes.take(tournament(rank, n, c.tournament, rng))
        b = self.genomes.take(tournament(rank, n, c.tournament, rng))
        children = mutate(ctx, crossover(a, b, c.crossover_rate, rng))
        hit = np.flatnonzero(rng.random(n) < c.rebalance_rate)
        children.cuts[hit] = rebalance(ctx, children.take(hit)).cuts
        fitting = self.genomes.take(np.flatnonzero(np.isfinite(self.value)))
        children = repair_memory(ctx, children, fitting)
        for _ in range(3):  # re-mutate children already costed or twice in this brood
            dup = duplicates(ctx, children)
            if not dup.any():
                break
            redo = repair_memory(ctx, mutate(ctx, children.take(np.flatnonzero(dup))), fitting)
            children.cuts[dup], children.assign[dup], children.mb[dup] = (
                redo.cuts,
                redo.assign,
                redo.mb,
            )
        before = float(self.value.min())
        self._replace(elite, children, *ctx.fitness(children))
        improved = self.value.min() < before * (1 - 1e-12)
        self.stalled = 0 if improved else self.stalled + 1

    def polish(self, ctx: Context, until: float | None = None) -> None:
        """Steepest descent from the best individual over :func:`neighbours` (until the
        search's seconds reach ``until``, when given)."""
        while not ctx.search.exhausted() and (until is None or ctx.search.elapsed < until):
            i = int(np.argmin(ranking(self.value, self.viol)))
            near = neighbours(ctx, self.genomes.take(np.array([i])))
            if np.isfinite(self.value[i]):  # from a plan that fits: only neighbours that fit
                near = near.take(np.flatnonzero(fits(ctx, near)))
            if near.size == 0:
                return
            value, viol = ctx.fitness(near)
            j = int(np.argmin(value))
            if not value[j] < self.value[i] * (1 - 1e-12):
                return
            worst = int(np.argmax(ranking(self.value, self.viol)))
            self.genomes.cuts[worst], self.genomes.assign[worst], self.genomes.mb[worst] = (
                near.cuts[j],
                near.assign[j],
                near.mb[j],
            )
            self.value[worst], self.viol[worst] = value[j], viol[j]

    def restart(self, ctx: Context) -> None:
        """Start the population afresh (random individuals, half of them re-balanced); the
        best so far stays in :attr:`record` (and in the search's best plan)."""
        self.record = self.best
        fresh = random_genomes(ctx, self.genomes.size, self.stages)
        half = np.arange(fresh.size // 2)
        fresh.cuts[half] = rebalance(ctx, fresh.take(half)).cuts
        fresh = repair_memory(
            ctx, fresh, self.genomes.take(np.flatnonzero(np.isfinite(self.value)))
        )
        self._replace(np.zeros(0, dtype=np.int64), fresh, *ctx.fitness(fresh))
        self.stalled = 0

    def _replace(self, keep: IntArray, new: Genomes, value: FloatArray, viol: FloatArray) -> None:
        self.genomes = Genomes.concat([self.genomes.take(keep), new])
        self.value = np.concatenate([self.value[keep], value])
        self.viol = np.concatenate([self.viol[keep], viol])


def stage_range(problem: Problem, min_stages: int, max_stages: int | None) -> range:
    cap = min(len(problem.cluster.device_ids), len(problem.profile))
    hi = cap if max_stages is None else min(max_stages, cap)
    if min_stages > hi:
        raise ProblemError(
            f"min_stages: {min_stages} exceeds the {cap} stages this problem allows "
            f"({len(problem.cluster.device_ids)} devices, {len(problem.profile)} layers)"
        )
    return range(min_stages, hi + 1)


class GeneticPlanner(Planner):
    name = "genetic"
    Config = GeneticConfig

    def search(self, problem: Problem, search: Search) -> None:
        c: GeneticConfig = self.config
        ctx = Context(problem, search, c, np.random.default_rng(problem.seed))
        unequal = not ctx.equal
        ctx.equal = True  # phase 1: equal microbatches (phase 2 widens the same islands)
        allowed = stage_range(problem, c.min_stages, c.max_stages)
        seeds = fitting_seeds(ctx, allowed, greedy=c.min_stages == 1 and c.max_stages is None)
        if search.exhausted():
            return
        chosen = island_stages(allowed, seeds, c.max_islands)
        seconds = problem.budget.seconds
        until = None if seconds is None else search.elapsed + START_SHARE * seconds
        islands: list[Island] = []
        for k, S in enumerate(chosen):
            left = None if until is None else until - search.elapsed
            if islands and left is not None and left <= 0:
                break  # the rest of the budget evolves the islands started
            deadline = None if left is None else search.elapsed + left / (len(chosen) - k)
            islands.append(Island.start(ctx, S, seeds.get(S), deadline))
            if k == 0 and S in seeds:  # the best seed, polished at once (unequal sizes too)
                ctx.equal, began = not unequal, search.elapsed
                islands[0].polish(ctx, None if seconds is None else began + POLISH_SHARE * seconds)
                ctx.equal = True
                until = None if until is None else until + search.elapsed - began
            if search.exhausted():
                return
        islands.sort(key=lambda i: i.stages)
        islands = evolve(ctx, islands, half_budget(problem) if unequal else None)
        if unequal and not search.exhausted():
            ctx.equal = False
            for island in islands:
                island.stalled = 0
            islands = evolve(ctx, islands, None)
        best = min(i.best for i in islands)
        for island in islands:  # restarted islands were polished before their restart
            if island.value.min() <= c.prune_ratio * best:
                island.polish(ctx)


def fitting_seeds(ctx: Context, allowed: range, greedy: bool) -> dict[int, Genomes]:
    """Seeds that fit in memory (:func:`~.feasible.group_seeds`, and greedy's plan when
    ``greedy``) with a stage count in ``allowed``, costed: by stage count, best first
    within each, and the stage counts in the order of their best seeds."""
    found = [g for g in group_seeds(ctx) if g.stages in allowed]
    if greedy and not ctx.search.exhausted():
        mine = greedy_seeds(ctx)
        if mine is not None and mine.stages in allowed:
            found += [mine.take(np.array([i])) for i in range(mine.size)]
    by_stages: dict[int, list[Genomes]] = {}
    for g in found:
        by_stages.setdefault(g.stages, []).append(g)
    ranked: list[tuple[float, int, Genomes]] = []
    for S, parts in by_stages.items():
        g = Genomes.concat(parts)
        value, _ = ctx.fitness(g)
        keep = np.flatnonzero(np.isfinite(value))
        if keep.size:
            order = keep[np.argsort(value[keep], kind="stable")]
            ranked.append((float(value[order[0]]), S, g.take(order)))
    return {S: g for _, S, g in sorted(ranked, key=lambda r: (r[0], r[1]))}


def island_stages(allowed: range, seeds: dict[int, Genomes], most: int) -> list[int]:
    """The stage counts that get an island, in the order they are started: without fitting
    seeds every allowed one, fewest stages first (the search cannot tell where to look);
    with them, the stage counts of the seeds, best seed first, then the others nearest to
    those, at most ``most`` in all (every allowed one when there are at most ``most``)."""
    if not seeds:
        return list(allowed)
    order = [S for S in seeds if S in allowed]  # best seed first (:func:`fitting_seeds`)
    rest = sorted(
        (S for S in allowed if S not in seeds), key=lambda S: (min(abs(S - t) for t in seeds), S)
    )
    return (order + rest)[: max(most, 1) if len(allowed) > most else len(allowed)]


def half_budget(problem: Problem) -> tuple[int | None, float | None]:
    """Half the evaluations and seconds of the problem's budget (None: unbounded)."""
    b = problem.budget
    return (
        None if b.evaluations is None else b.evaluations // 2,
        None if b.seconds is None else b.seconds / 2,
    )


def evolve(
    ctx: Context, islands: list[Island], stop_at: tuple[int | None, float | None] | None
) -> list[Island]:
    """Generations until ``patience`` without a better plan, ``generations``, the budget, or
    ``stop_at`` (evaluations, seconds) is reached; returns the islands left after pruning."""
    c, search = ctx.config, ctx.search
    best, since = min(i.best for i in islands), 0
    for gen in range(1, c.generations + 1):
        for island in islands:
            island.step(ctx)
            if island.stalled >= c.restart_after:
                island.polish(ctx)
                island.restart(ctx)
            if search.exhausted():
                return islands
        now = min(i.best for i in islands)
        best, since = (now, 0) if now < best * (1 - 1e-12) else (best, since + 1)
        if since >= c.patience:
            break
        if gen >= c.prune_after and np.isfinite(best):
            islands = [i for i in islands if i.best <= c.prune_ratio * best]
        if stop_at is not None:
            evaluations, seconds = stop_at
            if (evaluations is not None and search.evaluations >= evaluations) or (
                seconds is not None and search.elapsed >= seconds
            ):
                break
    return islands
