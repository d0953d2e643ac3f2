"""``dp`` by node kind (agents.baselines.dp_kinds): exact for the bottleneck in its space,
costed by kind as the cost model costs the concrete plan, chosen only beyond max_states."""

from __future__ import annotations

import dataclasses
from itertools import product

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.agents import InfeasibleError, Problem, ProblemError, make_planner
from pipeplan.agents.baselines.dp_kinds import (
    KindDP,
    KindFound,
    concrete_batch,
    kind_batch,
    rank,
    search_kinds,
)
from pipeplan.agents.baselines.dp_table import table_size
from pipeplan.agents.provision.exact import Found, found_batch
from pipeplan.agents.provision.kinds import Catalogue, StageCosts
from pipeplan.core.batch_eval import BatchEvaluator
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.kind_tables import evaluate_kinds
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.core.tables import CostTables
from tests.agents.test_exact import chain
from tests.core.strategies import kind_clusters, profiles


@st.composite
def kind_problems(draw: st.DrawFn) -> Problem:
    """A small profile on a cluster of one to three node kinds (``count: N``); in some, the
    activations rescaled so that a batch of them is a multiple of the smallest device's
    memory: memory binds, and recomputation matters."""
    profile = draw(profiles(min_layers=2, max_layers=5))
    cluster = draw(kind_clusters(max_devices=3))
    batch = draw(st.sampled_from((4, 6, 8)))
    pressure = draw(st.sampled_from((0.0, 2.0, 8.0, 32.0)))  # 0: as drawn
    total = sum(x.activation_bytes for x in profile.layers)
    if pressure and total:
        cap = min(t.memory_bytes for t in cluster.device_types.values())
        scale = pressure * cap / (batch * total)
        layers = tuple(
            dataclasses.replace(x, activation_bytes=int(x.activation_bytes * scale))
            for x in profile.layers
        )
        profile = dataclasses.replace(profile, layers=layers)
    microbatches = draw(st.sampled_from([m for m in (1, 2, 4, 8) if batch % m == 0]))
    return Problem(profile, cluster, global_batch=batch, microbatches=microbatches)


def stage_busy(dp: KindDP, i: int, j: int, o: int, m: int) -> float:
    """The busy time of stage ``[i, j)`` on ``m`` nodes of option ``o``, spelled out from the
    rules: as it is where it fits, else recomputing where that fits (rules 2r and 9r), else
    inf; memory at a first stage of ``L`` under 1F1B, as the search checks it."""
    problem, tb, opt, b = dp.problem, dp.costs.tables, dp.catalogue.options[o], dp.costs.b
    M = problem.global_batch // b
    t, r = opt.type_index, m * opt.per_node
    n = -(-b // r)
    f = tb.fwd_fixed_range[t, i, j] + n * tb.fwd_per_sample_range[t, i, j]
    bk = tb.bwd_fixed_range[t, i, j] + n * tb.bwd_per_sample_range[t, i, j]
    params = float(tb.params(i, j))
    update = 4 * params / (problem.cluster.memory_bandwidth_gbps(opt.type) * 1e9)
    ring = tb.ring_bps[0 if m == 1 else 1], tb.ring_lat[0 if m == 1 else 1]
    allreduce = 2 * (r - 1) / r * params / ring[0] + 2 * (r - 1) * ring[1]
    accumulation = (M - 1) / M * update
    held = M if problem.schedule is Schedule.GPIPE else min(dp.L, M)
    acts = float(tb.acts(i, j))
    cap = problem.cluster.device_types[opt.type].memory_bytes
    if 4 * params + held * n * acts <= cap:
        return float(M * (f + bk + accumulation) + update + allreduce)
    if 4 * params + held * n * float(tb.cuts[i]) + n * acts <= cap:
        return float(M * (f + f + bk + accumulation) + update + allreduce)
    return np.inf


def brute_bottleneck(dp: KindDP) -> float:
    """The least bottleneck over every kind-block plan of whole nodes, by enumeration, each
    stage recomputing where memory needs it (:func:`stage_busy`, not the search's table)."""
    L, cat = dp.L, dp.catalogue
    best = np.inf
    for cuts in product((False, True), repeat=L - 1):
        bounds = [0, *(j for j in range(1, L) if cuts[j - 1]), L]
        S = len(bounds) - 1
        links = max((float(dp.link[j]) for j in bounds[1:-1]), default=0.0)
        for opts in product(range(len(cat.options)), repeat=S):
            kinds = [cat.options[o].kind for o in opts]
            blocks = [k for n, k in enumerate(kinds) if n == 0 or kinds[n - 1] != k]
            if len(blocks) != len(set(blocks)):
                continue  # a kind's stages not consecutive: outside the space
            ranges = [range(1, cat.available[k] + 1) for k in kinds]
            for ms in product(*ranges):
                used = np.bincount(kinds, weights=ms, minlength=len(cat.kinds))
                if (used > np.array(cat.available)).any():
                    continue
                w = max(
                    stage_busy(dp, bounds[s], bounds[s + 1], o, m)
                    for s, (o, m) in enumerate(zip(opts, ms, strict=True))
                )
                best = min(best, max(float(w), links))
    return best


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind_problems())
def test_kind_dp_finds_the_least_bottleneck_of_its_space(problem: Problem) -> None:
    """The bisection's least feasible target equals enumeration's least bottleneck (stages
    recomputing where memory needs it), and the plan it builds has that bottleneck and
    respects every kind's count."""
    tables = CostTables.of(problem.profile, problem.cluster)
    cat = Catalogue.of(problem.cluster, tables)
    b = problem.microbatch_sizes()[0]
    dp = KindDP(problem, cat, StageCosts(problem, tables, cat, b, recompute=True))
    values = dp.targets()
    at = dp.least_target(values)
    want = brute_bottleneck(dp)
    if at is None:
        assert np.isinf(want)
        return
    T = float(values[at])
    assert want == pytest.approx(T, rel=1e-12)
    made = dp.plan(T)
    assert made is not None
    bounds, stages = made
    got = max(
        max(float(dp.W[o, bounds[s], bounds[s + 1], m - 1]) for s, (o, m) in enumerate(stages)),
        max((float(dp.link[j]) for j in bounds[1:-1]), default=0.0),
    )
    assert got == pytest.approx(T, rel=1e-12)
    used = np.zeros(len(cat.kinds))
    for o, m in stages:
        used[cat.options[o].kind] += m
    assert (used <= np.array(cat.available)).all()
    flags = dp.recomputing(bounds, stages)
    made_kinds = kind_batch(cat, [KindFound(0.0, T, 0.0, bounds, stages, b, flags)])
    assert evaluate_kinds(tables, made_kinds, problem.global_batch, problem.schedule).fits[0]


def scale_cluster(count: int) -> ClusterSpec:
    return ClusterSpec.from_dict(
        {
            "name": f"kinds-{count}",
            "device_types": {
                "big": {"flops": 4e12, "memory_gb": 16, "memory_bandwidth_gbps": 900},
                "small": {"flops": 1e12, "memory_gb": 8, "memory_bandwidth_gbps": 300},
            },
            "nodes": [
                {"name": "bigx4", "devices": {"big": 4}, "count": count},
                {"name": "smallx2", "devices": {"small": 2}, "count": count},
            ],
            "network": {
                "intra_node": {"bandwidth_gbps": 300, "latency_us": 5},
                "inter_node": {"bandwidth_gbps": 25, "latency_us": 20},
            },
        }
    )


def test_dp_searches_by_kind_beyond_max_states_and_says_so() -> None:
    """Past max_states dp answers by kind, names its space, and its plan's simulated value is
    the kind-level cost of the best candidate (made concrete on the first free nodes)."""
    problem = Problem(chain(12), scale_cluster(6), global_batch=64)
    assert table_size(problem) > 4_000_000
    result = make_planner("dp").plan(problem)
    assert result.options["searched"].startswith("kinds: node-exclusive stages")
    tables = CostTables.of(problem.profile, problem.cluster)
    cat = Catalogue.of(problem.cluster, tables)
    ranked = search_kinds(problem, tables, cat, 4_000_000)
    assert result.value == pytest.approx(ranked[0][0], rel=1e-9)
    assert result.estimate.batch_time_s == pytest.approx(ranked[0][0], rel=1e-9)


def test_kind_costs_rank_as_the_cost_model_on_the_concrete_plans() -> None:
    problem = Problem(chain(8), scale_cluster(3), global_batch=32)
    tables = CostTables.of(problem.profile, problem.cluster)
    cat = Catalogue.of(problem.cluster, tables)
    found = [
        Found(0.0, 0.0, 0.0, (0, 3, 8), ((0, 2), (1, 3)), 4),
        Found(0.0, 0.0, 0.0, (0, 5, 8), ((1, 1), (0, 3)), 8),
        Found(0.0, 0.0, 0.0, (0, 4, 8), ((0, 1), (0, 1)), 2),
    ]
    ranked = rank(problem, tables, cat, found)
    ev = BatchEvaluator(problem.profile, problem.cluster)
    for value, f in ranked:
        res = ev.evaluate(found_batch(cat, [f]), problem.global_batch, problem.schedule)
        assert value == pytest.approx(float(res.batch_time_s[0]), rel=1e-9)
    assert [v for v, _ in ranked] == sorted(v for v, _ in ranked)


def test_small_clusters_keep_the_device_table() -> None:
    """Within max_states dp fills the device-level table as before (no ``searched`` note)."""
    problem = Problem(chain(4), scale_cluster(1), global_batch=8)
    assert table_size(problem) <= 4_000_000
    assert "searched" not in make_planner("dp").plan(problem).options
    by_kind = make_planner("dp", space="kinds").plan(problem)
    assert by_kind.options["searched"].startswith("kinds:")


def test_kind_search_refuses_too_many_kinds_naming_the_bound() -> None:
    """Plain nodes are kinds of their own: the subsets of 12 of them are over the bound."""
    nodes = [{"name": f"n{k}", "devices": {"big": 1}} for k in range(12)]
    doc = {**scale_cluster(1).to_dict(), "name": "plain", "nodes": nodes}
    problem = Problem(chain(4), ClusterSpec.from_dict(doc), global_batch=8)
    with pytest.raises(ProblemError, match=r"12 node kinds; .* 1,228,800 steps .* max_states"):
        make_planner("dp", space="kinds", max_states=1_000_000).plan(problem)


def test_kind_search_under_1f1b_answers_plans_that_fit() -> None:
    """Under 1F1B memory is checked as for a first stage of as many stages as layers: the
    answer fits in the cost model's memory and is its value."""
    problem = Problem(chain(8), scale_cluster(3), global_batch=32, schedule=Schedule.ONE_F_ONE_B)
    result = make_planner("dp", space="kinds").plan(problem)
    assert result.estimate.fits
    assert result.value == pytest.approx(result.estimate.batch_time_s, rel=1e-9)


def test_space_devices_refuses_beyond_max_states() -> None:
    problem = Problem(chain(12), scale_cluster(6), global_batch=64)
    with pytest.raises(ProblemError, match=r"more than max_states .* search by kind"):
        make_planner("dp", space="devices").plan(problem)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"space": "nodes"},
            r"dp.space: expected one of \['auto', 'devices', 'kinds'\], got 'nodes'",
        ),
        ({"simulated": 0}, r"dp.simulated: must be >= 1, got 0"),
    ],
)
def test_bad_kind_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ProblemError, match=message):
        make_planner("dp", **options)


@pytest.mark.parametrize(("huge", "held"), [((0, 1, 2), 0), ((2,), 2)])
def test_kind_search_says_where_memory_binds(huge: tuple[int, ...], held: int) -> None:
    """Layers larger than every device: the refusal names the microbatch size, how many
    leading layers the nodes hold and the first layer they cannot."""
    base = chain(3)
    layers = tuple(
        dataclasses.replace(x, params_bytes=10**11) if i in huge else x
        for i, x in enumerate(base.layers)
    )
    problem = Problem(dataclasses.replace(base, layers=layers), scale_cluster(2), global_batch=8)
    with pytest.raises(
        InfeasibleError,
        match=r"by kind: no plan .* fits in memory .*; memory binds: at best \(microbatch 1\) "
        rf"the nodes of \['big', 'small'\] hold layers \[0, {held}\) of 3, .* layer 'l{held}'",
    ):
        make_planner("dp", space="kinds").plan(problem)


def activation_bound() -> Problem:
    """Four layers whose activations, held for every microbatch (GPipe, microbatch 1), fit
    on no device, but the first three recomputing (inputs only, one microbatch's
    activations again) fit on a 8 GB device; the last layer's activations are small."""
    big = 1_500_000_000
    layers = tuple(
        dataclasses.replace(x, activation_bytes=big if i < 3 else 1_000_000)
        for i, x in enumerate(chain(4).layers)
    )
    profile = dataclasses.replace(chain(4), layers=layers)
    doc = scale_cluster(2).to_dict()
    doc["device_types"]["big"]["memory_gb"] = 8
    doc["device_types"]["small"]["memory_gb"] = 4
    return Problem(profile, ClusterSpec.from_dict(doc), global_batch=8, microbatches=8)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_dp_recomputes_where_memory_needs_it(schedule: Schedule) -> None:
    """Without recomputation no stage fits; with it ``dp`` answers a plan that fits, and in
    every candidate exactly the stages that do not fit without it recompute. Under 1F1B the
    search checks memory as for a first stage of ``L`` stages, a candidate at its own place:
    its one stage holds one microbatch and needs no recomputation."""
    problem = dataclasses.replace(activation_bound(), schedule=schedule)
    tables = CostTables.of(problem.profile, problem.cluster)
    cat = Catalogue.of(problem.cluster, tables)
    (b,) = problem.microbatch_sizes()
    plain = KindDP(problem, cat, StageCosts(problem, tables, cat, b))
    assert plain.least_target(plain.targets()) is None
    result = make_planner("dp", space="kinds").plan(problem)
    assert result.estimate.fits
    assert bool(result.plan.recomputing) == (schedule is Schedule.GPIPE)
    assert result.value == pytest.approx(result.estimate.batch_time_s, rel=1e-9)
    ranked = search_kinds(problem, tables, cat, 4_000_000)
    assert ranked
    for value, f in ranked:
        plan = concrete_batch(cat, [f]).plan(0, problem.cluster, 8, schedule)
        est = simulate(plan, problem.profile, problem.cluster)
        assert est.fits and value == pytest.approx(est.batch_time_s, rel=1e-9)
        for s in plan.recomputing:  # each needs it: off, that stage does not fit
            stages = list(plan.stages)
            stages[s] = dataclasses.replace(stages[s], recompute=False)
            off = simulate(dataclasses.replace(plan, stages=tuple(stages)), *problem_of(problem))
            assert not off.stages[s].fits


def problem_of(problem: Problem) -> tuple[ModelProfile, ClusterSpec]:
    return problem.profile, problem.cluster


def test_stage_costs_recompute_only_when_asked() -> None:
    """Off (the provisioning planners' default) a stage over memory is inf; on, it costs the
    recomputing busy time, which is more than the plain one, and says it recomputes."""
    problem = activation_bound()
    tables = CostTables.of(problem.profile, problem.cluster)
    cat = Catalogue.of(problem.cluster, tables)
    o = next(k for k, opt in enumerate(cat.options) if opt.type == "big")
    q = np.array([1])
    off = StageCosts(problem, tables, cat, 1).busy(0, o, q)
    costs = StageCosts(problem, tables, cat, 1, recompute=True)
    on = costs.busy(0, o, q)
    assert np.isinf(off[2, 0, 0]) and np.isfinite(on[2, 0, 0])  # [0, 3) on one node
    assert costs.recomputes(0, 3, o, 1, 1)
    assert not StageCosts(problem, tables, cat, 1).recomputes(0, 3, o, 1, 1)
    assert not costs.recomputes(3, 4, o, 1, 1)  # small activations: fits as it is
    assert np.isinf(costs.busy(1, o, q)[1]).all()  # [1, 3): its inputs alone are too many
    last = StageCosts(problem, tables, cat, 1).busy(3, o, q)[0, 0, 0]
    assert np.isfinite(last) and costs.busy(3, o, q)[0, 0, 0] == last  # [3, 4): as it is
    doc = problem.cluster.to_dict()
    doc["device_types"]["big"]["memory_gb"] = 1000
    roomy = dataclasses.replace(problem, cluster=ClusterSpec.from_dict(doc))
    tables = CostTables.of(roomy.profile, roomy.cluster)
    plain = StageCosts(roomy, tables, Catalogue.of(roomy.cluster, tables), 1).busy(0, o, q)
    assert on[2, 0, 0] > plain[2, 0, 0]  # the extra forward


def test_kind_search_says_when_parameters_bind() -> None:
    """Parameters beyond a quarter of the nodes' largest devices: no recomputation helps,
    and the refusal says so with both figures (2 nodes of 16 GB and 2 of 8 GB: 12 GB)."""
    base = chain(3)
    layers = tuple(dataclasses.replace(x, params_bytes=5 * 10**9) for x in base.layers)
    problem = Problem(dataclasses.replace(base, layers=layers), scale_cluster(2), global_batch=8)
    with pytest.raises(
        InfeasibleError,
        match=r"even recomputing its activations; parameters bind: each device of a stage "
        r"holds 4 x its parameters .* the 4 nodes hold at most 12\.0 GB of the model's 15\.0 GB",
    ):
        make_planner("dp", space="kinds").plan(problem)
