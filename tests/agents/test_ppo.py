"""PPO on RLlib: a one-iteration smoke test with one env runner, checkpoint and restore, on
a Ray started through ``executor.runtime``; PPO refuses to run without a connected Ray. The
local search that polishes PPO's best plan is tested in ``test_local_search.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ray.rllib.core.columns import Columns

from pipeplan.agents import Budget, Problem, ProblemError, make_planner
from pipeplan.agents.rllib_ppo import (
    PPOOptions,
    PPOPlanner,
    Restart,
    SlotScoringModule,
    _gather,
    _share_elites,
    best_distinct,
    env_config,
    slot_model_config,
)
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import LayerProfile, ModelProfile
from pipeplan.envs import PlacementEnv
from pipeplan.executor import runtime

ROOT = Path(__file__).resolve().parents[2]


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
    assert not runtime.is_connected(), "Ray is connected: a test before this one left it so"
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    problem = Problem(chain(), cluster, global_batch=8, budget=Budget(None, None))
    with pytest.raises(PipeplanError, match="ppo: needs a connected Ray cluster"):
        make_planner("ppo", iterations=1).plan(problem)


@pytest.mark.rllib
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_one_iteration_with_one_env_runner_returns_a_valid_plan(ray_local, tmp_path) -> None:  # type: ignore[no-untyped-def]
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
        slot_scores=True,
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
        slot_scores=True, restore=str(ckpt),
    ).plan(problem)  # fmt: skip
    again.plan.validate(problem.profile, cluster)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"iterations": 0}, "ppo.iterations: must be >= 1, got 0"),
        ({"learning_rate": 1.0}, "known options"),
        ({"actions": "stage"}, "ppo.actions: unknown 'stage'"),
        ({"stage_sizes": 1}, "ppo.stage_sizes: must be true or false, got 1"),
        ({"elite_starts": 1.5}, r"ppo.elite_starts: must be in \[0, 1\], got 1.5"),
        ({"elites": 0}, "ppo.elites: must be >= 1, got 0"),
        ({"restart_after": 0}, "ppo.restart_after: must be >= 1, got 0"),
        ({"slot_scores": "no"}, "ppo.slot_scores: must be true, false or unset, got 'no'"),
        ({"twin_opens": True, "actions": "layers"}, "ppo.twin_opens: needs the 'stages' actions"),
    ],
)
def test_bad_options_are_refused_before_ray_starts(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ProblemError, match=message):
        make_planner("ppo", **options)


def test_twin_opens_and_slot_scores_default_to_the_action_space_that_has_them() -> None:
    stages, layers = PPOOptions(), PPOOptions(actions="layers")
    assert stages.uses_twin_opens and stages.uses_slot_scores
    assert not layers.uses_twin_opens and not layers.uses_slot_scores  # unset: off, no error
    off = PPOOptions(twin_opens=False, slot_scores=False)
    assert not off.uses_twin_opens and not off.uses_slot_scores


def test_best_distinct_keeps_the_best_episode_of_each_plan() -> None:
    one, two, three = {"stages": [1]}, {"stages": [2]}, {"stages": [3]}
    elites = [(3.0, one, (0, 1)), (1.0, two, (0, 2)), (2.0, one, (1, 1)), (1.0, three, (0, 3)),
              (1.0, dict(two), (5, 2))]  # fmt: skip
    assert best_distinct(elites, 5) == [
        (1.0, two, (0, 2)),
        (1.0, three, (0, 3)),
        (2.0, one, (1, 1)),
    ]
    assert best_distinct(elites, 1) == [(1.0, two, (0, 2))]  # the same plan by other actions: one
    assert best_distinct([], 3) == []


def test_stages_choose_their_own_sizes_only_where_the_env_offers_several() -> None:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    problem = Problem(chain(), cluster, global_batch=8, budget=Budget(None, None))
    assert PPOOptions().stage_sizes  # on by default, where the env offers several sizes
    assert env_config(problem, None, stage_sizes=True)["stage_sizes"] is True
    assert env_config(problem, None, stage_sizes=False)["stage_sizes"] is False
    assert env_config(problem, 2, stage_sizes=True)["stage_sizes"] is False  # one count
    assert env_config(problem, None, actions="layers", stage_sizes=True)["stage_sizes"] is False
    fixed = Problem(chain(), cluster, global_batch=8, microbatches=4, budget=Budget(None, None))
    assert env_config(fixed, None, stage_sizes=True)["stage_sizes"] is False
    env = PlacementEnv(env_config(problem, None, stage_sizes=True))
    assert env.instance.stage_sizes and env.instance.sizes == (1, 2, 4, 8)


def test_slot_scores_add_one_shared_function_of_each_slot_row_to_its_logit() -> None:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "tapp-paper.yaml")
    config = {"profile": chain(), "cluster": cluster, "actions": "stages", "max_replicas": 2,
              "microbatches": None, "global_batch": 8, "stage_sizes": True}  # fmt: skip
    env = PlacementEnv(config)
    model = {"head_fcnet_hiddens": [16], "fcnet_hiddens": [16], **slot_model_config(config)}
    torch.manual_seed(0)
    module = SlotScoringModule(
        observation_space=env.observation_space, action_space=env.action_space, model_config=model
    )
    inst = env.instance
    env.reset(seed=0)
    env.step(inst.count_offset + 1)
    obs, *_ = env.step(0)  # a stage's end pending: the end rows are set

    def logits(train: bool = False) -> torch.Tensor:
        o = {k: torch.tensor(v)[None] for k, v in obs.items()}
        if train:  # the learner's batch: observations and the mask apart
            batch = {Columns.OBS: o["observations"], "action_mask": o["action_mask"]}
            return module.forward_train(batch)[Columns.ACTION_DIST_INPUTS][0].detach()
        return module.forward_exploration({Columns.OBS: o})[Columns.ACTION_DIST_INPUTS][0].detach()

    before = logits()  # the scorers' last layers start at zero: the plain MLP's logits
    ends, _ = module.slot_scorers
    with torch.no_grad():
        ends[-1].weight.fill_(0.5)
        ends[-1].bias.fill_(0.25)
    after = logits()
    assert torch.equal(after, logits(train=True))
    allowed = torch.tensor(obs["action_mask"]) > 0
    at, n = inst.end_offset, inst.end_slots
    changed = torch.zeros_like(allowed)
    changed[at : at + n] = True
    assert torch.equal(after[allowed & ~changed], before[allowed & ~changed])
    assert (after[~allowed] < -1e30).all()  # masked actions stay masked
    o = torch.tensor(obs["observations"])
    (obs_at, features, _, count), (ctx_at, ctx_n) = model["slot_groups"][0], model["slot_context"]
    rows = o[obs_at : obs_at + features * count].reshape(count, features)
    both = torch.cat([rows, o[ctx_at : ctx_at + ctx_n].expand(count, ctx_n)], dim=1)
    score = ends(both).squeeze(-1).detach()  # one function of each row and the context
    free = allowed[at : at + n]
    assert free.sum() > 1
    assert torch.allclose((after - before)[at : at + n][free], score[free], atol=1e-5)


@pytest.mark.rllib
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_elites_reach_every_env_and_a_restart_brings_the_first_policy_back(ray_local) -> None:  # type: ignore[no-untyped-def]
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    problem = Problem(chain(), cluster, global_batch=8, seed=2, budget=Budget(None, None))
    planner = PPOPlanner(num_env_runners=1, train_batch=60, minibatch=30, epochs=1,
                         elite_starts=0.5, elites=3, elite_mutations=0.5, twin_opens=True,
                         slot_scores=True)  # fmt: skip
    algo = planner._build(problem, None, 1)
    try:
        restart = Restart(algo)
        first = _sampler_weights(algo)
        algo.train()
        episodes, found = _gather(algo)
        elites = best_distinct(found, 3)
        assert episodes >= 60 // 24 and 1 <= len(elites) <= 3
        for value, doc, actions in elites:  # each elite's actions rebuild its plan
            env = PlacementEnv(env_config(problem, None, stage_sizes=True, twin_opens=True))
            env.reset(seed=0)
            info: dict[str, Any] = {}
            for a in actions:
                _, _, _, _, info = env.step(a)
            assert info["value"] == value and info["plan"].to_dict() == doc
        _share_elites(algo, "chain", elites)
        held = algo.env_runner_group.foreach_env_runner(
            lambda r: r.env.unwrapped.get_attr("elites") if r.env is not None else None,
            local_env_runner=False,
        )
        want = {"chain": tuple(e[2] for e in elites)}
        assert held and all(list(h) == [want] * len(h) for h in held)  # every env of every runner
        algo.train()  # episodes now also start from the elites' prefixes
        assert _gather(algo)[0] > episodes
        trained = _sampler_weights(algo)
        assert not all(torch.equal(a, b) for a, b in zip(first, trained, strict=True))
        restart(algo)
        assert all(torch.equal(a, b) for a, b in zip(first, _sampler_weights(algo), strict=True))
        assert _gather(algo)[1] == []  # the runners forgot their elites, and so did the envs
        forgotten = algo.env_runner_group.foreach_env_runner(
            lambda r: r.env.unwrapped.get_attr("elites"), local_env_runner=False
        )
        assert all(list(h) == [{}] * len(h) for h in forgotten)
        learner = algo.learner_group.get_weights()["default_policy"]
        initial = restart.learner["learner"]["rl_module"]["default_policy"]
        assert all(np.array_equal(learner[k], initial[k]) for k in initial)
        algo.train()  # and learning goes on from there
    finally:
        algo.stop()


def _sampler_weights(algo: Any) -> list[torch.Tensor]:
    """The policy weights of the (one) remote env runner."""
    [weights] = algo.env_runner_group.foreach_env_runner(
        lambda r: [t.detach().clone() for t in r.module.state_dict().values()],
        local_env_runner=False,
    )
    return list(weights)


@pytest.mark.rllib
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_on_a_cluster_with_counts_ppo_plans_by_kind(ray_local) -> None:  # type: ignore[no-untyped-def]
    """Nodes given with counts: the episodes are the kind-level MDP's (options, node counts,
    ends), started from the balanced splits; the answer takes whole nodes of one kind per
    stage, the first free ones."""
    cluster = ClusterSpec.from_dict(
        {
            "name": "owned",
            "device_types": {
                "a": {"flops": 2e13, "memory_gb": 16},
                "b": {"flops": 5e12, "memory_gb": 32},
            },
            "nodes": [
                {"name": "na", "devices": {"a": 2}, "count": 2},
                {"name": "nb", "devices": {"b": 1}, "count": 3},
            ],
        }
    )
    problem = Problem(chain(), cluster, global_batch=8, seed=1, budget=Budget(None, None))
    options = {"iterations": 1, "num_env_runners": 1, "train_batch": 60, "minibatch": 30}
    result = make_planner("ppo", epochs=1, **options).plan(problem)
    result.plan.validate(problem.profile, cluster)
    assert result.estimate.fits and result.evaluations >= 60 // (1 + 3 * 6)
    taken = {"na": 0, "nb": 0}
    for stage in result.plan.stages:
        nodes = list(dict.fromkeys(d.split("/")[0] for d in stage.devices))
        kind = nodes[0].rsplit("-", 1)[0]
        assert nodes == [f"{kind}-{k}" for k in range(taken[kind], taken[kind] + len(nodes))]
        per_node = {"na": 2, "nb": 1}[kind]
        assert len(stage.devices) == per_node * len(nodes)
        taken[kind] += len(nodes)
