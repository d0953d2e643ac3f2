"""What every island of the ``genetic`` planner shares: its options, the problem's tables,
randomness, and TiDGAP's fitness with its cache.

Fitness is TiDGAP's: a whole brood is costed at once through ``search.evaluate`` (numpy over
the population), split only by the power of two of the largest microbatch count, since the
simulation's cost grows with it and not with the population size. A genome is never costed
twice (the cache). Infeasible plans get a :func:`violation` (how far they miss memory or the
throughput target), so that selection can rank them instead of discarding them.

Recomputation is not a gene: a decoded plan recomputes the activations of exactly the stages
that are over memory without it and hold less with it (:func:`with_recompute`), so a plan
that fits is costed as it always was, and one that fits only by recomputing is not lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeplan.agents.baselines.genetic.genome import (
    FloatArray,
    Genomes,
    IntArray,
    decode,
    device_classes,
)
from pipeplan.agents.problem import Objective, Problem, ProblemError
from pipeplan.agents.search import Search
from pipeplan.core import rules
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.plan import Schedule
from pipeplan.core.schedules import microbatch_count, one_f_one_b_warmups, population_warmups
from pipeplan.core.tables import CostTables


@dataclass(frozen=True)
class GeneticConfig:
    """Options of the ``genetic`` planner."""

    population: int = 40
    """Individuals per stage-count island."""
    generations: int = 150
    """Upper bound on generations."""
    elite: int = 4
    """Best individuals copied unchanged into the next generation."""
    tournament: int = 3
    """Contestants per tournament selection."""
    crossover_rate: float = 0.9
    """Probability that a chromosome is crossed (each chromosome)."""
    cut_mutation: float = 0.25
    """Probability per stage boundary of being shifted."""
    device_mutation: float = 0.12
    """Probability per device of being moved to another stage."""
    microbatch_mutation: float = 0.2
    """Probability per stage of a microbatch-size step."""
    unused_rate: float = 0.25
    """Probability that a random device gene is "unused"."""
    seed_candidates: int = 96
    """Seed candidates costed per island (chosen by a cheap proxy from many more)."""
    rebalance_rate: float = 0.1
    """Probability that a child's boundaries are re-balanced."""
    unequal: bool = True
    """Unequal per-stage microbatches (either schedule; free microbatch count only)."""
    min_stages: int = 1
    """Fewest stages tried (one island per stage count)."""
    max_stages: int | None = None
    """Most stages tried; None: as many as devices (and layers)."""
    patience: int = 40
    """Stop after this many generations without a better plan (or when the budget runs out)."""
    restart_after: int = 12
    """An island stalled this long is polished, then restarted afresh."""
    prune_after: int = 12
    """Generations before far-behind islands are dropped."""
    prune_ratio: float = 1.25
    """Drop islands whose best > this x the global best."""
    max_islands: int = 12
    """Most stage-count islands: with more stage counts allowed, those nearest the stage
    counts of the seeds that fit in memory."""

    def __post_init__(self) -> None:
        checks = [
            ("population", self.population >= 4, self.population),
            ("generations", self.generations >= 0, self.generations),
            ("elite", 0 <= self.elite < self.population, self.elite),
            ("tournament", self.tournament >= 1, self.tournament),
            ("seed_candidates", self.seed_candidates >= 1, self.seed_candidates),
            ("min_stages", self.min_stages >= 1, self.min_stages),
            ("patience", self.patience >= 1, self.patience),
            ("restart_after", self.restart_after >= 1, self.restart_after),
            ("prune_after", self.prune_after >= 0, self.prune_after),
            ("prune_ratio", self.prune_ratio >= 1.0, self.prune_ratio),
            ("max_islands", self.max_islands >= 1, self.max_islands),
        ]
        for key in (
            "crossover_rate",
            "cut_mutation",
            "device_mutation",
            "microbatch_mutation",
            "rebalance_rate",
        ):
            checks.append((key, 0.0 <= getattr(self, key) <= 1.0, getattr(self, key)))
        checks.append(("unused_rate", 0.0 <= self.unused_rate < 1.0, self.unused_rate))
        if self.max_stages is not None:
            checks.append(("max_stages", self.max_stages >= self.min_stages, self.max_stages))
        for key, ok, value in checks:
            if not ok:
                raise ProblemError(f"genetic.{key}: out of range, got {value!r}")


@dataclass
class Context:
    """What every island shares: the problem, its tables, randomness and the fitness cache."""

    problem: Problem
    search: Search
    config: GeneticConfig
    rng: np.random.Generator
    sizes: IntArray = field(init=False)
    equal: bool = field(init=False)
    classes: list[IntArray] = field(init=False)
    tables: CostTables = field(init=False)
    fb_fixed: FloatArray = field(init=False)  # (T, L+1, L+1) forward + backward, fixed part
    fb_per_sample: FloatArray = field(init=False)  # (T, L+1, L+1) the per-sample part
    upper: np.ndarray = field(init=False)  # (L+1, L+1) a < b
    cache: dict[bytes, tuple[float, float]] = field(default_factory=dict)
    _warmups: dict[bytes, IntArray] = field(default_factory=dict)
    stage_memo: dict[tuple[bytes, float, bytes | None, float], FloatArray] = field(
        default_factory=dict
    )
    """Balancing's stage tables by (devices, microbatch, next stage's devices, its
    microbatch): re-balancing asks for the same stages again and again."""

    def __post_init__(self) -> None:
        p = self.problem
        self.sizes = np.asarray(p.microbatch_sizes(), dtype=np.int64)
        self.equal = not (self.config.unequal and p.microbatches is None)
        self.classes = device_classes(p.cluster)
        tb = self.tables = CostTables.of(p.profile, p.cluster)
        self.fb_fixed = tb.fwd_fixed_range + tb.bwd_fixed_range
        self.fb_per_sample = tb.fwd_per_sample_range + tb.bwd_per_sample_range
        self.upper = np.triu(np.ones((self.n_layers + 1,) * 2, dtype=bool), 1)

    @property
    def n_layers(self) -> int:
        return len(self.problem.profile)

    @property
    def n_devices(self) -> int:
        return len(self.problem.cluster.device_ids)

    def warmups(self, mb: IntArray) -> IntArray:
        """1F1B warm-up forwards of each stage for one individual's microbatch choice
        (:func:`core.schedules.one_f_one_b_warmups`; zeros under GPipe), cached."""
        key = mb.astype(np.int16).tobytes()
        if key not in self._warmups:
            sizes = self.sizes[mb]
            B = self.problem.global_batch
            self._warmups[key] = (
                np.array(one_f_one_b_warmups([int(v) for v in sizes], B), dtype=np.int64)
                if self.problem.schedule is Schedule.ONE_F_ONE_B
                else np.zeros(mb.size, dtype=np.int64)
            )
        return self._warmups[key]

    def fitness(self, g: Genomes) -> tuple[FloatArray, FloatArray]:
        """(objective value, violation) per individual; cached genomes are not re-costed."""
        keys = g.keys()
        value, viol = np.full(g.size, np.inf), np.full(g.size, np.inf)
        todo: dict[bytes, list[int]] = {}
        for i, k in enumerate(keys):
            if k in self.cache:
                value[i], viol[i] = self.cache[k]
            else:
                todo.setdefault(k, []).append(i)
        first = np.array([idx[0] for idx in todo.values()], dtype=np.int64)
        for rows in self._chunks(g, first):
            if self.search.exhausted():
                break
            v, w = self._cost(g.take(rows))
            for r, vi, wi in zip(rows, v, w, strict=True):
                for j in todo[keys[r]]:
                    value[j], viol[j] = vi, wi
                self.cache[keys[r]] = (float(vi), float(wi))
        return value, viol

    def _chunks(self, g: Genomes, rows: IntArray) -> Iterator[IntArray]:
        """Rows grouped by the power of two of their largest microbatch count (simulation
        time grows with it), capped by the evaluation budget."""
        left = self.search.remaining_evaluations
        if left is not None:
            rows = rows[:left]
        if rows.size == 0:
            return
        mmax = (self.problem.global_batch // self.sizes[g.mb[rows]]).max(1)
        bucket = np.ceil(np.log2(mmax)).astype(np.int64)
        for b in np.unique(bucket):
            yield rows[bucket == b]

    def _cost(self, g: Genomes) -> tuple[FloatArray, FloatArray]:
        batch = with_recompute(self, decode(g, self.sizes, self.n_layers))
        value = self.search.evaluate(batch)
        viol = np.zeros(g.size)
        bad = ~np.isfinite(value)
        if bad.any():
            viol[bad] = violation(self, _rows(batch, bad))
        return value, viol


def _rows(batch: PlanBatch, mask: np.ndarray) -> PlanBatch:
    return batch.rows(mask)


def memory_ratio(ctx: Context, batch: PlanBatch) -> FloatArray:
    """(P, S): each stage's memory per device over its smallest device's capacity (the cost
    model's rule 9, and 9r for the stages ``batch`` has recompute); a plan fits when no
    stage is above 1."""
    return _ratios(ctx, batch)[1]


def with_recompute(ctx: Context, batch: PlanBatch) -> PlanBatch:
    """``batch`` with recomputation on the stages over memory without it that need less
    with it (rule 9r); None (no stage recomputes) when there are none."""
    plain, again = _ratios(ctx, batch, np.ones(batch.microbatch.shape, dtype=bool))
    recompute = (plain > 1.0) & (again < plain)
    return PlanBatch(
        batch.bounds, batch.microbatch, batch.devices, recompute if recompute.any() else None
    )


def _ratios(
    ctx: Context, batch: PlanBatch, recompute: np.ndarray | None = None
) -> tuple[FloatArray, FloatArray]:
    """(P, S) memory ratios without recomputation, and with it where ``recompute`` (default
    ``batch.recompute``; with neither, the same array twice)."""
    recompute = batch.recompute if recompute is None else recompute
    tb, problem = ctx.tables, ctx.problem
    B = problem.global_batch
    start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
    valid = batch.devices >= 0
    dev = np.where(valid, batch.devices, 0)
    r = valid.sum(-1)
    b = batch.microbatch.astype(np.float64)
    warmups = (
        population_warmups(batch.microbatch, B)
        if problem.schedule is Schedule.ONE_F_ONE_B
        else np.zeros_like(batch.microbatch)
    )
    held = rules.held_microbatches(problem.schedule, b, B, warmups)
    share = rules.replica_share(b, r)
    params, acts = tb.params_range[start, end], tb.acts_range[start, end]
    capacity = np.where(valid, tb.dev_capacity[dev], np.inf).min(-1)
    plain = np.asarray(rules.memory_bytes(params, acts, share, held) / capacity)
    if recompute is None:
        return plain, plain
    again = rules.recompute_memory_bytes(params, tb.cuts[start], acts, share, held) / capacity
    return plain, np.where(recompute, again, plain)


def violation(ctx: Context, batch: PlanBatch) -> FloatArray:
    """How far each plan misses: memory excess (``need / capacity - 1``, worst stage) plus,
    for the cost objective, the throughput shortfall of a steady-state upper bound on
    throughput."""
    tb, problem = ctx.tables, ctx.problem
    out = np.maximum(memory_ratio(ctx, batch).max(-1) - 1.0, 0.0)
    if problem.objective is Objective.COST and problem.min_throughput:
        B = problem.global_batch
        start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
        valid = batch.devices >= 0
        dev = np.where(valid, batch.devices, 0)
        m = microbatch_count(B, batch.microbatch)
        share = rules.replica_share(batch.microbatch.astype(np.float64), valid.sum(-1))
        t = tb.dev_type[dev]
        n = share[..., None]
        a, e = start[..., None], end[..., None]
        op = rules.compute_s(ctx.fb_fixed[t, a, e], ctx.fb_per_sample[t, a, e], n)
        busy = m * np.where(valid, op, 0.0).max(-1)  # (P, S) compute time of each stage
        best_tp = B / busy.max(-1)
        out += np.maximum(problem.min_throughput / best_tp - 1.0, 0.0)
    return out
