"""PPO on RLlib: a one-iteration smoke test with one env runner, checkpoint and restore, on
a Ray started through ``executor.runtime``; PPO refuses to run without a connected Ray. The
local search that polishes PPO's best plan is tested in ``test_local_search.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents import Budget, Problem, ProblemError, make_planner
from agents.rllib_ppo import PPOOptions, env_config
from core.cluster import ClusterSpec
from core.errors import PipeplanError
from core.profile import LayerProfile, ModelProfile
from envs import PlacementEnv
from executor import runtime

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_session():  # type: ignore[no-untyped-def]
    runtime.start_local(num_cpus=2)
    yield
    runtime.shutdown()


def chain(n: int = 6) -> ModelProfile:
    layers = [
        LayerProfile(
            f"l{i}", "conv", 10_000, 1e9 * (1 + i % 3), 4096, (i + 1,) if i < n - 1 else ()
        )
        for i in range(n)
    ]
    return ModelProfile("chain", (3, 8, 8), tuple(layers))


@pytest.mark.rllib
def test_ppo_refuses_to_run_without_a_connected_ray() -> None:
    if runtime.is_connected():
        pytest.skip("another test left Ray connected")
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    problem = Problem(chain(), cluster, global_batch=8, budget=Budget(None, None))
    with pytest.raises(PipeplanError, match="ppo: needs a connected Ray cluster"):
        make_planner("ppo", iterations=1).plan(problem)


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
        stage_sizes=True,
        checkpoint=str(ckpt),
    )
    result = planner.plan(problem)
    result.plan.validate(problem.profile, cluster)
    assert result.estimate.fits
    # every episode (a microbatch count, at most 6 stages of an open, replicas, an end and
    # the stage's own microbatch size) costs one plan
    assert result.evaluations >= 60 // (1 + 6 * 3 + 5)
    assert result.history and result.history[-1].best == result.value
    assert ckpt.exists()
    again = make_planner(
        "ppo", iterations=1, train_batch=60, minibatch=30, epochs=1, stage_sizes=True,
        restore=str(ckpt),
    ).plan(problem)  # fmt: skip
    again.plan.validate(problem.profile, cluster)


def test_bad_options_are_refused_before_ray_starts() -> None:
    with pytest.raises(ProblemError, match="ppo.iterations: must be >= 1, got 0"):
        make_planner("ppo", iterations=0)
    with pytest.raises(ProblemError, match="known options"):
        make_planner("ppo", learning_rate=1.0)
    with pytest.raises(ProblemError, match="ppo.actions: unknown 'stage'"):
        make_planner("ppo", actions="stage")
    with pytest.raises(ProblemError, match="ppo.stage_sizes: must be true or false, got 1"):
        make_planner("ppo", stage_sizes=1)


def test_stages_choose_their_own_sizes_only_where_the_env_offers_several() -> None:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    problem = Problem(chain(), cluster, global_batch=8, budget=Budget(None, None))
    assert not PPOOptions().stage_sizes  # the measured defaults: equal microbatches
    assert env_config(problem, None, stage_sizes=True)["stage_sizes"] is True
    assert env_config(problem, None, stage_sizes=False)["stage_sizes"] is False
    assert env_config(problem, 2, stage_sizes=True)["stage_sizes"] is False  # one count
    assert env_config(problem, None, actions="layers", stage_sizes=True)["stage_sizes"] is False
    fixed = Problem(chain(), cluster, global_batch=8, microbatches=4, budget=Budget(None, None))
    assert env_config(fixed, None, stage_sizes=True)["stage_sizes"] is False
    env = PlacementEnv(env_config(problem, None, stage_sizes=True))
    assert env.instance.stage_sizes and env.instance.sizes == (1, 2, 4, 8)
