"""``brute``: every plan of a bounded space, costed through the vectorised cost model.

The space, for every stage count ``S = 1 .. min(layers, devices, max_stages)``:

- every contiguous partition of the ``L`` layers into ``S`` stages: ``C(L-1, S-1)``;
- every assignment of devices to stages: each device goes to one stage or stays unused
  (replicas; and for the ``cost`` objective the HeterPS provisioning plan), every stage gets
  ``1 .. max_replicas`` devices;
- every microbatch choice: one size from ``Problem.microbatch_sizes()`` for all stages, or
  with ``unequal=True`` (UMPIPE's unequal data partition, under either schedule) every per-stage
  combination: ``k`` resp. ``k ** S`` choices for ``k`` sizes.

Symmetry, and why it is exact: the cost model (DESIGN.md rules 1-10) sees a device only
through its type (timings, memory, memory bandwidth, price) and its node (link classes).
Devices of one type on one node -- a *class* -- are therefore interchangeable: permuting
them maps any plan to one with the same Estimate. An assignment is enumerated once per
matrix ``n[stage][class]`` of device counts and realised canonically (stages, in order, take
the lowest-index free devices of each class; the highest stay unused). The optimum over
these canonical plans is the optimum over all labelled assignments; the tests check this
against a direct enumeration with :func:`core.costmodel.simulate`.

Size: ``sum over S of C(L-1, S-1) * A(S) * k(S)``, where ``A(S)`` -- the number of count
matrices -- is counted exactly by a dynamic program over classes (:func:`count_assignments`)
before anything is evaluated. Instances beyond ``max_space`` or the problem's evaluation
budget are refused with the size and what to reduce. Exact or nothing: if the time budget
runs out half-way, :class:`~agents.problem.ProblemError` says so instead of returning a plan
that is not the optimum.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations, product

import numpy as np

from pipeplan.agents.problem import Problem, ProblemError
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.cluster import ClusterSpec

IntArray = np.ndarray

# Elements of the evaluator's largest (plans x stages x microbatches) arrays per call.
_WORK_PER_CALL = 2_000_000
_MAX_CHUNK = 65_536


@dataclass(frozen=True)
class BruteConfig:
    """Options of ``brute``."""

    max_space: int = 2_000_000
    """Refuse instances with more candidate plans than this (counted before evaluating)."""
    max_replicas: int | None = None
    """At most this many devices per stage; None: no cap."""
    unequal: bool = False
    """Also try every per-stage combination of microbatch sizes (UMPIPE; GPipe only)."""
    max_stages: int | None = None
    """At most this many stages; None: min(layers, devices)."""

    def __post_init__(self) -> None:
        if self.max_space < 1:
            raise ProblemError(f"brute.max_space: must be >= 1, got {self.max_space}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ProblemError(f"brute.max_replicas: must be >= 1, got {self.max_replicas}")
        if self.max_stages is not None and self.max_stages < 1:
            raise ProblemError(f"brute.max_stages: must be >= 1, got {self.max_stages}")


# --- device classes --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceClass:
    """Interchangeable devices: one type on one node, as indices into ``cluster.device_ids``."""

    node: str
    type: str
    devices: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.devices)


def device_classes(cluster: ClusterSpec) -> list[DeviceClass]:
    """The cluster's classes in order of their first device (node by node, type by type)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, d in enumerate(cluster.device_ids):
        dev = cluster.device(d)
        groups.setdefault((dev.node, dev.type), []).append(i)
    return [DeviceClass(n, t, tuple(idx)) for (n, t), idx in groups.items()]


# --- counting ---------------------------------------------------------------------------------


def count_assignments(counts: Sequence[int], stages: int, max_replicas: int | None) -> int:
    """Count matrices ``n[stage][class]``: class ``k`` gives at most ``counts[k]`` devices in
    all, every stage gets ``1 .. max_replicas`` devices.

    A dynamic program over classes whose state is the histogram of stage sizes (how many
    stages hold 0, 1, .., R devices so far) -- stages are interchangeable for the count, so
    the histogram suffices; transitions count the labelled ways to spread a class.
    """
    R = sum(counts) if max_replicas is None else min(max_replicas, sum(counts))
    if stages < 1 or R < 1:
        return 0
    states: dict[tuple[int, ...], int] = {(stages,) + (0,) * R: 1}
    for c in counts:
        nxt: dict[tuple[int, ...], int] = defaultdict(int)
        for hist, ways in states.items():
            for new, more in _spread(hist, c, R).items():
                nxt[new] += ways * more
        states = nxt
    return sum(w for hist, w in states.items() if hist[0] == 0)


def _spread(hist: tuple[int, ...], c: int, R: int) -> dict[tuple[int, ...], int]:
    """New histograms (and labelled ways) after spreading <= ``c`` identical devices."""
    out: dict[tuple[int, ...], int] = defaultdict(int)

    def rec(t: int, left: int, new: list[int], ways: int) -> None:
        if t > R:
            out[tuple(new)] += ways
            return
        for split, mult, used in _splits(hist[t], R - t, left):
            nxt = new.copy()
            for d, n in enumerate(split):
                nxt[t + d] += n
            rec(t + 1, left - used, nxt, ways * mult)

    rec(0, c, [0] * (R + 1), 1)
    return out


def _splits(n: int, top: int, left: int) -> Iterator[tuple[list[int], int, int]]:
    """Ways ``n`` labelled stages each take ``d = 0 .. top`` more devices, ``<= left`` in all:
    yields (how many stages take each d, multinomial count, devices used)."""

    def rec(d: int, rest: int, left: int, acc: list[int]) -> Iterator[list[int]]:
        if d == 0:
            yield [rest, *acc]
            return
        for k in range(min(rest, left // d) + 1):
            yield from rec(d - 1, rest - k, left - d * k, [k, *acc])

    for split in rec(top, n, left, []):
        mult = math.factorial(n)
        for k in split:
            mult //= math.factorial(k)
        yield split, mult, sum(d * k for d, k in enumerate(split))


@dataclass(frozen=True)
class SpaceSize:
    """Candidate plans per stage count, and the structure behind each number."""

    per_stages: dict[int, tuple[int, int, int]]  # S -> (partitions, assignments, microbatches)
    partial: bool = False
    """Counting stopped at the first stage count past a limit: the space is at least this."""

    @property
    def total(self) -> int:
        return sum(p * a * m for p, a, m in self.per_stages.values())

    def describe(self) -> str:
        counted = "; ".join(
            f"S={S}: {p:,} partitions x {a:,} device assignments x {m:,} microbatch choices"
            for S, (p, a, m) in self.per_stages.items()
        )
        return counted + ("; larger stage counts not counted" if self.partial else "")


# --- enumeration ------------------------------------------------------------------------------


def count_matrices(counts: Sequence[int], stages: int, max_replicas: int | None) -> IntArray:
    """Every count matrix ``n[stage][class]`` (see :func:`count_assignments`), (A, S, K)."""
    K = len(counts)
    R = sum(counts) if max_replicas is None else max_replicas
    choices = np.array(list(product(*(range(c + 1) for c in counts))), dtype=np.int64)
    choices = choices[(choices.sum(1) >= 1) & (choices.sum(1) <= R)]
    mats = np.zeros((1, 0, K), dtype=np.int64)
    left = np.array([counts], dtype=np.int64)
    for _ in range(stages):
        ok = (choices[None, :, :] <= left[:, None, :]).all(-1)  # (partial, choice)
        p, c = np.nonzero(ok)
        mats = np.concatenate([mats[p], choices[c][:, None, :]], axis=1)
        left = left[p] - choices[c]
    return mats


def realise(mats: IntArray, classes: Sequence[DeviceClass]) -> IntArray:
    """Device indices (A, S, R) of count matrices: stages take each class's devices in order."""
    A, S, _ = mats.shape
    R = max(int(mats.sum(-1).max()), 1) if A else 1
    out = np.full((A, S, R), -1, dtype=np.int64)
    slot_base = np.cumsum(mats, axis=-1) - mats  # (A, S, K): first slot of class k in stage s
    rows = np.arange(A)
    for k, cls in enumerate(classes):
        ends = np.cumsum(mats[:, :, k], axis=1)  # (A, S)
        starts = ends - mats[:, :, k]
        for p, dev in enumerate(cls.devices):
            stage = (ends <= p).sum(1)  # the stage holding the class's p-th device, S if unused
            used = stage < S
            s = np.minimum(stage, S - 1)
            slot = slot_base[rows, s, k] + p - starts[rows, s]
            out[rows[used], s[used], slot[used]] = dev
    return out


def partitions(n_layers: int, stages: int) -> IntArray:
    """Every contiguous partition as stage bounds, (C(L-1, S-1), S+1)."""
    cuts = list(combinations(range(1, n_layers), stages - 1))
    return np.array([[0, *c, n_layers] for c in cuts], dtype=np.int64).reshape(-1, stages + 1)


def microbatch_choices(sizes: Sequence[int], stages: int, unequal: bool) -> IntArray:
    """Per-stage microbatch sizes, (k or k**S, S)."""
    if not unequal:
        return np.repeat(np.asarray(sizes, dtype=np.int64)[:, None], stages, axis=1)
    return np.array(list(product(sizes, repeat=stages)), dtype=np.int64).reshape(-1, stages)


# --- the planner ------------------------------------------------------------------------------


class BrutePlanner(Planner):
    """Exhaustive search; see the module docstring for the space and its size."""

    name = "brute"
    Config = BruteConfig
    config: BruteConfig

    def _stage_counts(self, problem: Problem) -> range:
        n_devices = len(problem.cluster.device_ids)
        top = min(len(problem.profile), n_devices)
        if self.config.max_stages is not None:
            top = min(top, self.config.max_stages)
        return range(1, top + 1)

    def space_size(self, problem: Problem, stop_above: int | None = None) -> SpaceSize:
        """The exact number of candidate plans, by stage count, before any evaluation; with
        ``stop_above``, a space whose one-stage plans alone pass it is only counted that far
        (``partial``): counting every stage count of a big catalogue would itself never end."""
        counts = [c.count for c in device_classes(problem.cluster)]
        k, L = len(problem.microbatch_sizes()), len(problem.profile)
        per: dict[int, tuple[int, int, int]] = {}
        stage_counts = self._stage_counts(problem)
        if stop_above is not None and self.config.max_replicas is None:
            one_stage = math.prod(c + 1 for c in counts) - 1  # every non-empty choice of counts
            if one_stage * k > stop_above:  # past the limit on one stage: nothing more to count
                return SpaceSize({1: (1, one_stage, k)}, partial=len(stage_counts) > 1)
        for S in stage_counts:
            a = count_assignments(counts, S, self.config.max_replicas)
            per[S] = (math.comb(L - 1, S - 1), a, k**S if self.config.unequal else k)
        return SpaceSize(per)

    def search(self, problem: Problem, search: Search) -> None:
        budget = problem.budget.evaluations
        limit = self.config.max_space if budget is None else min(self.config.max_space, budget)
        size = self.space_size(problem, stop_above=limit)
        self._refuse_if_too_big(problem, size)
        classes = device_classes(problem.cluster)
        counts = [c.count for c in classes]
        for S in self._stage_counts(problem):
            assigns = realise(count_matrices(counts, S, self.config.max_replicas), classes)
            if not len(assigns):
                continue
            bounds = partitions(len(problem.profile), S)
            mbs = microbatch_choices(problem.microbatch_sizes(), S, self.config.unequal)
            for group in _by_microbatch_count(mbs, problem.global_batch):
                self._evaluate_product(search, group, bounds, assigns, problem.global_batch)
                if search.exhausted() and search.evaluations < size.total:
                    self._refuse_unfinished(problem, search, size)

    def _evaluate_product(
        self,
        search: Search,
        mbs: IntArray,
        bounds: IntArray,
        assigns: IntArray,
        global_batch: int,
    ) -> None:
        """Evaluate microbatch choices x partitions x assignments in chunks (flat index)."""
        S = bounds.shape[1] - 1
        n_b, n_a = len(bounds), len(assigns)
        total = len(mbs) * n_b * n_a
        mmax = int(global_batch // mbs.min())
        chunk = max(1, min(_MAX_CHUNK, _WORK_PER_CALL // (S * mmax)))
        for lo in range(0, total, chunk):
            flat = np.arange(lo, min(lo + chunk, total))
            a = flat % n_a
            b = (flat // n_a) % n_b
            m = flat // (n_a * n_b)
            search.evaluate(PlanBatch(bounds[b], mbs[m], assigns[a]))
            if search.exhausted() and lo + chunk < total:
                return

    def _refuse_if_too_big(self, problem: Problem, size: SpaceSize) -> None:
        n = size.total
        cap = self.config.max_space
        budget = problem.budget.evaluations
        if n <= cap and (budget is None or n <= budget):
            return
        limit = f"max_space {cap:,}" if n > cap else f"the problem's evaluation budget {budget:,}"
        raise ProblemError(
            f"brute: the space of {problem.profile.name!r} ({len(problem.profile)} layers) on "
            f"cluster {problem.cluster.name!r} ({len(problem.cluster.device_ids)} devices) has "
            f"{'at least ' if size.partial else ''}{n:,} candidate plans, more than {limit} "
            f"({size.describe()}). Reduce it: "
            "max_stages, max_replicas, a fixed microbatch count, unequal=False, fewer layers "
            "or devices; or raise max_space / the budget"
        )

    def _refuse_unfinished(self, problem: Problem, search: Search, size: SpaceSize) -> None:
        raise ProblemError(
            f"brute: the time budget ({problem.budget.seconds} s) ran out after "
            f"{search.evaluations:,} of {size.total:,} candidate plans; the best so far is "
            "not proven optimal, so no plan is returned (raise the budget or shrink the space)"
        )


def _by_microbatch_count(mbs: IntArray, global_batch: int) -> list[IntArray]:
    """Microbatch choices grouped by their largest microbatch count (the evaluator's loop)."""
    mmax = global_batch // mbs.min(axis=1)
    return [mbs[mmax == v] for v in np.unique(mmax)]
