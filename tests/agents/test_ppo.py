"""PPO on RLlib: a one-iteration smoke test with one env runner, checkpoint and restore."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agents import Budget, Problem, ProblemError, make_planner
from core.cluster import ClusterSpec
from core.profile import LayerProfile, ModelProfile

pytestmark = [pytest.mark.rllib, pytest.mark.ray, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_session():  # type: ignore[no-untyped-def]
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(
        address="local",
        num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False
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
    assert result.evaluations >= 60 // 6  # every episode of 6 steps costs one plan
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
