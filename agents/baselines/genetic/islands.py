"""The ``genetic`` planner's loop: one island (population) per stage count, evolved side by
side, stalled islands polished and restarted, far-behind ones dropped.

Stage counts are **islands**: one population per ``S`` in ``[min_stages, max_stages]`` (a
:class:`PlanBatch` holds one stage count); after ``prune_after`` generations, islands whose
best is worse than ``prune_ratio`` x the global best are dropped. Per generation and island:
elitism, tournament selection, crossover, mutation, now and then boundaries re-balanced for
the child's devices, repair, and duplicates re-mutated. An island that stalls for
``restart_after`` generations is polished by steepest descent over one-step neighbours and
restarted afresh; the search stops after ``patience`` generations without a better plan, or
when ``search.exhausted()``.

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
    def start(cls, ctx: Context, S: int) -> Island:
        seeds = seed_genomes(ctx, S)
        g = Genomes.concat([seeds, random_genomes(ctx, ctx.config.population - seeds.size, S)])
        g = repair(ctx, g)
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
        for _ in range(3):  # re-mutate children already costed or twice in this brood
            dup = duplicates(ctx, children)
            if not dup.any():
                break
            redo = mutate(ctx, children.take(np.flatnonzero(dup)))
            children.cuts[dup], children.assign[dup], children.mb[dup] = (
                redo.cuts,
                redo.assign,
                redo.mb,
            )
        before = float(self.value.min())
        self._replace(elite, children, *ctx.fitness(children))
        improved = self.value.min() < before * (1 - 1e-12)
        self.stalled = 0 if improved else self.stalled + 1

    def polish(self, ctx: Context) -> None:
        """Steepest descent from the best individual over :func:`neighbours`."""
        while not ctx.search.exhausted():
            i = int(np.argmin(ranking(self.value, self.viol)))
            near = neighbours(ctx, self.genomes.take(np.array([i])))
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
        islands: list[Island] = []
        for S in stage_range(problem, c.min_stages, c.max_stages):
            islands.append(Island.start(ctx, S))
            if search.exhausted():
                return
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
