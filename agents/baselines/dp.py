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
their candidates (either model wins some instances: ``bench/results/plan_quality/``).

Link classes follow the cost model: a stage whose replicas span nodes all-reduces over the
inter-node class, and two consecutive stages talk intra-node only when both sit on one and the
same node -- so the state remembers the node of the next stage. The table, its state and its
size are :mod:`agents.baselines.dp_table`'s.

Limits: exact for the bottleneck, not for the batch time (the simulation adds fill, drain and
dependencies; it only chooses among the DP's candidates); no mixed-type stages (one fast and
one slow replica -- ``brute`` finds those); equal microbatches only; the table grows as the
product of the class sizes, so clusters of many distinct (node, type) classes are out of
reach (e.g. 9 classes of 2 devices: P = 19683).

Beyond ``max_states`` (clusters of many nodes, e.g. catalogues of identical nodes) ``dp``
searches by node kind and count instead (:mod:`agents.baselines.dp_kinds`: node-exclusive
stages of whole nodes, each kind's stages consecutive; exact for the ``overlap`` bottleneck
there), costs its candidates by kind and names the space it searched in the result's
options (``searched``); ``space: devices`` refuses such instances instead, ``space: kinds``
searches by kind on any cluster.

So ``dp`` equals ``brute`` except where ``brute``'s optimum has a mixed-type stage, or where
the bottleneck optimum is not the simulated optimum (then ``brute``'s plan has a bottleneck
no better than the DP's in every model). :func:`explain_gap` says which applies to a given
plan, or that the DP missed a better bottleneck (a bug); the tests and
``bench/plan_quality.py`` hold every gap to it.
"""

from __future__ import annotations

import numpy as np

from pipeplan.agents.baselines.brute import DeviceClass, device_classes
from pipeplan.agents.baselines.dp_kinds import (
    Searched,
    evaluate_kind_found,
    memory_binds,
    search_kinds,
)
from pipeplan.agents.baselines.dp_table import (
    BottleneckDP,
    Candidate,
    DPConfig,
    Space,
    StageModel,
    table_size,
)
from pipeplan.agents.problem import InfeasibleError, Objective, Problem
from pipeplan.agents.provision.kinds import Catalogue
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core import rules
from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.cluster import ClusterSpec, Link
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile


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
        busy = st.compute_s + st.update_s + st.allreduce_s
        out = back = 0.0
        if s + 1 < plan.num_stages:
            nxt = est.stages[s + 1]
            link = cluster.link(st.devices, nxt.devices)
            out = _sends(plan, s, link, st.boundary_bytes)
            back = _sends(plan, s + 1, link, st.boundary_bytes)
        if model is StageModel.SERIAL:
            worst = max(worst, busy + out)
        else:
            worst = max(worst, busy, out, back)
    return worst


def _sends(plan: Plan, s: int, link: Link, per_sample: float) -> float:
    """Stage ``s``'s sends across one link: a microbatch's samples each (the last one holds
    the remainder)."""
    m, b = plan.microbatches(s), plan.stages[s].microbatch
    rest = plan.samples(s, m - 1)
    if rest == b:
        return m * link.transfer_s(per_sample * b)
    return (m - 1) * link.transfer_s(per_sample * b) + link.transfer_s(per_sample * rest)


def memory_hint(problem: Problem, classes: list[DeviceClass]) -> str:
    """Why nothing fits: a layer whose memory alone beats every device type, if there is one."""
    profile, cluster = problem.profile, problem.cluster
    b = min(problem.microbatch_sizes())
    held = rules.in_flight(problem.schedule, problem.global_batch // b, 1)
    most = {t: sum(c.count for c in classes if c.type == t) for t in cluster.device_types}
    worst, where = 0.0, ""
    for layer in profile.layers:
        ratio = min(
            rules.memory_bytes(
                layer.params_bytes, layer.activation_bytes, rules.replica_share(b, r), held
            )
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
        space = self.config.space
        if space is Space.KINDS or (
            space is Space.AUTO and table_size(problem) > self.config.max_states
        ):
            self.search_kinds(problem, search)
            return
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

    def search_kinds(self, problem: Problem, search: Search) -> None:
        """The kind-level search (:mod:`agents.baselines.dp_kinds`); its best plans by
        kind-level cost are made concrete and evaluated."""
        tables = search.evaluator.tables
        catalogue = Catalogue.of(problem.cluster, tables)
        sizes = tuple(problem.microbatch_sizes())
        searched = Searched(len(catalogue.options), len(catalogue.kinds), sizes)
        search.options["searched"] = searched.describe()
        ranked = search_kinds(problem, tables, catalogue, self.config.max_states)
        if not ranked:
            raise InfeasibleError(
                f"dp on {problem.profile.name!r} / cluster {problem.cluster.name!r}, by kind: "
                "no plan of node-exclusive one-type stages on whole nodes fits in memory for "
                f"any microbatch size {list(sizes)}" + memory_binds(problem, tables, catalogue)
            )
        evaluate_kind_found(search, catalogue, [f for _, f in ranked[: self.config.simulated]])


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
