"""The exact planners (``brute``, ``dp``) and PipeDream's DP: differential and contract tests.

What holds, and is tested:
- ``brute`` is the optimum of its space: it equals a direct enumeration over labelled device
  assignments with ``simulate`` (so merging identical devices is exact);
- ``dp`` is exact for its own objective (either bottleneck model) over its space, the
  ``overlap`` bottleneck is a lower bound on the simulated batch time, and ``dp``'s plans
  lie in ``brute``'s space, so ``dp`` is never better than ``brute``;
- where one stage is all there can be (one layer, or one device) on identical devices, the
  bottleneck *is* the batch time and the spaces coincide: ``dp`` equals ``brute``.
  (On pipelines of several stages ``dp`` can lose to ``brute``: fill and drain are not in
  the bottleneck, and mixed-type stages are not in its space.)
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import combinations, product
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.agents import Budget, InfeasibleError, Objective, Problem, ProblemError, make_planner
from pipeplan.agents.baselines.brute import BrutePlanner, count_assignments, count_matrices
from pipeplan.agents.baselines.dp import DPPlanner, bottleneck, explain_gap
from pipeplan.agents.baselines.dp_table import Candidate, StageModel
from pipeplan.agents.baselines.pipedream_dp import assumed_type, pipedream_partition
from pipeplan.core.batch_eval import BatchEvaluator
from pipeplan.core.calibration import Calibration
from pipeplan.core.cluster import ClusterSpec, DeviceType, Link, Network, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, ModelProfile
from tests.core.strategies import plans, profiles

ROOT = Path(__file__).resolve().parents[2]
# catalogues (count: N) are the provisioning planners' (tests/agents/test_provision.py): brute's
# and dp's spaces grow with the nodes, and they refuse a catalogue's (tested below)
PRESETS = sorted(
    p for p in (ROOT / "examples" / "clusters").glob("*.yaml") if "catalogue" not in p.stem
)
ALEXNET = ROOT / "tests" / "data" / "pipedream" / "alexnet.graph.txt"
UNBOUNDED = Budget(evaluations=None, seconds=None)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chain(n: int, name: str = "chain") -> ModelProfile:
    """A small synthetic chain with uneven layers (no measured timings: FLOPs-based)."""
    layers = [
        LayerProfile(
            f"l{i}",
            "conv",
            (i + 1) * 4_000_000,
            (i % 3 + 1) * 3e9,
            (n - i) * 200_000,
            (i + 1,) if i < n - 1 else (),
        )
        for i in range(n)
    ]
    return ModelProfile(name, (3, 32, 32), tuple(layers))


@st.composite
def tiny_clusters(draw: st.DrawFn, types: tuple[str, ...] = ("a", "b")) -> ClusterSpec:
    dtypes = {
        t: DeviceType(
            t,
            draw(st.floats(1e10, 1e13)),
            draw(st.floats(0.3, 20)),
            draw(st.floats(10, 1000)),
            draw(st.sampled_from([0.0, 0.5, 1.0, 2.5])),
        )
        for t in types
    }
    total = draw(st.integers(2, 3))
    devices = [draw(st.sampled_from(types)) for _ in range(total)]
    n_nodes = draw(st.integers(1, 2))
    nodes: list[dict[str, int]] = [{} for _ in range(n_nodes)]
    for d in devices:
        k = draw(st.integers(0, n_nodes - 1))
        nodes[k][d] = nodes[k].get(d, 0) + 1
    net = Network(
        Link(draw(st.floats(1, 200)), draw(st.floats(0, 20))),
        Link(draw(st.floats(0.1, 50)), draw(st.floats(0, 200))),
    )
    node_list = tuple(Node(f"n{k}", c) for k, c in enumerate(nodes) if c)
    updated = draw(st.sets(st.sampled_from(types)))  # rule 8u: fitted update bandwidths
    calibration = (
        Calibration(memory_bandwidth_gbps={t: draw(st.floats(1, 1000)) for t in updated})
        if updated
        else None
    )
    return ClusterSpec("tiny", dtypes, node_list, net, calibration=calibration)


def all_plans(problem: Problem, unequal: bool = False, one_type: bool = False) -> Iterator[Plan]:
    """Every plan over labelled devices: partitions x device maps x microbatch choices."""
    L, ids = len(problem.profile), problem.cluster.device_ids
    sizes = problem.microbatch_sizes()
    for S in range(1, min(L, len(ids)) + 1):
        for cuts in combinations(range(1, L), S - 1):
            bounds = [0, *cuts, L]
            for owner in product(range(S + 1), repeat=len(ids)):  # S = unused
                devs = [
                    tuple(d for d, o in zip(ids, owner, strict=True) if o == s) for s in range(S)
                ]
                if not all(devs):
                    continue
                if one_type and any(
                    len({problem.cluster.device(d).type for d in ds}) > 1 for ds in devs
                ):
                    continue
                combos = product(sizes, repeat=S) if unequal else ((b,) * S for b in sizes)
                for mbs in combos:
                    yield Plan(
                        problem.global_batch,
                        tuple(Stage((bounds[s], bounds[s + 1]), devs[s], mbs[s]) for s in range(S)),
                        problem.schedule,
                    )


def best_value(problem: Problem, unequal: bool = False) -> float:
    return min(
        problem.score_estimate(simulate(p, problem.profile, problem.cluster))
        for p in all_plans(problem, unequal)
    )


def value_or_inf(name: str, problem: Problem, **options: object) -> float:
    try:
        return make_planner(name, **options).plan(problem).value
    except InfeasibleError:
        return float("inf")


@st.composite
def tiny_problems(draw: st.DrawFn, unequal: bool = False) -> Problem:
    profile = draw(profiles(min_layers=3, max_layers=4 if unequal else 5))
    cluster = draw(tiny_clusters())
    schedule = Schedule.GPIPE if unequal else draw(st.sampled_from(list(Schedule)))
    batch = draw(st.sampled_from([2, 4] if unequal else [2, 4, 6]))
    objective = draw(st.sampled_from([Objective.TIME, Objective.COST]))
    min_tp = draw(st.sampled_from([None, 0.0, 1.0, 100.0])) if objective is Objective.COST else None
    return Problem(profile, cluster, objective, batch, schedule, None, min_tp, budget=UNBOUNDED)


# --- brute ----------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(1, 3)),
)
def test_count_assignments_is_the_enumeration_size(
    counts: list[int], stages: int, cap: int | None
) -> None:
    assert count_assignments(counts, stages, cap) == len(count_matrices(counts, stages, cap))


@FAST
@given(tiny_problems())
def test_brute_is_the_optimum_of_a_direct_enumeration(problem: Problem) -> None:
    expected = best_value(problem)
    got = value_or_inf("brute", problem)
    assert got == pytest.approx(expected, rel=1e-9) or got == expected == float("inf")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_problems(unequal=True))
def test_brute_unequal_is_the_optimum_over_per_stage_microbatches(problem: Problem) -> None:
    expected = best_value(problem, unequal=True)
    got = value_or_inf("brute", problem, unequal=True)
    assert got == pytest.approx(expected, rel=1e-9) or got == expected == float("inf")
    assert got <= value_or_inf("brute", problem) * (1 + 1e-12)


def test_brute_refuses_a_large_space_and_says_how_large() -> None:
    profile = load_pipedream(ALEXNET, 256, "v100")
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "cloud-mix.yaml")
    problem = Problem(profile, cluster, global_batch=64, budget=UNBOUNDED)
    planner = BrutePlanner()
    size = planner.space_size(problem).total
    assert size > 2_000_000
    with pytest.raises(ProblemError, match=f"{size:,} candidate plans.*max_space"):
        planner.plan(problem)
    small = Problem(chain(4), cluster, global_batch=8, budget=Budget(evaluations=1000))
    n = BrutePlanner().space_size(small).total
    with pytest.raises(ProblemError, match=f"{n:,} candidate plans.*evaluation budget 1,000"):
        make_planner("brute").plan(small)


def test_brute_and_dp_refuse_a_catalogue_at_once() -> None:
    """Counting a catalogue's whole space (or building dp's table) would never end: brute
    stops counting past the limit, dp counts its table before building it (and, unless told
    to keep to devices, searches by kind instead: tests/agents/test_dp_kinds.py)."""
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "cloud-catalogue.yaml")
    problem = Problem(chain(12), cluster, global_batch=64)
    with pytest.raises(ProblemError, match=r"at least [\d,]+ candidate plans.*not counted"):
        make_planner("brute").plan(problem)
    with pytest.raises(ProblemError, match=r"device-count vectors.*more than max_states"):
        make_planner("dp", space="devices").plan(problem)


def test_brute_unequal_under_1f1b() -> None:
    """Unequal microbatches are allowed under 1F1B: the space holds the equal one's plans,
    so its optimum is no worse, and the plan it returns costs what it reports."""
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    problem = Problem(chain(3), cluster, global_batch=4, schedule=Schedule.ONE_F_ONE_B)
    unequal = make_planner("brute", unequal=True).plan(problem)
    equal = make_planner("brute").plan(problem)
    assert unequal.value <= equal.value
    assert unequal.plan.schedule is Schedule.ONE_F_ONE_B
    est = simulate(unequal.plan, problem.profile, cluster)
    assert problem.score_estimate(est) == pytest.approx(unequal.value, rel=1e-9)


def test_brute_options_are_validated() -> None:
    with pytest.raises(ProblemError, match="max_space"):
        make_planner("brute", max_space=0)
    with pytest.raises(ProblemError, match="known options"):
        make_planner("brute", nonsense=1)


# --- dp -------------------------------------------------------------------------------------


@FAST
@given(tiny_problems())
def test_dp_is_never_better_than_brute(problem: Problem) -> None:
    brute = value_or_inf("brute", problem)
    dp = value_or_inf("dp", problem)
    assert dp >= brute * (1 - 1e-9)


@FAST
@given(tiny_problems(), st.sampled_from(list(StageModel)))
def test_dp_is_exact_for_the_bottleneck_over_its_space(problem: Problem, model: StageModel) -> None:
    ev = BatchEvaluator(problem.profile, problem.cluster)
    cands = DPPlanner(models=(model,)).solve(problem, ev)
    ids = problem.cluster.device_ids
    for c in cands[:20]:  # each candidate's bound is its plan's bottleneck
        stages = tuple(
            Stage((c.bounds[s], c.bounds[s + 1]), tuple(ids[d] for d in devs), c.microbatch)
            for s, devs in enumerate(c.devices)
        )
        plan = Plan(problem.global_batch, stages, problem.schedule)
        expected = bottleneck(plan, problem.profile, problem.cluster, model)
        assert c.bound == pytest.approx(expected, rel=1e-9)
    for b in problem.microbatch_sizes():
        expected = min(
            (
                bottleneck(p, problem.profile, problem.cluster, model)
                for p in all_plans(problem, one_type=True)
                if p.stages[0].microbatch == b
            ),
            default=float("inf"),
        )
        got = min((c.bound for c in cands if c.microbatch == b), default=float("inf"))
        assert got == pytest.approx(expected, rel=1e-9) or got == expected == float("inf")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_bottleneck_is_a_lower_bound_on_the_batch_time(data: st.DataObject) -> None:
    profile = data.draw(profiles(min_layers=2, max_layers=6))
    cluster = data.draw(tiny_clusters(("a", "b", "c")))
    schedule = data.draw(st.sampled_from(list(Schedule)))
    S = data.draw(st.integers(1, min(len(profile), len(cluster.device_ids))))
    plan = data.draw(plans(profile, cluster, S, schedule, data.draw(st.sampled_from([4, 6, 8]))))
    bound = bottleneck(plan, profile, cluster)
    est = simulate(plan, profile, cluster)
    assert bound <= est.batch_time_s * (1 + 1e-12) or not est.fits


@FAST
@given(st.data())
def test_dp_equals_brute_where_one_stage_is_all_there_is(data: st.DataObject) -> None:
    cluster = data.draw(tiny_clusters(("a",)))
    one_layer = data.draw(st.booleans())
    if one_layer:
        profile = data.draw(profiles(min_layers=1, max_layers=1))
    else:  # one device: keep the first
        first = cluster.device(cluster.device_ids[0])
        cluster = ClusterSpec(
            "one", cluster.device_types, (Node(first.node, {first.type: 1}),), cluster.network
        )
        profile = data.draw(profiles(min_layers=2, max_layers=5))
    schedule = data.draw(st.sampled_from(list(Schedule)))
    objective = data.draw(st.sampled_from([Objective.TIME, Objective.COST]))
    problem = Problem(profile, cluster, objective, 8, schedule, budget=UNBOUNDED)
    brute = value_or_inf("brute", problem)
    assert value_or_inf("dp", problem) == pytest.approx(brute, rel=1e-9) or brute == float("inf")


@FAST
@given(tiny_problems())
def test_dp_differs_from_brute_only_for_a_stated_reason(problem: Problem) -> None:
    try:
        brute = make_planner("brute").plan(problem)
    except InfeasibleError:
        return
    dp = value_or_inf("dp", problem)
    if dp == pytest.approx(brute.value, rel=1e-9):
        return
    cands = DPPlanner().solve(problem, BatchEvaluator(problem.profile, problem.cluster))
    consistent, why = explain_gap(problem, brute.plan, cands)
    assert consistent, why
    assert why.startswith(("outside dp's space", "in dp's space with a bottleneck"))


def test_explain_gap_flags_a_dp_that_missed_a_better_bottleneck() -> None:
    cluster = ClusterSpec("one", {"a": DeviceType("a", 1e12, 16)}, (Node("n0", {"a": 2}),))
    problem = Problem(chain(3), cluster, global_batch=4, budget=UNBOUNDED)
    plan = make_planner("brute").plan(problem).plan
    truth = bottleneck(plan, problem.profile, cluster)
    worse = [Candidate(m, 2 * truth + 1.0, 0.0, (0, 3), ((0,),), 4) for m in StageModel]
    consistent, why = explain_gap(problem, plan, worse)
    assert not consistent and "DP NOT EXACT" in why
    fair = [Candidate(m, truth, 0.0, (0, 3), ((0,),), 4) for m in StageModel]
    assert explain_gap(problem, plan, fair)[0]


def test_dp_refuses_a_table_over_max_states() -> None:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "cloud-mix.yaml")
    problem = Problem(chain(6), cluster, global_batch=8)
    with pytest.raises(ProblemError, match=r"entries .* more than max_states 100"):
        make_planner("dp", max_states=100, space="devices").plan(problem)


# --- pipedream_dp ----------------------------------------------------------------------------


def test_pipedream_partition_balances_identical_workers() -> None:
    # four equal layers, no weights, free links: two workers -> two stages of two layers
    # (a 2-replica stage of all four layers ties, and PipeDream's DP keeps the first found)
    stages = pipedream_partition([1.0, 1.0, 1.0, 1.0], [0.0] * 4, [0.0] * 5, 2, 1e9)
    assert sum(r for _, _, r in stages) == 2
    assert stages in ([(0, 4, 2)], [(0, 2, 1), (2, 4, 1)])
    # expensive sync (huge weights, slow link): no replication, a 1:3 split balances 3,1,1,1
    stages = pipedream_partition([3.0, 1.0, 1.0, 1.0], [1e12] * 4, [0.0] * 5, 2, 1.0)
    assert stages == [(0, 1, 1), (1, 4, 1)]


def test_pipedream_assumes_the_most_common_type() -> None:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    assert assumed_type(Problem(chain(3), cluster), None) == "slow"
    with pytest.raises(ProblemError, match="unknown device type 'h100'"):
        make_planner("pipedream_dp", assume="h100").plan(Problem(chain(3), cluster))


# --- every planner, on the presets -----------------------------------------------------------

PLANNERS = ("brute", "dp", "pipedream_dp")


def preset_problem(
    path: Path,
    planner: str,
    schedule: Schedule = Schedule.GPIPE,
    objective: Objective = Objective.TIME,
    min_throughput: float | None = None,
) -> Problem:
    # brute gets a 3-layer chain (its space stays small); the DPs get AlexNet's 22 layers
    profile = chain(3) if planner == "brute" else load_pipedream(ALEXNET, 256, "v100")
    cluster = ClusterSpec.load(path)
    budget = Budget(evaluations=200_000, seconds=None)
    return Problem(
        profile, cluster, objective, 8, schedule, None, min_throughput, seed=3, budget=budget
    )


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
@pytest.mark.parametrize("planner", PLANNERS)
def test_every_planner_returns_a_valid_fitting_plan_on_the_presets(
    path: Path, planner: str
) -> None:
    for schedule in Schedule:
        problem = preset_problem(path, planner, schedule=schedule)
        result = make_planner(planner).plan(problem)
        result.plan.validate(problem.profile, problem.cluster)
        assert result.estimate.fits
        assert result.value == pytest.approx(result.estimate.batch_time_s, rel=1e-9)
        again = make_planner(planner).plan(problem)  # deterministic for a seed
        assert again.plan == result.plan


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
@pytest.mark.parametrize("planner", PLANNERS)
def test_cost_objective_meets_min_throughput(path: Path, planner: str) -> None:
    fastest = make_planner("dp").plan(preset_problem(path, planner)).estimate.throughput
    target = 0.5 * fastest
    problem = preset_problem(path, planner, objective=Objective.COST, min_throughput=target)
    try:
        result = make_planner(planner).plan(problem)
    except InfeasibleError as e:  # PipeDream's blind plans may all miss the target
        assert planner == "pipedream_dp" and "min_throughput" in str(e)
        return
    assert result.estimate.fits
    assert result.estimate.throughput >= target
    unreachable = preset_problem(
        path, planner, objective=Objective.COST, min_throughput=100 * fastest
    )
    with pytest.raises(InfeasibleError, match="min_throughput"):
        make_planner(planner).plan(unreachable)


@pytest.mark.parametrize("planner", PLANNERS)
def test_memory_too_small_is_infeasible_and_says_memory(planner: str) -> None:
    cluster = ClusterSpec(
        "tiny-memory",
        {"g": DeviceType("g", 1e12, 0.001), "c": DeviceType("c", 1e11, 0.002)},
        (Node("n0", {"g": 2}), Node("n1", {"c": 1})),
    )
    problem = Problem(chain(3), cluster, global_batch=4, budget=UNBOUNDED)
    with pytest.raises(InfeasibleError, match="memory"):
        make_planner(planner).plan(problem)
