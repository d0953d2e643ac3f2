"""Local search over whole plans: neighbours are valid plans one edit away; polish only
improves, through the search's reward source, and stops at a local optimum."""

from __future__ import annotations

from pathlib import Path

from pipeplan.agents import Budget, Problem
from pipeplan.agents.local_search import neighbours, polish
from pipeplan.agents.search import Search
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import LayerProfile, ModelProfile

ROOT = Path(__file__).resolve().parents[2]


def chain(n: int = 6) -> ModelProfile:
    layers = [
        LayerProfile(
            f"l{i}", "conv", 10_000, 1e9 * (1 + i % 3), 4096, (i + 1,) if i < n - 1 else ()
        )
        for i in range(n)
    ]
    return ModelProfile("chain", (3, 8, 8), tuple(layers))


def local_hetero() -> ClusterSpec:
    return ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")


def test_neighbours_are_valid_plans_one_edit_away() -> None:
    cluster = local_hetero()
    problem = Problem(chain(), cluster, global_batch=8)
    ids = cluster.device_ids
    plan = Plan(8, (Stage((0, 2), (ids[0],), 2), Stage((2, 6), (ids[1], ids[2]), 2)))
    near = neighbours(plan, problem)
    for p in near:
        p.validate(problem.profile, cluster)
    shapes = {tuple((s.layers, s.devices) for s in p.stages) for p in near}
    assert (((0, 3), (ids[0],)), ((3, 6), (ids[1], ids[2]))) in shapes  # boundary moved
    assert (((0, 2), (ids[1], ids[2])), ((2, 6), (ids[0],))) in shapes  # groups reordered
    assert (((0, 6), (ids[0], ids[1], ids[2])),) in shapes  # merged
    assert (((0, 2), (ids[0],)), ((2, 6), (ids[1], ids[2], ids[3]))) in shapes  # replica
    assert (((0, 1), (ids[0],)), ((1, 2), (ids[3],)), ((2, 6), (ids[1], ids[2]))) in shapes
    assert {p.stages[0].microbatch for p in near} == {1, 2, 4, 8}


def test_polish_only_improves_and_stops_at_a_local_optimum() -> None:
    cluster = local_hetero()
    problem = Problem(chain(), cluster, global_batch=8, budget=Budget(None, None))
    search = Search(problem, "ppo", {})
    worst = Plan(8, (Stage((0, 6), (cluster.device_ids[3],), 1),))
    start = float(search.evaluate_plans([worst])[0])
    polish(search, 10_000)
    assert search.best_value < start
    assert search.best_plan is not None
    again = search.evaluate_plans(neighbours(search.best_plan, problem))
    assert again.min() >= search.best_value  # no neighbour is better


def test_polish_spends_at_most_its_evaluations() -> None:
    problem = Problem(chain(), local_hetero(), global_batch=8, budget=Budget(None, None))
    search = Search(problem, "ppo", {})
    search.evaluate_plans([Plan(8, (Stage((0, 6), (problem.cluster.device_ids[3],), 1),))])
    polish(search, 7)
    assert search.evaluations == 1 + 7
