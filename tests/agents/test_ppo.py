"""PPO on RLlib: a one-iteration smoke test with one env runner, checkpoint and restore; the
local search that polishes PPO's best plan (no Ray)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agents import Budget, Problem, ProblemError, make_planner
from agents.rllib_ppo import neighbours, polish
from agents.search import Search
from core.cluster import ClusterSpec
from core.plan import Plan, Stage
from core.profile import LayerProfile, ModelProfile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_session():  # type: ignore[no-untyped-def]
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 2**20,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def chain(n: int = 6) -> ModelProfile:
    layers = [
        LayerProfile(
            f"l{i}", "conv", 10_000, 1e9 * (1 + i % 3), 4096, (i + 1,) if i < n - 1 else ()
        )
        for i in range(n)
    ]
    return ModelProfile("chain", (3, 8, 8), tuple(layers))


@pytest.mark.rllib
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_one_iteration_with_one_env_runner_returns_a_valid_plan(ray_session, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    problem = Problem(chain(), cluster, global_batch=8, seed=1, budget=Budget(None, None))
    ckpt = tmp_path / "ppo"
    planner = make_planner(
        "ppo",
        iterations=1,
        num_env_runners=1,
        train_batch=60,
        minibatch=30,
        epochs=1,
        checkpoint=str(ckpt),
    )
    result = planner.plan(problem)
    result.plan.validate(problem.profile, cluster)
    assert result.estimate.fits
    # every episode (a microbatch count, 6 layers, maybe replicas) costs one plan
    assert result.evaluations >= 60 // (1 + 6 + 5)
    assert result.history and result.history[-1].best == result.value
    assert ckpt.exists()
    again = make_planner(
        "ppo", iterations=1, train_batch=60, minibatch=30, epochs=1, restore=str(ckpt)
    ).plan(problem)
    again.plan.validate(problem.profile, cluster)


def test_bad_options_are_refused_before_ray_starts() -> None:
    with pytest.raises(ProblemError, match="ppo.iterations: must be >= 1, got 0"):
        make_planner("ppo", iterations=0)
    with pytest.raises(ProblemError, match="known options"):
        make_planner("ppo", learning_rate=1.0)


def test_neighbours_are_valid_plans_one_edit_away() -> None:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
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
    assert {p.stages[0].microbatch for p in near} == {1, 2, 4, 8}


def test_polish_only_improves_and_stops_at_a_local_optimum() -> None:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    problem = Problem(chain(), cluster, global_batch=8, budget=Budget(None, None))
    search = Search(problem, "ppo", {})
    worst = Plan(8, (Stage((0, 6), (cluster.device_ids[3],), 1),))
    start = float(search.evaluate_plans([worst])[0])
    polish(search, 10_000)
    assert search.best_value < start
    assert search.best_plan is not None
    again = search.evaluate_plans(neighbours(search.best_plan, problem))
    assert again.min() >= search.best_value  # no neighbour is better
