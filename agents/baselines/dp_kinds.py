"""``dp`` by kind: the bottleneck DP over node kinds and counts, for clusters too large for
the device-level table of :mod:`agents.baselines.dp_table`.

Identical nodes are interchangeable, so this search names stages by **option** (a device type
on the nodes of one kind, :mod:`agents.provision.kinds`) and **node count**, never by device,
and makes a plan concrete only at the end, each stage on the next free nodes of its kind.

**Space** (reported in the result's options as ``searched``): contiguous stages, each on every
device of one type on ``m`` whole nodes of one kind, no node holding two stages; the stages on
one kind are consecutive (**kind blocks**, the kinds in any order, a kind possibly unused);
equal microbatches of each size of ``Problem.microbatch_sizes()``. Every cut crosses nodes.
A stage recomputes its activations (rules 2r and 9r) exactly where memory needs it: when it
does not fit without and does with (:class:`~agents.provision.kinds.StageCosts`).

**Exact for** the ``overlap`` bottleneck (:mod:`agents.baselines.dp`) over that space, for
each microbatch size, under GPipe: recomputation only adds time, so recomputing where memory
needs it and nowhere else is each stage's best choice. Under 1F1B a stage's memory is checked
as if it held the in-flight microbatches of a first stage of ``L`` (conservative: a plan it
accepts fits); a candidate's stages then recompute where they need it at their own place.

**How.** For a target ``T`` a stage ``[i, j)`` on an option takes the least ``m`` whose busy
time is at most ``T``; within one kind the least nodes covering ``[i, j)`` is a min-plus
closure over the cuts whose transfer time is at most ``T`` (:func:`kind_cover`); kind blocks
in each order of the kinds then say which layers are reachable within every kind's count
(:func:`reachable`, over the subsets of the kinds). Feasibility is monotone in ``T``, so a
bisection over the distinct busy and transfer times finds the least feasible one: ``O(log(L^2
m O) (K L^3 + 2^K K L^2))`` per microbatch size, independent of the number of count vectors.
Refused (naming the bound) when ``2^K K (L+1)^2`` exceeds ``max_states``: clusters of many
distinct node kinds.

**Candidates.** The bottleneck leaves out fill and drain, so several plans per microbatch
size are kept: the optimum's, the plans of the next few larger targets (fewer nodes, often
fewer stages), and each of those with the kind's spare nodes spread over its stages. All are
costed by kind (:func:`core.kind_tables.evaluate_kinds`, no device named); ``dp`` makes
the best ``simulated`` of them concrete, with their recomputing stages, and records them
through ``search.evaluate`` (:func:`evaluate_kind_found`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipeplan.agents.problem import Problem, ProblemError
from pipeplan.agents.provision.exact import Found, by_stage_count, found_batch
from pipeplan.agents.provision.kinds import Catalogue, StageCosts
from pipeplan.agents.search import Search
from pipeplan.core import rules
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.kind_tables import KindBatch, evaluate_kinds
from pipeplan.core.plan import Schedule
from pipeplan.core.tables import CostTables

FloatArray = np.ndarray
INF = np.inf

LADDER = 6
"""Targets above the optimum whose plans are kept as candidates, spaced over the distinct
busy times up to :data:`LADDER_SPAN` times the optimum."""
LADDER_SPAN = 2.0


@dataclass(frozen=True)
class Searched:
    """What the kind-level search covered, for the result's options."""

    options: int
    kinds: int
    microbatch_sizes: tuple[int, ...]

    def describe(self) -> str:
        return (
            f"kinds: node-exclusive stages of one type on whole nodes of one kind, stages of a "
            f"kind consecutive ({self.kinds} kinds, {self.options} options), equal "
            f"microbatches of {list(self.microbatch_sizes)}, recomputing where memory needs "
            "it; exact for the overlap bottleneck"
        )


@dataclass(frozen=True)
class KindFound(Found):
    """A candidate of the kind-level search: a :class:`Found` with the stages that recompute
    their activations (empty: none)."""

    recompute: tuple[bool, ...] = ()


def recompute_of(f: Found) -> tuple[bool, ...]:
    """Per stage, whether it recomputes (``False`` for every stage of a plain ``Found``)."""
    flags: tuple[bool, ...] = getattr(f, "recompute", ())
    return tuple(flags) if flags else (False,) * len(f.stages)


class KindDP:
    """The kind-level search of one problem for one microbatch size (module docstring)."""

    def __init__(self, problem: Problem, catalogue: Catalogue, costs: StageCosts) -> None:
        self.problem, self.catalogue, self.costs = problem, catalogue, costs
        self.L = L = costs.L
        self.K = len(catalogue.kinds)
        q = np.array([L if problem.schedule is Schedule.ONE_F_ONE_B else 1])
        m_max = max(catalogue.available)
        # W[o][i, j, m-1]: busy time of [i, j) on m nodes of option o (inf: no such stage)
        self.W = np.full((len(catalogue.options), L + 1, L + 1, m_max), INF)
        for o, opt in enumerate(catalogue.options):
            n = catalogue.available[opt.kind]
            for i in range(L):
                self.W[o, i, i + 1 :, :n] = costs.busy(i, o, q)[..., 0]
        self.kind_of = np.array([opt.kind for opt in catalogue.options])
        self.link = costs.link  # (L+1,) transfer time of the cut before layer j

    # --- feasibility of a target ---------------------------------------------------------

    def least_nodes(self, T: float) -> tuple[FloatArray, np.ndarray]:
        """(O, L+1, L+1) least nodes of each option for a one-stage ``[i, j)`` within ``T``
        (inf where none), and the option's count of them."""
        ok = self.W <= T
        first = ok.argmax(-1)
        nodes = np.where(ok.any(-1), first + 1.0, INF)
        return nodes, first + 1

    def covers(self, T: float) -> tuple[FloatArray, np.ndarray]:
        """Per kind: (K, L+1, L+1) least nodes covering ``[i, j)`` in stages within ``T``,
        and the start of the last of those stages (:func:`kind_cover`)."""
        nodes, _ = self.least_nodes(T)
        cut_ok = self.link <= T
        H = np.full((self.K, self.L + 1, self.L + 1), INF)
        via = np.zeros((self.K, self.L + 1, self.L + 1), dtype=np.int64)
        for k in range(self.K):
            H[k], via[k] = kind_cover(nodes[self.kind_of == k].min(0), cut_ok)
        return H, via

    def feasible(self, T: float) -> bool:
        H, _ = self.covers(T)
        available = np.array(self.catalogue.available)
        return reachable(H, available, self.link <= T)[0]

    def farthest(self) -> int:
        """The most leading layers any plan of the space holds in memory (``L``: all)."""
        values = self.targets()
        if not len(values):
            return 0
        T = float(values[-1])  # every stage that fits in memory, every cut
        H, _ = self.covers(T)
        _, reach = reach_table(H, np.array(self.catalogue.available), self.link <= T)
        return int(np.flatnonzero(reach[-1]).max())

    # --- the optimum and its neighbours ----------------------------------------------------

    def targets(self) -> FloatArray:
        """Distinct finite busy and transfer times, ascending: the bottleneck is one of them."""
        values = np.concatenate([self.W[np.isfinite(self.W)], self.link[1 : self.L]])
        return np.unique(values)

    def least_target(self, values: FloatArray) -> int | None:
        """Index into ``values`` of the least feasible target (None: none is)."""
        if not len(values) or not self.feasible(float(values[-1])):
            return None
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.feasible(float(values[mid])):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def plan(self, T: float) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]] | None:
        """Stage bounds and ``(option, nodes)`` of a least-nodes plan within ``T``."""
        H, via = self.covers(T)
        available = np.array(self.catalogue.available)
        ok, blocks = reachable(H, available, self.link <= T)
        if not ok:
            return None
        nodes, least = self.least_nodes(T)
        bounds, stages = [self.L], []
        for k, i, j in reversed(blocks):
            mine = np.flatnonzero(self.kind_of == k)
            end = j
            while end > i:
                start = int(via[k, i, end])
                o = int(mine[nodes[mine, start, end].argmin()])  # the fewest nodes of the kind
                stages.append((o, int(least[o, start, end])))
                bounds.append(start)
                end = start
        return tuple(reversed(bounds)), tuple(reversed(stages))

    def spread(self, stages: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        """The kinds' spare nodes handed out over their stages, evenly (fewer busy seconds
        per stage: less fill and drain at the same bottleneck)."""
        used = np.zeros(self.K, dtype=np.int64)
        for o, m in stages:
            used[self.kind_of[o]] += m
        out = [list(s) for s in stages]
        for k in range(self.K):
            mine = [s for s, (o, _) in enumerate(stages) if self.kind_of[o] == k]
            spare = self.catalogue.available[k] - int(used[k])
            for n in range(spare if mine else 0):
                out[mine[n % len(mine)]][1] += 1
        return tuple((o, m) for o, m in out)

    def recomputing(
        self, bounds: tuple[int, ...], stages: tuple[tuple[int, int], ...]
    ) -> tuple[bool, ...]:
        """Per stage of a plan, whether it recomputes: it does not fit without at its own
        place (stages from it to the end, for 1F1B's memory)."""
        S = len(stages)
        return tuple(
            self.costs.recomputes(bounds[s], bounds[s + 1], o, m, S - s)
            for s, (o, m) in enumerate(stages)
        )

    def candidates(self) -> list[Found]:
        """The optimum's plan and its neighbours (module docstring), each with the target it
        was built for as its bound (its bottleneck is at most that), not yet costed."""
        values = self.targets()
        best = self.least_target(values)
        if best is None:
            return []
        top = np.searchsorted(values, values[best] * LADDER_SPAN, side="right")
        picks = np.unique(np.linspace(best, max(best, top - 1), LADDER + 1).astype(int))
        out: list[Found] = []
        seen: set[tuple[object, ...]] = set()
        for p in picks:
            made = self.plan(float(values[p]))
            if made is None:
                continue
            bounds, stages = made
            for st in (stages, self.spread(stages)):
                if (bounds, st) not in seen:
                    seen.add((bounds, st))
                    flags = self.recomputing(bounds, st)
                    out.append(
                        KindFound(0.0, float(values[p]), 0.0, bounds, st, self.costs.b, flags)
                    )
        return out


def kind_cover(C: FloatArray, cut_ok: np.ndarray) -> tuple[FloatArray, np.ndarray]:
    """Min-plus closure of one kind's stage costs ``C[i, j]`` (nodes of a one-stage ``[i,
    j)``) over the allowed cuts: ``H[i, j]`` the least nodes covering ``[i, j)``, with
    ``via[i, j]`` the start of its last stage (``i`` when one stage)."""
    n = C.shape[0]
    H = C.copy()
    via = np.repeat(np.arange(n)[:, None], n, axis=1)
    for j in range(2, n):
        inner = np.arange(1, j)
        inner = inner[cut_ok[inner]]
        if not len(inner):
            continue
        split = H[:, inner] + C[inner, j][None, :]  # (n, |inner|): cut at inner[c]
        split[np.arange(n)[:, None] >= inner[None, :]] = INF
        c = split.argmin(1)
        better = split[np.arange(n), c] < H[:, j]
        H[:, j] = np.where(better, split[np.arange(n), c], H[:, j])
        via[:, j] = np.where(better, inner[c], via[:, j])
    return H, via


def reach_table(
    H: FloatArray, available: np.ndarray, cut_ok: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``fits[k, i, j]``: kind ``k``'s count covers ``[i, j)`` ending at an allowed cut; and
    ``reach[s, j]``: blocks of the kinds in subset ``s`` cover layers ``[0, j)``."""
    K, n, _ = H.shape
    end_ok = cut_ok.copy()
    end_ok[n - 1] = True
    fits = (available[:, None, None] >= H) & end_ok[None, None, :]  # (K, n, n)
    reach = np.zeros((1 << K, n), dtype=bool)
    reach[0, 0] = True
    for mask in range(1, 1 << K):
        for k in range(K):
            if mask >> k & 1:
                prev = reach[mask ^ (1 << k)]
                reach[mask] |= prev | (fits[k] & prev[:, None]).any(0)
    return fits, reach


def reachable(
    H: FloatArray, available: np.ndarray, cut_ok: np.ndarray
) -> tuple[bool, list[tuple[int, int, int]]]:
    """Whether kind blocks in some order cover every layer within each kind's count, and the
    blocks ``(kind, start, end)`` of one such plan. Over subsets of the kinds: ``reach[s]``
    holds the layers that blocks of the kinds in ``s`` (each at most once, in any order) end
    at, so the ``K!`` orders cost ``2^K K`` steps."""
    K, n, _ = H.shape
    L = n - 1
    fits, reach = reach_table(H, available, cut_ok)
    mask = (1 << K) - 1
    if not reach[mask, L]:
        return False, []
    blocks, j = [], L
    while j > 0:
        for k in range(K):
            if not mask >> k & 1:
                continue
            prev = reach[mask ^ (1 << k)]
            if prev[j]:  # kind k unused after layer j
                mask ^= 1 << k
                break
            starts = np.flatnonzero(prev & fits[k][:, j])
            if len(starts):
                blocks.append((k, int(starts[0]), j))
                mask, j = mask ^ (1 << k), int(starts[0])
                break
    return True, list(reversed(blocks))


def kind_batch(catalogue: Catalogue, found: list[Found]) -> KindBatch:
    """Plans of one stage count as a kind-level population (:mod:`core.kind_tables`)."""
    opts = catalogue.options
    o = np.array([[s[0] for s in f.stages] for f in found], dtype=np.int64)
    m = np.array([[s[1] for s in f.stages] for f in found], dtype=np.int64)
    per_node = np.array([opt.per_node for opt in opts])
    return KindBatch(
        bounds=np.array([f.bounds for f in found], dtype=np.int64),
        microbatch=np.array([[f.microbatch] * len(f.stages) for f in found], dtype=np.int64),
        type_index=np.array([opt.type_index for opt in opts])[o],
        replicas=per_node[o] * m,
        nodes=m,
        recompute=np.array([recompute_of(f) for f in found], dtype=bool),
    )


def concrete_batch(catalogue: Catalogue, found: list[Found]) -> PlanBatch:
    """Plans of one stage count made concrete, each stage on the next free nodes of its kind
    (:func:`agents.provision.exact.found_batch`), recomputing where the candidate does."""
    flags = np.array([recompute_of(f) for f in found], dtype=bool)
    return replace(found_batch(catalogue, found), recompute=flags)


def evaluate_kind_found(search: Search, catalogue: Catalogue, found: list[Found]) -> None:
    """Simulate candidates made concrete (:func:`concrete_batch`) through ``search``, one
    population per stage count, budget allowing."""
    by_stages = by_stage_count(search, found)
    for S in sorted(by_stages):
        if search.exhausted():
            return
        search.evaluate(concrete_batch(catalogue, by_stages[S]))


def rank(
    problem: Problem, tables: CostTables, catalogue: Catalogue, found: list[Found]
) -> list[tuple[float, Found]]:
    """Every plan's objective value by kind (no device named), best first; unfitting ones out."""
    by_stages: dict[int, list[Found]] = {}
    for f in found:
        by_stages.setdefault(len(f.stages), []).append(f)
    out = []
    for group in by_stages.values():
        res = evaluate_kinds(
            tables, kind_batch(catalogue, group), problem.global_batch, problem.schedule
        )
        values = problem.score(res.batch_time_s, res.fits, res.cost_per_hour)
        out += [(float(v), f) for v, f in zip(values, group, strict=True) if np.isfinite(v)]
    return sorted(out, key=lambda vf: vf[0])


def memory_binds(problem: Problem, tables: CostTables, catalogue: Catalogue) -> str:
    """Why no plan of the space fits, even recomputing: at the microbatch size that gets
    farthest, the first layer the cluster's nodes cannot also hold, and the types tried; and
    when the parameters alone bind (:func:`parameters_bind`), so."""
    reach = {
        b: KindDP(
            problem, catalogue, StageCosts(problem, tables, catalogue, b, recompute=True)
        ).farthest()
        for b in problem.microbatch_sizes()
    }
    b = max(reach, key=lambda k: (reach[k], -k))
    layer = problem.profile.layers[min(reach[b], len(problem.profile) - 1)]
    types = sorted({opt.type for opt in catalogue.options})
    return (
        f"; memory binds: at best (microbatch {b}) the nodes of {types} hold layers "
        f"[0, {reach[b]}) of {len(problem.profile)}, and no stage from there on fits layer "
        f"{layer.name!r} as well, even recomputing its activations"
    ) + parameters_bind(problem, catalogue)


def parameters_bind(problem: Problem, catalogue: Catalogue) -> str:
    """A note when the model's parameters alone exceed what the space can hold (empty
    otherwise): every device of a stage holds :data:`core.rules.OPTIMIZER_COPIES` x the
    stage's parameters whatever its replicas, and a node holds at most one stage, so the
    nodes hold at most, each, a quarter of its largest device's memory, whatever recomputes."""
    cluster = problem.cluster
    per_kind = [
        max(cluster.device_types[o.type].memory_bytes for o in catalogue.options if o.kind == k)
        for k in range(len(catalogue.kinds))
    ]
    room = sum(n * c for n, c in zip(catalogue.available, per_kind, strict=True))
    room /= rules.OPTIMIZER_COPIES
    params = sum(x.params_bytes for x in problem.profile.layers)
    if params <= room:
        return ""
    return (
        f"; parameters bind: each device of a stage holds {rules.OPTIMIZER_COPIES} x its "
        f"parameters (weights, gradients, two Adam states), and with one stage per node the "
        f"{sum(catalogue.available)} nodes hold at most {room / rules.GB:.1f} GB of the "
        f"model's {params / rules.GB:.1f} GB; it takes stages that share a node, outside "
        "this space"
    )


def kind_table_size(problem: Problem, catalogue: Catalogue) -> int:
    """Steps of one feasibility test by kind subsets (:func:`reachable`): ``2^K K (L+1)^2``."""
    K, L = len(catalogue.kinds), len(problem.profile)
    return (1 << K) * K * (L + 1) ** 2


def search_kinds(
    problem: Problem, tables: CostTables, catalogue: Catalogue, max_states: int
) -> list[tuple[float, Found]]:
    """Every microbatch size's candidates, ranked by their kind-level cost; refused when
    :func:`kind_table_size` exceeds ``max_states``."""
    size = kind_table_size(problem, catalogue)
    if size > max_states:
        raise ProblemError(
            f"dp by kind: {problem.cluster.name!r} has {len(catalogue.kinds)} node kinds; "
            f"their subsets make {size:,} steps per test (2^kinds x kinds x (layers + 1)^2), "
            f"more than max_states {max_states:,}: write identical nodes as one entry with "
            "count, or raise max_states"
        )
    found: list[Found] = []
    for b in sorted(problem.microbatch_sizes(), reverse=True):
        costs = StageCosts(problem, tables, catalogue, b, recompute=True)
        found += KindDP(problem, catalogue, costs).candidates()
    return rank(problem, tables, catalogue, found)
