"""``genetic``: UMPIPE's DGAP, a dual-chromosome genetic algorithm, with TiDGAP's fitness.

Encoding (one individual, ``S`` stages, ``N`` cluster devices, ``L`` layers):

- chromosome 1, the structure: ``cuts`` (``S-1`` increasing layer indices in ``[1, L)``, the
  stage boundaries) and ``assign`` (one gene per device: the stage it serves, or ``-1`` for
  unused). Several devices on one stage are replicas; unused devices are left out of the
  price, so the cost objective's provisioning (which devices to rent) is part of the search.
- chromosome 2, the data partition: ``mb``, one index per stage into the allowed microbatch
  sizes (divisors of the batch). Unequal per-stage sizes (UMPIPE) under GPipe; one shared
  size under 1F1B, when the problem fixes the microbatch count, or with ``unequal=False``.

Stage counts are **islands**: one population per ``S`` in ``[min_stages, max_stages]``,
evolved side by side (a :class:`PlanBatch` holds one stage count); after ``prune_after``
generations, islands whose best is worse than ``prune_ratio`` x the global best are dropped.

Start: per island, half the population is seeded (device assignments ranked by a busiest-
stage proxy, each with min-max balanced boundaries: :func:`seed_genomes`), half is random.
Per generation and island: elitism, tournament selection on (feasible first, then value;
infeasible ones ranked by how far they miss memory or the throughput target: a penalty, not
a death sentence), uniform crossover of each chromosome (the structure's two parts cross
together), mutation (cut shifts, device moves and swaps, microbatch steps, and now and then
boundaries re-balanced for the child's devices), repair (sorted distinct cuts, a device for
every stage, interchangeable devices in canonical order, equal microbatches where required)
and duplicates re-mutated: a genome is never costed twice. An island that stalls for
``restart_after`` generations is polished by steepest descent over one-step neighbours and
restarted afresh; the search stops after ``patience`` generations without a better plan, or
when ``search.exhausted()``.

Two phases when unequal microbatches are allowed: the islands first evolve with equal
microbatches (until ``patience``, or half the problem's budget), then the same populations go
on with per-stage sizes. Searching the larger space from the start lost to the equal search on
some instances (VGG16 on ``random1``: 8.7% above the exact equal optimum in 10 s, where
``unequal=False`` found it); widening a converged equal population keeps the equal optimum
found and spends the rest on what unequal sizes add.

Fitness is TiDGAP's: a whole brood is costed at once through ``search.evaluate`` (numpy over
the population), split only by the power of two of the largest microbatch count, since the
simulation's cost grows with it and not with the population size.

Quality against ``brute`` and ``dp``, search time and evaluations: ``bench/plan_quality.py``
(results in ``bench/results/plan_quality.json``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from agents.problem import Objective, Problem, ProblemError
from agents.registry import Planner
from agents.search import Search
from core.batch_eval import BatchEvaluator, PlanBatch
from core.cluster import ClusterSpec
from core.plan import Schedule

IntArray = np.ndarray
FloatArray = np.ndarray


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
    """Unequal per-stage microbatches (GPipe, free microbatch count only)."""
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


# --- the encoding (shared with ``bayes``) ----------------------------------------------------


@dataclass
class Genomes:
    """A population of ``P`` individuals with ``S`` stages: the two chromosomes as arrays."""

    cuts: IntArray  # (P, S-1) stage boundaries, strictly increasing in [1, L)
    assign: IntArray  # (P, N) stage of each device, -1 = unused
    mb: IntArray  # (P, S) index into the allowed microbatch sizes

    @property
    def size(self) -> int:
        return int(self.assign.shape[0])

    @property
    def stages(self) -> int:
        return int(self.mb.shape[1])

    def take(self, idx: IntArray) -> Genomes:
        return Genomes(self.cuts[idx].copy(), self.assign[idx].copy(), self.mb[idx].copy())

    def keys(self) -> list[bytes]:
        """One hashable key per individual (stage count included)."""
        flat = np.concatenate([self.cuts, self.assign, self.mb], axis=1).astype(np.int16)
        head = bytes([self.stages])
        return [head + row.tobytes() for row in flat]

    @staticmethod
    def concat(parts: list[Genomes]) -> Genomes:
        return Genomes(
            np.concatenate([g.cuts for g in parts]),
            np.concatenate([g.assign for g in parts]),
            np.concatenate([g.mb for g in parts]),
        )


def decode(g: Genomes, sizes: IntArray, n_layers: int) -> PlanBatch:
    """Genomes -> a :class:`PlanBatch` (replicas listed by device index, ``-1`` padded)."""
    P, S = g.size, g.stages
    bounds = np.concatenate(
        [np.zeros((P, 1), np.int64), g.cuts, np.full((P, 1), n_layers, np.int64)], axis=1
    )
    member = g.assign[:, None, :] == np.arange(S)[None, :, None]  # (P, S, N)
    R = max(int(member.sum(-1).max()), 1)
    order = np.argsort(~member, axis=-1, kind="stable")[:, :, :R]
    devices = np.where(np.take_along_axis(member, order, -1), order, -1)
    return PlanBatch(bounds.astype(np.int64), sizes[g.mb].astype(np.int64), devices)


def repair_cuts(cuts: IntArray, n_layers: int) -> IntArray:
    """Sorted, distinct boundaries in ``[1, L)``: every stage keeps at least one layer."""
    k = cuts.shape[1]
    c = np.sort(np.clip(cuts, 1, n_layers - 1), axis=1)
    for i in range(1, k):
        c[:, i] = np.maximum(c[:, i], c[:, i - 1] + 1)
    for i in range(k - 1, -1, -1):
        top = n_layers - 1 if i == k - 1 else c[:, i + 1] - 1
        c[:, i] = np.minimum(c[:, i], top)
    return c


def repair_devices(assign: IntArray, stages: int, rng: np.random.Generator) -> IntArray:
    """Give every stage a device: an unused one if any, else a spare replica of another stage.

    Always succeeds when ``stages <= N`` (pigeonhole). Stage genes beyond ``stages - 1``
    (from a larger-S parent) are first wrapped into range.
    """
    a = np.where(assign >= stages, assign % stages, assign)
    for s in range(stages):
        counts = (a[:, :, None] == np.arange(stages)).sum(1)  # (P, S)
        rows = np.flatnonzero(counts[:, s] == 0)
        if rows.size == 0:
            continue
        sub, c = a[rows], counts[rows]
        peers = np.where(sub >= 0, np.take_along_axis(c, np.maximum(sub, 0), 1), 0)
        priority = np.where(sub < 0, 0.0, np.where(peers >= 2, 1.0, np.inf))
        pick = np.argmin(priority + rng.random(sub.shape), axis=1)
        a[rows, pick] = s
    return a


def device_classes(cluster: ClusterSpec) -> list[IntArray]:
    """Indices of interchangeable devices: one type on one node (the cost model sees a device
    only through its type and its node), for classes of two or more."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, d in enumerate(cluster.device_ids):
        dev = cluster.device(d)
        groups.setdefault((dev.node, dev.type), []).append(i)
    return [np.array(g, dtype=np.int64) for g in groups.values() if len(g) > 1]


def canonical(assign: IntArray, classes: list[IntArray]) -> IntArray:
    """One representative per symmetry orbit: stage genes sorted (descending, so unused
    devices come last) within each device class. The plan's Estimate is unchanged, and
    duplicates become visible to the fitness cache."""
    out = assign.copy()
    for cols in classes:
        out[:, cols] = -np.sort(-out[:, cols], axis=1)
    return out


def repair(ctx: Context, g: Genomes) -> Genomes:
    """A valid, canonical individual: sorted distinct cuts, a device for every stage, equal
    microbatches where required."""
    cuts = repair_cuts(g.cuts, ctx.n_layers)
    assign = canonical(repair_devices(g.assign, g.stages, ctx.rng), ctx.classes)
    mb = np.repeat(g.mb[:, :1], g.stages, axis=1) if ctx.equal else g.mb
    return Genomes(cuts, assign, mb)


# --- the search context: problem tables, the fitness cache, the violation measure --------------


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
    fb_fixed: FloatArray = field(init=False)  # (T, L+1, L+1) forward + backward, fixed part
    fb_per_sample: FloatArray = field(init=False)  # (T, L+1, L+1) the per-sample part
    upper: np.ndarray = field(init=False)  # (L+1, L+1) a < b
    cache: dict[bytes, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = self.problem
        self.sizes = np.asarray(p.microbatch_sizes(), dtype=np.int64)
        self.equal = not (
            self.config.unequal and p.schedule is Schedule.GPIPE and p.microbatches is None
        )
        self.classes = device_classes(p.cluster)
        ev = self.evaluator
        self.fb_fixed = ev.fwd_fixed + ev.bwd_fixed
        self.fb_per_sample = ev.fwd_ps + ev.bwd_ps
        self.upper = np.triu(np.ones((self.n_layers + 1,) * 2, dtype=bool), 1)

    @property
    def evaluator(self) -> BatchEvaluator:
        return self.search.evaluator

    @property
    def n_layers(self) -> int:
        return len(self.problem.profile)

    @property
    def n_devices(self) -> int:
        return len(self.problem.cluster.device_ids)

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
        batch = decode(g, self.sizes, self.n_layers)
        value = self.search.evaluate(batch)
        viol = np.zeros(g.size)
        bad = ~np.isfinite(value)
        if bad.any():
            viol[bad] = violation(self, _rows(batch, bad))
        return value, viol


def _rows(batch: PlanBatch, mask: np.ndarray) -> PlanBatch:
    return PlanBatch(batch.bounds[mask], batch.microbatch[mask], batch.devices[mask])


def violation(ctx: Context, batch: PlanBatch) -> FloatArray:
    """How far each plan misses: memory excess (``need / capacity - 1``) plus, for the cost
    objective, the throughput shortfall of a steady-state upper bound on throughput."""
    ev, problem = ctx.evaluator, ctx.problem
    S, B = batch.num_stages, problem.global_batch
    start, end = batch.bounds[:, :-1], batch.bounds[:, 1:]
    valid = batch.devices >= 0
    dev = np.where(valid, batch.devices, 0)
    r = valid.sum(-1)
    b = batch.microbatch.astype(np.float64)
    m = B // batch.microbatch
    in_flight = m if problem.schedule is Schedule.GPIPE else np.minimum(S - np.arange(S), m)
    memory = 4.0 * ev.params[start, end] + in_flight * (b / r) * ev.acts[start, end]
    capacity = np.where(valid, ev.dev_capacity[dev], np.inf).min(-1)
    out = np.maximum((memory / capacity).max(-1) - 1.0, 0.0)
    if problem.objective is Objective.COST and problem.min_throughput:
        t = ev.dev_type[dev]
        n = (b / r)[..., None]
        a, e = start[..., None], end[..., None]
        op = ctx.fb_fixed[t, a, e] + n * ctx.fb_per_sample[t, a, e]
        busy = m * np.where(valid, op, 0.0).max(-1)  # (P, S) compute time of each stage
        best_tp = B / busy.max(-1)
        out += np.maximum(problem.min_throughput / best_tp - 1.0, 0.0)
    return out


# --- initial populations --------------------------------------------------------------------


def balanced_cuts(ctx: Context, assign: IntArray, mb: IntArray) -> tuple[IntArray, float]:
    """Boundaries minimising the busiest resource for one device assignment and microbatch
    choice: a stage's compute ``M_s (F_s + B_s)`` plus its update and all-reduce, or the link
    after it, ``M_s (latency + X b / bandwidth)`` (GPipe overlaps the two; the pipeline fill
    is ignored). A min-max dynamic program over contiguous splits, O(S L^2). Returns the
    boundaries and that time."""
    ev, L, B, S = ctx.evaluator, ctx.n_layers, ctx.problem.global_batch, mb.size
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    back = np.zeros((S, L + 1), dtype=np.int64)
    devs = [np.flatnonzero(assign == s) for s in range(S)]
    for s in range(S):
        t = ev.dev_type[devs[s]]
        b = float(ctx.sizes[mb[s]])
        m = B // b
        cost = m * (ctx.fb_fixed[t] + b / t.size * ctx.fb_per_sample[t]).max(0)
        cost = cost + _update_time(ctx, devs[s]) * ev.params  # optimizer step + all-reduce
        if s < S - 1:  # the busier direction of the link to the next stage
            cross = int(np.unique(ev.dev_node[np.concatenate(devs[s : s + 2])]).size > 1)
            b_link = max(b, float(ctx.sizes[mb[s + 1]]))
            link = m * (ev.link_lat[cross] + ev.cuts * b_link / ev.link_bps[cross])
            cost = np.maximum(cost, link[None, :])
        worst = np.where(ctx.upper, np.maximum(best[:, None], cost), np.inf)
        back[s], best = worst.argmin(0), worst.min(0)
    cuts, e = [], L
    for s in range(S - 1, 0, -1):
        e = int(back[s, e])
        cuts.append(e)
    return np.array(cuts[::-1], dtype=np.int64), float(best[L])


def _update_time(ctx: Context, devices: IntArray) -> float:
    """Seconds per parameter byte of a stage's update on ``devices`` (rule 8)."""
    ev, r = ctx.evaluator, devices.size
    update = 4.0 / (ev.dev_membw[devices].min() * 1e9)
    if r == 1:
        return update
    cross = int(np.unique(ev.dev_node[devices]).size > 1)
    return update + 2 * (r - 1) / r / ev.link_bps[cross]  # + latency, ignored here


def rebalance(ctx: Context, g: Genomes) -> Genomes:
    """The same individuals with :func:`balanced_cuts` boundaries."""
    out = g.take(np.arange(g.size))
    for i in range(g.size):
        out.cuts[i] = balanced_cuts(ctx, g.assign[i], g.mb[i])[0]
    return out


def _one_per_stage(ctx: Context, S: int, n: int) -> IntArray:
    """Up to ``n`` assignments of ``S`` distinct devices to the ``S`` stages: every ordered
    choice when there are at most ``n``, else the measured-fastest first and random ones."""
    N = ctx.n_devices
    if math.perm(N, S) <= n:
        picks = np.array(list(itertools.permutations(range(N), S)), dtype=np.int64)
    else:
        speed = ctx.fb_per_sample[ctx.evaluator.dev_type][:, 0, ctx.n_layers]
        fastest = np.argsort(speed, kind="stable")[:S]
        rand = np.argsort(ctx.rng.random((n - 2, N)), axis=1)[:, :S]
        picks = np.concatenate([fastest[None], fastest[None, ::-1], rand])
    assign = np.full((picks.shape[0], N), -1, dtype=np.int64)
    np.put_along_axis(assign, picks, np.arange(S)[None, :], axis=1)
    return assign


def candidates(ctx: Context, S: int, n: int) -> Genomes:
    """The ``n`` most promising structures by a cheap proxy, middle microbatch size.

    Candidate device assignments -- one device per stage (every ordered choice when few) and
    any with replicas and unused devices (all of them when few, else random ones) -- each get
    :func:`balanced_cuts` boundaries and are ranked by that busiest-resource time (times the
    price for the cost objective, those surely below the throughput target last).
    """
    N, mid = ctx.n_devices, len(ctx.sizes) // 2
    if (S + 1) ** N <= 2048:  # every assignment (stages or unused), repaired and canonical
        every = np.array(list(itertools.product(range(-1, S), repeat=N)), dtype=np.int64)
        spread = repair_devices(every, S, ctx.rng)
    else:
        spread = random_genomes(ctx, 512, S).assign
    assign = canonical(np.concatenate([_one_per_stage(ctx, S, 256), spread]), ctx.classes)
    mb = np.full(S, mid, dtype=np.int64)
    proxy = np.empty(assign.shape[0])
    cuts = np.empty((assign.shape[0], S - 1), dtype=np.int64)
    for i, a in enumerate(assign):
        cuts[i], proxy[i] = balanced_cuts(ctx, a, mb)
    if ctx.problem.objective is Objective.COST:
        price = np.where(assign >= 0, ctx.evaluator.dev_price[None, :], 0.0).sum(1)
        busy = proxy
        proxy = busy * price + 1e-9 * busy
        if ctx.problem.min_throughput:  # rough: the busiest resource is a lower bound
            proxy[ctx.problem.global_batch / busy < ctx.problem.min_throughput] = np.inf
    g = Genomes(cuts, assign, np.repeat(mb[None], assign.shape[0], axis=0))
    _, first = np.unique(np.array(g.keys()), return_index=True)
    return g.take(first[np.argsort(proxy[first], kind="stable")][:n])


def seed_genomes(ctx: Context, S: int) -> Genomes:
    """Sensible starting points, at most half the population: the ``seed_candidates`` best
    :func:`candidates` are costed (the proxy misses the pipeline fill and the dependencies),
    the best of those kept, and the very best also with every microbatch size."""
    K, half = len(ctx.sizes), max(ctx.config.population // 2, 1)
    g = candidates(ctx, S, ctx.config.seed_candidates)
    g = g.take(np.argsort(ranking(*ctx.fitness(g)))[: max(half - K, 1)])
    top = g.take(np.zeros(K, dtype=np.int64))
    top.mb[:] = np.arange(K)[:, None]
    g = Genomes.concat([rebalance(ctx, top), g])
    return g.take(np.arange(min(g.size, half)))


def random_genomes(ctx: Context, n: int, S: int) -> Genomes:
    rng, L, N, K = ctx.rng, ctx.n_layers, ctx.n_devices, len(ctx.sizes)
    cuts = np.sort(np.argsort(rng.random((n, L - 1)), axis=1)[:, : S - 1] + 1, axis=1)
    assign = rng.integers(0, S, size=(n, N))
    assign[rng.random((n, N)) < ctx.config.unused_rate] = -1
    base = rng.integers(0, K, size=(n, 1))
    step = rng.integers(-1, 2, size=(n, S)) * (rng.random((n, S)) < 0.3)
    mb = np.clip(base + step, 0, K - 1)
    return repair(ctx, Genomes(cuts, assign, mb))


# --- operators ------------------------------------------------------------------------------


def tournament(rank: IntArray, n: int, k: int, rng: np.random.Generator) -> IntArray:
    """``n`` winners of ``k``-way tournaments (lower rank wins)."""
    contestants = rng.integers(0, rank.size, size=(n, k))
    return np.take_along_axis(contestants, rank[contestants].argmin(1)[:, None], 1)[:, 0]


def crossover(a: Genomes, b: Genomes, rate: float, rng: np.random.Generator) -> Genomes:
    """Uniform crossover of each chromosome, each crossed with probability ``rate``."""

    def mix(x: IntArray, y: IntArray) -> IntArray:
        crossed = rng.random((x.shape[0], 1)) < rate
        pick = crossed & (rng.random(x.shape) < 0.5)
        return np.where(pick, y, x)

    structure = rng.random((a.size, 1)) < rate  # cuts and devices cross together
    cut_pick = structure & (rng.random(a.cuts.shape) < 0.5)
    dev_pick = structure & (rng.random(a.assign.shape) < 0.5)
    return Genomes(
        np.where(cut_pick, b.cuts, a.cuts), np.where(dev_pick, b.assign, a.assign), mix(a.mb, b.mb)
    )


def mutate(ctx: Context, g: Genomes) -> Genomes:
    """Cut shifts (geometric steps), device moves (to a stage or out) and swaps, and
    microbatch-size steps, each at its configured rate; then :func:`repair`."""
    rng, c, S, K = ctx.rng, ctx.config, g.stages, len(ctx.sizes)
    P, N = g.assign.shape
    hit = rng.random(g.cuts.shape) < c.cut_mutation
    step = rng.choice([-1, 1], size=g.cuts.shape) * rng.geometric(0.5, size=g.cuts.shape)
    cuts = g.cuts + hit * step
    assign = g.assign.copy()
    move = rng.random((P, N)) < c.device_mutation
    fresh = np.where(rng.random((P, N)) < c.unused_rate, -1, rng.integers(0, S, size=(P, N)))
    assign = np.where(move, fresh, assign)
    swap = np.flatnonzero(rng.random(P) < c.device_mutation * 2)
    i, j = rng.integers(0, N, size=swap.size), rng.integers(0, N, size=swap.size)
    assign[swap, i], assign[swap, j] = assign[swap, j], assign[swap, i]
    mb_hit = rng.random(g.mb.shape) < c.microbatch_mutation
    mb = np.clip(g.mb + mb_hit * rng.choice([-1, 1], size=g.mb.shape), 0, K - 1)
    return repair(ctx, Genomes(cuts, assign, mb))


def duplicates(ctx: Context, g: Genomes) -> np.ndarray:
    """Individuals already costed, or repeated within ``g``."""
    seen: set[bytes] = set()
    out = np.zeros(g.size, dtype=bool)
    for i, key in enumerate(g.keys()):
        out[i] = key in ctx.cache or key in seen
        seen.add(key)
    return out


def ranking(value: FloatArray, viol: FloatArray) -> IntArray:
    """Rank of each individual: feasible ones by value, then infeasible ones by violation."""
    feasible = np.isfinite(value)
    order = np.lexsort((np.where(feasible, value, viol), ~feasible))
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank


# --- islands and the planner ----------------------------------------------------------------


def neighbours(ctx: Context, g: Genomes) -> Genomes:
    """Every one-step change of one individual: a boundary shifted by 1 or 2 layers, a device
    moved to another stage (or out), two devices' stages swapped, a microbatch-size step or
    one stage's size for all, and the boundaries re-balanced."""
    S, N, K = g.stages, ctx.n_devices, len(ctx.sizes)
    out: list[Genomes] = []
    for i, step in itertools.product(range(S - 1), (-2, -1, 1, 2)):
        n = g.take(np.zeros(1, dtype=np.int64))
        n.cuts[0, i] += step
        out.append(n)
    for d, slot in itertools.product(range(N), range(-1, S)):
        if slot != g.assign[0, d]:
            n = g.take(np.zeros(1, dtype=np.int64))
            n.assign[0, d] = slot
            out.append(n)
    for d, e in itertools.combinations(range(N), 2):
        if g.assign[0, d] != g.assign[0, e]:
            n = g.take(np.zeros(1, dtype=np.int64))
            n.assign[0, [d, e]] = g.assign[0, [e, d]]
            out.append(n)
    for s, step in itertools.product(range(1 if ctx.equal else S), (-1, 0, 1)):
        n = g.take(np.zeros(1, dtype=np.int64))
        size = min(max(n.mb[0, s] + step, 0), K - 1)
        if step:
            n.mb[0, s] = size
        else:  # every stage takes this stage's size
            n.mb[0, :] = size
        out.append(n)
    out.append(rebalance(ctx, g))
    return repair(ctx, Genomes.concat(out))


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
