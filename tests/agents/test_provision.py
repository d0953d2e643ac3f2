"""Provisioning planners on catalogues: ``provision_dp`` is exact (against brute force over
the same space) and symmetric in identical nodes; HeterPS's baselines give feasible plans;
the RL scheduler is seeded and near the exact answer on a tiny instance."""

from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest

from pipeplan.agents.baselines.dp import bottleneck
from pipeplan.agents.baselines.dp_table import StageModel
from pipeplan.agents.baselines.genetic import GeneticPlanner as DeviceGenetic
from pipeplan.agents.problem import Budget, InfeasibleError, Objective, Problem
from pipeplan.agents.provision.exact import ProvisionDPConfig, solve
from pipeplan.agents.provision.kinds import Catalogue
from pipeplan.agents.provision.rental import rental
from pipeplan.agents.registry import make_planner
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, ModelProfile
from pipeplan.core.tables import CostTables
from pipeplan.models.shapes import generate

ROOT = Path(__file__).resolve().parents[2]


def chain(n: int) -> ModelProfile:
    layers = [
        LayerProfile(
            f"l{i}", "conv", (i + 1) * 2_000_000, 4e8 * (1 + i % 3), 60_000 * (n - i), [i + 1]
        )
        for i in range(n)
    ]
    layers[-1] = LayerProfile(f"l{n - 1}", "fc", 1_000_000, 1e8, 4_000, [])
    return ModelProfile("chain", [3, 8, 8], layers)


def small_catalogue(order: tuple[int, ...] = (0, 1, 2)) -> ClusterSpec:
    entries = [
        {"name": "cpu", "devices": {"cpu": 1}, "count": 2},
        {"name": "t4", "devices": {"t4": 1}, "count": 3},
        {"name": "v4", "devices": {"v100": 2}, "count": 2},
    ]
    return ClusterSpec.from_dict(
        {
            "name": "small",
            "device_types": {
                "cpu": {"flops": 5e11, "memory_gb": 32, "price_per_hour": 0.2},
                "t4": {"flops": 8e12, "memory_gb": 16, "price_per_hour": 0.5},
                "v100": {"flops": 1.5e13, "memory_gb": 16, "price_per_hour": 3.0},
            },
            "nodes": [entries[k] for k in order],
            "network": {"inter_node": {"bandwidth_gbps": 25, "latency_us": 30}},
        }
    )


def problem(cluster: ClusterSpec, tp: float, layers: int = 4, **kw: object) -> Problem:
    return Problem(
        chain(layers), cluster, Objective.COST, global_batch=8, min_throughput=tp,
        budget=Budget(evaluations=None, seconds=None), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def brute_force(p: Problem) -> float:
    """The least price x overlap bottleneck over every node-exclusive one-kind plan."""
    cat = Catalogue.of(p.cluster, CostTables.of(p.profile, p.cluster))
    L, best = len(p.profile), float("inf")
    for cuts in product([False, True], repeat=L - 1):
        bounds = [0, *(i + 1 for i, c in enumerate(cuts) if c), L]
        S = len(bounds) - 1
        per_stage = [
            (o, m)
            for o, opt in enumerate(cat.options)
            for m in range(1, cat.available[opt.kind] + 1)
        ]
        for stages in product(per_stage, repeat=S):
            used = [0] * len(cat.kinds)
            for o, m in stages:
                used[cat.options[o].kind] += m
            if any(u > a for u, a in zip(used, cat.available, strict=True)):
                continue
            devs = cat.devices(list(stages))
            ids = p.cluster.device_ids
            for b in p.microbatch_sizes():
                plan = Plan(
                    p.global_batch,
                    tuple(
                        Stage((bounds[s], bounds[s + 1]), tuple(ids[d] for d in devs[s]), b)
                        for s in range(S)
                    ),
                    p.schedule,
                )
                t = bottleneck(plan, p.profile, p.cluster, StageModel.OVERLAP)
                if p.global_batch / t < (p.min_throughput or 0):
                    continue
                price = simulate(plan, p.profile, p.cluster).cost_per_hour
                best = min(best, price * t)
    return best


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("tp", [0.0, 40.0, 120.0])
def test_provision_dp_is_exact_against_brute_force(tp: float, schedule: Schedule) -> None:
    p = problem(small_catalogue(), tp, schedule=schedule)
    config = ProvisionDPConfig(beam=0)
    found = solve(
        p,
        Catalogue.of(p.cluster, CostTables.of(p.profile, p.cluster)),
        config,
        CostTables.of(p.profile, p.cluster),
    )
    expected = brute_force(p)
    if expected == float("inf"):
        assert not found
    else:
        assert found[0].value == pytest.approx(expected, rel=1e-9)


def test_the_beam_seeded_search_finds_the_same_optimum() -> None:
    p = problem(small_catalogue(), 120.0)
    tables = CostTables.of(p.profile, p.cluster)
    cat = Catalogue.of(p.cluster, tables)
    plain = solve(p, cat, ProvisionDPConfig(beam=0), tables)[0]
    seeded = solve(p, cat, ProvisionDPConfig(beam=2), tables)[0]
    assert seeded.value == pytest.approx(plain.value, rel=1e-12)


@pytest.mark.parametrize("order", [(1, 2, 0), (2, 0, 1)])
def test_permuting_the_catalogue_gives_the_same_answer(order: tuple[int, ...]) -> None:
    base = make_planner("provision_dp").plan(problem(small_catalogue(), 120.0))
    other_problem = problem(small_catalogue(order), 120.0)
    other = make_planner("provision_dp").plan(other_problem)
    assert other.value == pytest.approx(base.value, rel=1e-12)
    a = rental(base.plan, small_catalogue(), base.estimate)
    b = rental(other.plan, other_problem.cluster, other.estimate)
    assert a.nodes == b.nodes and a.devices == b.devices


SHORT = {
    "heterps_rl": {"iterations": 8, "batch": 16},
    "genetic": {"generations": 20},
    "tapp": {"iterations": 8, "batch_size": 16},
}


@pytest.mark.parametrize(
    "planner", ["provision_dp", "heterps_cpu_gpu", "heterps_rl", "greedy", "genetic", "tapp"]
)
def test_planners_give_feasible_plans_on_a_catalogue(planner: str) -> None:
    p = problem(small_catalogue(), 60.0)
    options = SHORT.get(planner, {})
    result = make_planner(planner, **options).plan(p)
    result.plan.validate(p.profile, p.cluster)
    est = simulate(result.plan, p.profile, p.cluster)
    assert est.fits and est.throughput >= 60.0
    hired = rental(result.plan, p.cluster, est)
    assert sum(hired.nodes.values()) >= 1
    assert set(hired.nodes) <= {"cpu", "t4", "v4"}


def test_heterps_cpu_gpu_puts_the_first_layer_on_the_cpu() -> None:
    p = problem(small_catalogue(), 10.0)
    result = make_planner("heterps_cpu_gpu").plan(p)
    first, *rest = result.plan.stages
    assert first.layers == (0, 1)
    assert {p.cluster.device(d).type for d in first.devices} == {"cpu"}
    assert all(p.cluster.device(d).type != "cpu" for st in rest for d in st.devices)


def test_heterps_rl_is_seeded_and_near_the_exact_answer() -> None:
    p = problem(small_catalogue(), 60.0)
    options = {"iterations": 15, "batch": 16}
    first = make_planner("heterps_rl", **options).plan(p)
    again = make_planner("heterps_rl", **options).plan(p)
    assert first.plan == again.plan and first.value == again.value
    exact = make_planner("provision_dp").plan(p)
    assert first.value <= 1.5 * exact.value


def test_provision_dp_on_the_preset_catalogue_is_fast_and_meets_the_target() -> None:
    cluster = ClusterSpec.load(ROOT / "examples/clusters/cloud-catalogue.yaml")
    p = Problem(chain(12), cluster, Objective.COST, global_batch=64, min_throughput=400.0)
    result = make_planner("provision_dp").plan(p)
    assert result.wall_time_s < 20
    assert result.estimate.throughput >= 400.0


@pytest.mark.parametrize("planner", ["genetic", "tapp"])
def test_genetic_and_tapp_search_by_kind_on_a_catalogue(planner: str) -> None:
    """On a catalogue under the cost objective both search kind-level plans: each stage on
    every device of one type of whole nodes of one kind, the first free nodes of that kind
    (so that plans equal up to renaming identical nodes are one); near the exact answer,
    and seeded."""
    p = problem(small_catalogue(), 60.0)
    first = make_planner(planner, **SHORT[planner]).plan(p)
    again = make_planner(planner, **SHORT[planner]).plan(p)
    assert first.plan == again.plan and first.value == again.value
    taken: dict[str, int] = {}
    for stage in first.plan.stages:
        devs = [p.cluster.device(d) for d in stage.devices]
        nodes = sorted({d.node for d in devs}, key=lambda n: int(n.rsplit("-", 1)[1]))
        kinds = {n.rsplit("-", 1)[0] for n in nodes}
        assert len(kinds) == 1 and len({d.type for d in devs}) == 1
        kind = kinds.pop()
        start = taken.get(kind, 0)
        assert nodes == [f"{kind}-{k}" for k in range(start, start + len(nodes))]
        taken[kind] = start + len(nodes)
        per_node = p.cluster.nodes[[n.name for n in p.cluster.nodes].index(nodes[0])].devices
        assert len(devs) == len(nodes) * per_node[devs[0].type]
    exact = make_planner("provision_dp").plan(p)
    assert first.value <= 1.05 * exact.value


def test_genetic_and_tapp_stay_device_level_off_catalogues() -> None:
    """On a cluster without ``count`` the registry's genetic is the device-level one."""
    cluster = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")
    p = Problem(chain(4), cluster, Objective.COST, global_batch=8, min_throughput=1.0,
                budget=Budget(evaluations=300, seconds=None))  # fmt: skip
    ours = make_planner("genetic").plan(p)
    theirs = DeviceGenetic().plan(p)
    assert ours.plan == theirs.plan and ours.value == theirs.value


def test_provision_dp_refuses_cleanly_where_no_stage_fits_without_a_floor() -> None:
    """Under the time objective there is no throughput floor: a stage over memory, or past
    its kind's nodes, must not count as a plan (it once asked for 5 of dc-64's 4 nodes)."""
    cluster = ClusterSpec.load(ROOT / "examples/clusters/scale/dc-64.yaml")
    p = Problem(generate("gpt-13b"), cluster, Objective.TIME, global_batch=512, microbatches=256)
    with pytest.raises(InfeasibleError, match="no plan fits in memory"):
        make_planner("provision_dp").plan(p)
