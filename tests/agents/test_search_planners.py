"""``genetic`` (DGAP) and ``bayes`` (Optuna GP): valid plans, seeds, budgets, objectives."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from pipeplan.agents import Budget, InfeasibleError, Objective, Problem, ProblemError, make_planner
from pipeplan.agents.baselines.genetic.context import Context, GeneticConfig
from pipeplan.agents.baselines.genetic.genome import canonical, decode, device_classes
from pipeplan.agents.baselines.genetic.operators import repair_cuts, repair_devices
from pipeplan.agents.baselines.genetic.seeds import random_genomes
from pipeplan.agents.search import Search
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "examples" / "clusters").glob("*.yaml"))
SMALL_GA = {"population": 16, "generations": 8, "seed_candidates": 16, "max_stages": 4}
SMALL_BAYES = {"n_trials": 6, "n_startup_trials": 3, "seeds": 2, "max_stages": 4}
SMALL = {"genetic": SMALL_GA, "bayes": SMALL_BAYES}
"""Small searches; bayes's: 2 seeds and 3 random trials, then one trial of the GP (each GP
trial costs ~0.3 s on 2 cores)."""


@cache
def alexnet() -> ModelProfile:
    return load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")


@cache
def preset(path: Path) -> ClusterSpec:
    return ClusterSpec.load(path)


def chain(n: int = 4) -> ModelProfile:
    """A small chain with measured timings on ``fast`` and flop-derived ones on ``slow``."""
    layers = []
    for i in range(n):
        t = LayerTiming(1e-3 * (1 + i % 3), 2e-3 * (1 + i % 3), 2e-4, 3e-4)
        layers.append(
            LayerProfile(
                f"l{i}",
                "conv",
                4_000_000 * (i + 1),
                4e9 * (1 + (i * 7) % 3),
                500_000,
                (i + 1,) if i < n - 1 else (),
                {"fast": t},
            )
        )
    return ModelProfile("chain", (3, 8, 8), tuple(layers))


def tiny_cluster() -> ClusterSpec:
    types = {
        "fast": DeviceType("fast", 4e12, 16, 500, 2.0),
        "slow": DeviceType("slow", 1e12, 16, 100, 0.5),
    }
    return ClusterSpec("tiny", types, (Node("n0", {"fast": 1, "slow": 1}), Node("n1", {"slow": 1})))


def check_result(problem: Problem, planner: str, **options: object) -> Plan:
    result = make_planner(planner, **options).plan(problem)
    plan = result.plan
    plan.validate(problem.profile, problem.cluster)
    est = simulate(plan, problem.profile, problem.cluster)
    assert est.fits
    assert result.value == pytest.approx(problem.score_estimate(est), rel=1e-9)
    assert result.evaluations >= 1
    return plan


# --- every preset -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
@pytest.mark.parametrize("planner", ["genetic", "bayes"])
def test_valid_memory_feasible_plan_on_every_preset(planner: str, path: Path) -> None:
    problem = Problem(alexnet(), preset(path), global_batch=64, seed=1)
    check_result(problem, planner, **SMALL[planner])


@pytest.mark.parametrize("planner", ["genetic", "bayes"])
def test_same_seed_same_plan(planner: str) -> None:
    cluster = preset(ROOT / "examples/clusters/cloud-mix.yaml")
    problem = Problem(alexnet(), cluster, global_batch=64, seed=7)
    options = {**SMALL[planner], "n_trials": 7} if planner == "bayes" else SMALL[planner]
    first = make_planner(planner, **options).plan(problem)  # bayes: a second GP trial
    again = make_planner(planner, **options).plan(problem)
    assert first.plan == again.plan
    assert first.evaluations == again.evaluations


@pytest.mark.parametrize("evaluations", [1, 37, 150])
def test_genetic_respects_the_evaluation_budget(evaluations: int) -> None:
    cluster = preset(ROOT / "examples/clusters/tapp-paper.yaml")
    budget = Budget(evaluations=evaluations, seconds=None)
    problem = Problem(alexnet(), cluster, global_batch=64, budget=budget)
    result = make_planner("genetic", **{**SMALL_GA, "generations": 50}).plan(problem)
    assert result.evaluations <= evaluations  # never more (at most one population over)


def test_bayes_respects_the_evaluation_budget() -> None:
    cluster = preset(ROOT / "examples/clusters/tapp-paper.yaml")
    problem = Problem(alexnet(), cluster, global_batch=64, budget=Budget(evaluations=4))
    assert make_planner("bayes", n_trials=50, seeds=2).plan(problem).evaluations == 4


def test_bayes_returns_its_first_trial_when_seeding_spends_the_time_budget() -> None:
    budget = Budget(evaluations=None, seconds=1e-6)
    problem = Problem(chain(4), tiny_cluster(), global_batch=8, budget=budget)
    plan = check_result(problem, "bayes", **SMALL_BAYES)
    assert len(plan.stages) >= 1


# --- objectives and microbatches -----------------------------------------------------------------


@pytest.mark.parametrize("planner", ["genetic", "bayes"])
def test_cost_objective_meets_min_throughput(planner: str) -> None:
    cluster = preset(ROOT / "examples/clusters/cloud-mix.yaml")
    uniform = make_planner("uniform").plan(Problem(alexnet(), cluster, global_batch=64))
    target = 0.5 * uniform.estimate.throughput  # binding: one cheap device is slower
    problem = Problem(alexnet(), cluster, Objective.COST, global_batch=64, min_throughput=target)
    plan = check_result(problem, planner, **SMALL[planner])
    est = simulate(plan, problem.profile, cluster)
    assert est.throughput >= target
    assert len(plan.devices) <= len(cluster.device_ids)


def test_cost_objective_unreachable_target_says_why() -> None:
    cluster = preset(ROOT / "examples/clusters/local-hetero.yaml")
    problem = Problem(alexnet(), cluster, Objective.COST, global_batch=64, min_throughput=1e9)
    with pytest.raises(InfeasibleError, match="min_throughput"):
        make_planner("genetic", **SMALL_GA).plan(problem)


@pytest.mark.parametrize("planner", ["genetic", "bayes"])
def test_nothing_fits_in_memory_is_named(planner: str) -> None:
    types = {"fast": DeviceType("fast", 4e12, 0.001), "slow": DeviceType("slow", 1e12, 0.002)}
    cluster = ClusterSpec("tiny-memory", types, (Node("n0", {"fast": 1, "slow": 2}),))
    problem = Problem(chain(4), cluster, global_batch=8)
    # nothing fits, so genetic repairs every genome of every generation: one small generation
    # shows the refusal as well as eight do
    options = {**SMALL_GA, "population": 8, "generations": 1} if planner == "genetic" else {}
    with pytest.raises(InfeasibleError, match="memory"):
        make_planner(planner, **{**SMALL[planner], **options}).plan(problem)


def test_unequal_microbatches_decode_to_valid_plans() -> None:
    problem = Problem(alexnet(), preset(PRESETS[0]), global_batch=64, seed=3)
    ctx = Context(
        problem, Search(problem, "genetic", {}), GeneticConfig(), np.random.default_rng(0)
    )
    assert not ctx.equal
    g = random_genomes(ctx, 50, 3)
    batch = decode(g, ctx.sizes, len(problem.profile))
    plans = [batch.plan(i, problem.cluster, 64) for i in range(batch.size)]
    assert any(len({s.microbatch for s in p.stages}) > 1 for p in plans)
    for p in plans:
        p.validate(problem.profile, problem.cluster)
    check_result(problem, "genetic", unequal=True, **SMALL_GA)


@pytest.mark.slow
def test_unequal_microbatches_under_1f1b() -> None:
    """genetic chooses per-stage microbatches under 1F1B too (rule 5's sample-counted
    warm-ups); its plan costs what it reports."""
    problem = Problem(
        alexnet(), preset(PRESETS[0]), global_batch=64, seed=3, schedule=Schedule.ONE_F_ONE_B
    )
    ctx = Context(
        problem, Search(problem, "genetic", {}), GeneticConfig(), np.random.default_rng(0)
    )
    assert not ctx.equal
    plan = check_result(problem, "genetic", unequal=True, **SMALL_GA)
    assert plan.schedule is Schedule.ONE_F_ONE_B


@pytest.mark.parametrize(
    ("schedule", "microbatches", "planners"),
    [(Schedule.ONE_F_ONE_B, None, ("bayes",)), (Schedule.GPIPE, 8, ("genetic", "bayes"))],
)
def test_equal_microbatches_when_required(
    schedule: Schedule, microbatches: int | None, planners: tuple[str, ...]
) -> None:
    problem = Problem(
        alexnet(),
        preset(PRESETS[0]),
        global_batch=64,
        schedule=schedule,
        microbatches=microbatches,
    )
    for planner in planners:
        plan = check_result(problem, planner, **SMALL[planner])
        sizes = {s.microbatch for s in plan.stages}
        assert len(sizes) == 1
        if microbatches is not None:
            assert sizes == {64 // microbatches}


# --- exactness on a tiny instance ---------------------------------------------------------------


def all_plans(n_layers: int, cluster: ClusterSpec, batch: int) -> list[Plan]:
    """Every plan: contiguous stages x devices (a stage each, or unused) x equal microbatch."""
    ids = cluster.device_ids
    sizes = [d for d in range(1, batch + 1) if batch % d == 0]
    out = []
    for S in range(1, min(n_layers, len(ids)) + 1):
        for cuts in itertools.combinations(range(1, n_layers), S - 1):
            bounds = (0, *cuts, n_layers)
            for assign in itertools.product(range(-1, S), repeat=len(ids)):
                if any(s not in assign for s in range(S)):
                    continue
                for b in sizes:
                    stages = tuple(
                        Stage(
                            (bounds[s], bounds[s + 1]),
                            tuple(d for d, a in zip(ids, assign, strict=True) if a == s),
                            b,
                        )
                        for s in range(S)
                    )
                    out.append(Plan(batch, stages))
    return out


@pytest.mark.parametrize("objective", [Objective.TIME, Objective.COST])
def test_genetic_finds_the_exact_optimum_of_a_tiny_instance(objective: Objective) -> None:
    profile, cluster = chain(4), tiny_cluster()
    problem = Problem(profile, cluster, objective, global_batch=8, seed=0)
    values = [
        problem.score_estimate(simulate(p, profile, cluster))
        for p in all_plans(len(profile), cluster, 8)
    ]
    best = min(values)
    assert np.isfinite(best)
    result = make_planner("genetic", unequal=False).plan(problem)
    assert result.value == pytest.approx(best, rel=1e-9)


# --- operators and options ----------------------------------------------------------------------


def test_repairs_give_distinct_cuts_and_a_device_per_stage() -> None:
    rng = np.random.default_rng(0)
    cuts = repair_cuts(rng.integers(-3, 12, size=(200, 4)), 6)
    assert ((cuts >= 1) & (cuts <= 5)).all() and (np.diff(cuts, axis=1) > 0).all()
    assign = repair_devices(rng.integers(-1, 7, size=(200, 5)), 5, rng)
    for s in range(5):
        assert (assign == s).any(axis=1).all()


def test_canonical_assignment_sorts_interchangeable_devices() -> None:
    cluster = preset(ROOT / "examples/clusters/tapp-paper.yaml")  # 2 x gtx1080ti, 2 x p100
    classes = device_classes(cluster)
    assert sorted(len(c) for c in classes) == [2, 2]
    a = np.array([[0, 2, 1, 1, 0], [0, 1, 2, 0, 1]])
    b = canonical(a, classes)
    assert (b[0] == b[1]).all()


@pytest.mark.parametrize(
    ("planner", "options"),
    [("genetic", {"population": 2}), ("genetic", {"mutation": 0.1}), ("bayes", {"n_trials": 0})],
)
def test_bad_options_are_refused(planner: str, options: dict[str, object]) -> None:
    with pytest.raises(ProblemError):
        make_planner(planner, **options)
