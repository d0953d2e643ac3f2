"""``greedy``: HeterPS's layer-scheduling heuristic, then greedy load balancing.

1. **Classify** each layer (:func:`data_intensive`). Embeddings are data-intensive; a layer
   with arithmetic (conv, fc, attention, other) is data-intensive when its activation bytes
   per FLOP exceed a threshold, by default the *ridge point* of the fastest device type
   (memory bytes/s over FLOP/s): above it the layer is memory-bound even there, so a fast
   accelerator buys it little. Cheap element-wise layers (relu, pool, pad, norm, dropout, add,
   concat, flatten, and anything with neither FLOPs nor parameters) have a high ratio but
   almost no cost; they follow the class of the layer before them (at the start, of the
   first classified layer), so a ReLU does not cut a conv stack in two.
2. **Schedule** (:func:`initial_structure`): data-intensive runs go to CPU-like devices (the
   lowest-FLOP/s type), compute-intensive runs to the fastest devices, each run of one class
   a stage. When there are more runs than devices of a kind, the smallest data-intensive runs
   (by parameter + activation bytes) are folded into their compute neighbours. A cluster of
   one device type has nothing CPU-like: everything is compute-intensive.
3. **Balance** (time; greedy hill climbing through ``search.evaluate``, every allowed
   microbatch size per candidate): each round costs the moves below and takes the best one
   while it improves the batch time: move a boundary to even out the estimated times of its
   two stages, or by one layer either way; add the fastest free device as a replica of the
   bottleneck stage; split the bottleneck stage in two with the fastest free device (needed
   when a stage does not fit in memory, and how the heuristic grows a pipeline). The
   bottleneck is the stage with the largest estimated compute time, and also the one
   fullest in memory. No move removes a stage: the layer schedule of step 2 stands, as in
   HeterPS, even where a CPU stage slows the pipeline (``compare`` shows what that costs).
4. **Provision** (cost objective only): from the balanced plan, drop devices greedily, the
   most expensive price level first (a replica, or a whole stage merged into a neighbour,
   each costed as is and with its boundaries re-balanced for the devices left), while the
   cost per sample improves and the throughput stays >= ``min_throughput``; boundaries are
   fine-tuned after each drop.

Plans that do not fit in memory or miss the throughput target are compared by their batch
time and then by how far they are over memory, so the climb can walk out of infeasibility.
The cost model is queried twice per population (once through ``search.evaluate``, which
counts and scores, once raw for batch time and memory, which ``Search`` does not expose).
No randomness: the seed is unused and the result is deterministic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from pipeplan.agents.baselines.common import devices_fastest_first, population
from pipeplan.agents.problem import Objective, Problem
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.profile import ModelProfile
from pipeplan.core.tables import CostTables

FOLLOWERS = frozenset({"relu", "pool", "pad", "norm", "dropout", "add", "concat", "flatten"})

Bounds = tuple[int, ...]
Devices = tuple[tuple[int, ...], ...]
Structure = tuple[Bounds, Devices]  # stage boundaries, device indices per stage
Key = tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class GreedyConfig:
    """Options of the greedy planner."""

    threshold: float | None = None
    """Activation bytes per FLOP above which a layer is data-intensive (None: ridge point)."""
    max_rounds: int = 200
    """Most improving moves taken per balancing phase."""

    def __post_init__(self) -> None:  # TypeError: the registry reports it as a ProblemError
        if self.threshold is not None and not self.threshold > 0:
            raise TypeError(f"threshold: must be > 0, got {self.threshold!r}")
        if self.max_rounds < 0:
            raise TypeError(f"max_rounds: must be >= 0, got {self.max_rounds!r}")


@dataclasses.dataclass(frozen=True)
class Assessment:
    """A structure's best over the microbatch sizes: objective value, batch time among plans
    that fit, smallest worst memory / capacity ratio; and the estimated memory overflow
    summed over its stages (a tie-break that rewards relieving any stage, not only the
    fullest)."""

    value: float
    time: float
    memory: float
    overflow: float


class GreedyPlanner(Planner):
    name = "greedy"
    Config = GreedyConfig

    def search(self, problem: Problem, search: Search) -> None:
        climb(problem, search, self.config)


def climb(
    problem: Problem,
    search: Search,
    config: GreedyConfig | None = None,
    stop: Callable[[], bool] | None = None,
) -> Structure:
    """The greedy plan's structure (steps 1-4), its evaluations recorded in ``search``;
    ``stop`` (besides the search's budget) ends the climb early, for planners that start
    from greedy's answer within a share of their own budget."""
    c = GreedyConfig() if config is None else config
    threshold = c.threshold or ridge_point(problem.cluster)
    labels = data_intensive(problem.profile, threshold)
    sizes = [float(x.params_bytes + x.activation_bytes) for x in problem.profile.layers]
    start = initial_structure(problem.cluster, labels, sizes)
    climber = _Climber(problem, search, c.max_rounds, stop)
    state, _ = climber.run(start, climber.balance, _time_key)
    if problem.objective is Objective.COST:
        state = climber.provision(state)
    return state


# --- classification and the initial schedule ---------------------------------------------------


def ridge_point(cluster: ClusterSpec) -> float:
    """Bytes per FLOP at which the fastest device type turns from memory- to compute-bound."""
    fastest = max(cluster.counts_by_type(), key=lambda t: cluster.device_types[t].flops)
    t = cluster.device_types[fastest]
    return t.memory_bandwidth_gbps * rules.GB / t.flops


def data_intensive(profile: ModelProfile, threshold: float) -> list[bool]:
    """Per layer: True = data-intensive (to a CPU), False = compute-intensive."""
    decided: list[bool | None] = []
    for layer in profile.layers:
        if layer.op == "embedding":
            decided.append(True)
        elif layer.op in FOLLOWERS or (layer.flops == 0 and layer.params_bytes == 0):
            decided.append(None)
        elif layer.flops == 0:  # parameters but no arithmetic: a table lookup
            decided.append(True)
        else:
            decided.append(layer.activation_bytes / layer.flops > threshold)
    current = next((v for v in decided if v is not None), False)
    labels = []
    for v in decided:
        current = current if v is None else v
        labels.append(current)
    return labels


def runs(labels: Sequence[bool]) -> list[tuple[int, int, bool]]:
    """Maximal runs of equal labels: ``(start, end, label)``."""
    out: list[tuple[int, int, bool]] = []
    for i, v in enumerate(labels):
        if out and out[-1][2] == v:
            out[-1] = (out[-1][0], i + 1, v)
        else:
            out.append((i, i + 1, v))
    return out


def initial_structure(
    cluster: ClusterSpec, labels: Sequence[bool], sizes: Sequence[float] | None = None
) -> Structure:
    """Data-intensive runs on CPU-like devices, compute runs on the fastest, a stage each.

    ``sizes`` (bytes per layer) ranks data-intensive runs when some must be folded into
    compute stages for lack of devices; without it, layer counts do.
    """
    order = devices_fastest_first(cluster)
    ids = cluster.device_ids
    flops = {i: cluster.device_type(ids[i]).flops for i in order}
    slowest = min(flops.values())
    cpu = [i for i in order if flops[i] == slowest]
    fast = [i for i in order if flops[i] != slowest]
    labels = list(labels)
    if not fast:  # one speed only: nothing is CPU-like
        labels, fast, cpu = [False] * len(labels), order, []
    weight = list(sizes) if sizes is not None else [1.0] * len(labels)
    while True:
        rs = runs(labels)
        data = [r for r in rs if r[2]]
        if len(data) <= len(cpu) and len(rs) - len(data) <= len(fast):
            break
        a, b, _ = min(data, key=lambda r: (sum(weight[r[0] : r[1]]), r[0]))
        labels[a:b] = [False] * (b - a)
    cpu_it, fast_it = iter(cpu), iter(fast)
    devices = tuple((next(cpu_it) if v else next(fast_it),) for _, _, v in rs)
    return (0, *(b for _, b, _ in rs)), devices


# --- search -------------------------------------------------------------------------------------


def _time_key(a: Assessment) -> Key:
    return (a.time, a.memory, a.overflow)


def _cost_key(a: Assessment) -> Key:
    return (a.value, a.time, a.memory, a.overflow)


class _StageTimes:
    """Rough stage estimates that steer the balancing (the cost model judges the moves):
    compute time for the whole batch in one go, and memory over capacity."""

    def __init__(self, tables: CostTables, batch: int) -> None:
        self.tables, self.batch = tables, batch

    def __call__(self, a: int, b: int, devices: Iterable[int]) -> float:
        devs = list(devices)
        n = rules.replica_share(self.batch, len(devs))
        types = {int(self.tables.dev_type[d]) for d in devs}
        return max(float(self.tables.fb_time(t, a, b, n)) for t in types)

    def memory(self, a: int, b: int, devices: Sequence[int]) -> float:
        """GPipe's footprint (rule 9) over the smallest capacity: ``M`` microbatches of
        ``ceil(b / r)`` samples are about ``ceil(B / r)`` (rule 2i), taken for every
        microbatch size."""
        tb = self.tables
        share = rules.replica_share(self.batch, len(devices))
        need = rules.memory_bytes(tb.params(a, b), tb.acts(a, b), share, 1)
        return float(need / min(tb.dev_capacity[d] for d in devices))

    def bottleneck(self, state: Structure) -> int:
        bounds, devices = state
        times = [self(bounds[s], bounds[s + 1], devices[s]) for s in range(len(devices))]
        return int(np.argmax(times))

    def overflow(self, state: Structure) -> float:
        bounds, devices = state
        ratios = [self.memory(bounds[s], bounds[s + 1], devices[s]) for s in range(len(devices))]
        return sum(max(r - 1.0, 0.0) for r in ratios)

    def fullest(self, state: Structure) -> int:
        bounds, devices = state
        ratios = [self.memory(bounds[s], bounds[s + 1], devices[s]) for s in range(len(devices))]
        return int(np.argmax(ratios))

    def even_cut(self, a: int, b: int, left: Iterable[int], right: Iterable[int]) -> int:
        """The cut ``a < p < b`` that best evens out ``[a, p)`` on ``left``, ``[p, b)`` on
        ``right``."""
        lt, rt = tuple(left), tuple(right)
        return min(range(a + 1, b), key=lambda p: max(self(a, p, lt), self(p, b, rt)))

    def rebalance(self, state: Structure) -> Structure:
        """Even out neighbouring stages, boundary by boundary, for a few sweeps (estimates
        only, no evaluation)."""
        bounds, devices = list(state[0]), state[1]
        for _ in range(len(devices)):
            before = list(bounds)
            for k in range(1, len(bounds) - 1):
                bounds[k] = self.even_cut(bounds[k - 1], bounds[k + 1], devices[k - 1], devices[k])
            if bounds == before:
                break
        return tuple(bounds), devices


class _Climber:
    """Greedy improvement of a structure through ``search.evaluate``."""

    def __init__(
        self,
        problem: Problem,
        search: Search,
        max_rounds: int,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.problem, self.search, self.max_rounds = problem, search, max_rounds
        self.stop = stop
        self.times = _StageTimes(search.evaluator.tables, problem.global_batch)
        self.fastest = devices_fastest_first(problem.cluster)
        ids = problem.cluster.device_ids
        self.price = [problem.cluster.device_type(d).price_per_hour for d in ids]

    def exhausted(self) -> bool:
        return self.search.exhausted() or (self.stop is not None and self.stop())

    # --- evaluation --------------------------------------------------------------------------

    def assess(self, states: Sequence[Structure]) -> list[Assessment]:
        out: dict[int, Assessment] = {}
        by_stages: dict[int, list[int]] = {}
        for i, (_, devices) in enumerate(states):
            by_stages.setdefault(len(devices), []).append(i)
        p, sizes = self.problem, self.problem.microbatch_sizes()
        for idx in by_stages.values():
            batch = population([states[i][0] for i in idx], [states[i][1] for i in idx], sizes)
            values = self.search.evaluate(batch).reshape(len(sizes), len(idx))
            raw = self.search.evaluator.evaluate(batch, p.global_batch, p.schedule)
            times = np.where(raw.fits, raw.batch_time_s, np.inf).reshape(len(sizes), len(idx))
            memory = raw.memory_ratio.reshape(len(sizes), len(idx))
            for k, i in enumerate(idx):
                out[i] = Assessment(
                    float(values[:, k].min()),
                    float(times[:, k].min()),
                    float(memory[:, k].min()),
                    self.times.overflow(states[i]),
                )
        return [out[i] for i in range(len(states))]

    def run(
        self,
        state: Structure,
        moves: Callable[[Structure], list[Structure]],
        key: Callable[[Assessment], Key],
    ) -> tuple[Structure, Key]:
        """Take the best move while it improves ``key``; the last state and its key."""
        current = key(self.assess([state])[0])
        for _ in range(self.max_rounds):
            if self.exhausted():
                break
            candidates = list(dict.fromkeys(c for c in moves(state) if c != state))
            if not candidates:
                break
            keys = [key(a) for a in self.assess(candidates)]
            best = min(range(len(keys)), key=keys.__getitem__)
            if not keys[best] < current:
                break
            state, current = candidates[best], keys[best]
        return state, current

    # --- moves -------------------------------------------------------------------------------

    def free(self, state: Structure) -> list[int]:
        used = {d for devs in state[1] for d in devs}
        return [d for d in self.fastest if d not in used]

    def shifts(self, state: Structure) -> list[Structure]:
        """Every boundary: to the cut that evens out its two stages, and one layer each way."""
        bounds, devices = state
        out = []
        for k in range(1, len(bounds) - 1):
            a, b = bounds[k - 1], bounds[k + 1]
            cuts = [self.times.even_cut(a, b, devices[k - 1], devices[k])]
            cuts += [bounds[k] - 1, bounds[k] + 1]
            for p in cuts:
                if a < p < b:
                    out.append(((*bounds[:k], p, *bounds[k + 1 :]), devices))
        return out

    def balance(self, state: Structure) -> list[Structure]:
        """Shifts, plus a replica for / a split of the bottleneck stage (the slowest, and the
        fullest in memory) on the fastest free device."""
        out = self.shifts(state)
        free = self.free(state)
        if not free:
            return out
        bounds, devices = state
        new = free[0]
        for s in dict.fromkeys((self.times.bottleneck(state), self.times.fullest(state))):
            out.append((bounds, (*devices[:s], (*devices[s], new), *devices[s + 1 :])))
            a, b = bounds[s], bounds[s + 1]
            if b - a < 2:
                continue
            for left, right in ((devices[s], (new,)), ((new,), devices[s])):
                p = self.times.even_cut(a, b, left, right)
                split = (*bounds[: s + 1], p, *bounds[s + 1 :])
                out.append((split, (*devices[:s], left, right, *devices[s + 1 :])))
        return out

    def drops(self, state: Structure, price: float) -> list[Structure]:
        """The structure without one device of this price: a replica, or a stage merged into
        a neighbour; each also with its boundaries re-balanced for the devices left."""
        bounds, devices = state
        out: list[Structure] = []
        for s, devs in enumerate(devices):
            for d in devs:
                if self.price[d] != price:
                    continue
                if len(devs) > 1:
                    rest = tuple(x for x in devs if x != d)
                    out.append((bounds, (*devices[:s], rest, *devices[s + 1 :])))
                    continue
                others = (*devices[:s], *devices[s + 1 :])
                if s > 0:  # into the stage before: drop the boundary where s starts
                    out.append(((*bounds[:s], *bounds[s + 1 :]), others))
                if s < len(devices) - 1:  # into the stage after: drop where s ends
                    out.append(((*bounds[: s + 1], *bounds[s + 2 :]), others))
        return out + [self.times.rebalance(c) for c in out]

    def provision(self, state: Structure) -> Structure:
        """Drop devices, most expensive first, while the cost per sample improves."""
        current = _cost_key(self.assess([state])[0])
        improved = True
        while improved and not self.exhausted():
            improved = False
            levels = sorted({self.price[d] for devs in state[1] for d in devs}, reverse=True)
            for price in levels:
                candidates = self.drops(state, price)
                if not candidates:
                    continue
                keys = [_cost_key(a) for a in self.assess(candidates)]
                best = min(range(len(keys)), key=keys.__getitem__)
                if keys[best] < current:
                    state, current = self.run(candidates[best], self.shifts, _cost_key)
                    improved = True
                    break
        return state
