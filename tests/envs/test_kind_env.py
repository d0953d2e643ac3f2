"""The kind-level placement MDP: gymnasium's checks, the masks (memory, nodes, stages), a
plan built by its actions is the plan the kind-level planners make concrete, elite starts,
and bad configs named."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from pipeplan.agents.problem import Budget, Problem
from pipeplan.agents.provision.exact import found_batch
from pipeplan.agents.provision.genetic_kinds import KindPlan
from pipeplan.agents.provision.scale import kind_actions, kind_env_config, scale_space
from pipeplan.agents.search import Search
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.profile import LayerProfile, ModelProfile
from pipeplan.envs.config import EnvConfigError
from pipeplan.envs.kind_env import KindPlacementEnv
from pipeplan.envs.kinds import END, NODES, OPTION, SIZE, action_mask, phase

GB = 1e9


def chain(n: int, params: float = 2e9) -> ModelProfile:
    layers = [
        LayerProfile(f"l{i}", "fc", params, 4e9 * (1 + i % 3), 1e6, [i + 1] if i < n - 1 else [])
        for i in range(n)
    ]
    return ModelProfile("chain", [8], layers)


def owned() -> ClusterSpec:
    """Three kinds: two nodes of 4 big GPUs, three of 2 small ones, a CPU server."""
    return ClusterSpec.from_dict(
        {
            "name": "owned",
            "device_types": {
                "big": {"flops": 3e14, "memory_gb": 80},
                "small": {"flops": 6e13, "memory_gb": 16},
                "cpu": {"flops": 5e12, "memory_gb": 512},
            },
            "nodes": [
                {"name": "b", "devices": {"big": 4}, "count": 2},
                {"name": "s", "devices": {"small": 2}, "count": 3},
                {"name": "c", "devices": {"cpu": 1}},
            ],
        }
    )


def problem(layers: int = 8, batch: int = 64) -> Problem:
    return Problem(chain(layers), owned(), global_batch=batch, budget=Budget(None, 10.0))


def config(p: Problem) -> dict[str, object]:
    env, _ = kind_env_config(p, Search(p, "ppo", {}), 0.0)
    return env


def run(env: KindPlacementEnv, actions: list[int]) -> dict[str, object]:
    env.reset(seed=0)
    info: dict[str, object] = {}
    for a in actions:
        _, _, done, _, info = env.step(a)
        assert not info["repaired"], (a, env.actions)
        if done:
            break
    return info


def test_gymnasium_checks_pass_without_warnings() -> None:
    env = KindPlacementEnv(config(problem()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*render.*")
        check_env(env, skip_render_check=True)


def test_actions_of_a_kind_plan_build_the_plan_the_kind_planners_make() -> None:
    p = problem()
    space = scale_space(p, Search(p, "x", {}))
    plan = KindPlan((0, 5, 6, 8), ((0, 1), (1, 2), (2, 1)), space.sizes[1])
    env = KindPlacementEnv(config(p))
    info = run(env, list(kind_actions(space.sizes, space.cat, plan)))
    concrete = found_batch(space.cat, [plan.found()]).plan(0, p.cluster, 64, p.schedule)
    assert info["plan"] == concrete
    assert info["value"] == simulate(concrete, p.profile, p.cluster).batch_time_s
    assert info["actions"] == kind_actions(space.sizes, space.cat, plan)


def test_phases_and_masks() -> None:
    env = KindPlacementEnv(config(problem()))
    inst = env.instance
    obs, _ = env.reset(seed=0)
    assert phase(inst, env.state) == SIZE
    assert obs["action_mask"][: inst.option_offset].all()
    assert not obs["action_mask"][inst.option_offset :].any()
    env.step(0)  # the smallest size, one sample
    assert phase(inst, env.state) == OPTION
    env.step(inst.option_offset + 1)  # the small GPUs: three nodes
    assert phase(inst, env.state) == NODES
    nodes = action_mask(inst, env.state)[inst.nodes_offset : inst.end_offset]
    assert nodes.tolist() == [True, True, True]
    env.step(inst.nodes_offset)  # one node, 2 x 16 GB: 4 x 2 GB of each layer's state
    assert phase(inst, env.state) == END
    ends = action_mask(inst, env.state)[inst.end_offset :]
    assert ends.tolist() == [True] + [False] * 7  # one layer fits (8 GB + activations), two do not
    assert env.observation_space.contains(env._obs())


def test_the_last_nodes_must_take_the_rest() -> None:
    env = KindPlacementEnv(config(problem()))
    inst = env.instance
    env.reset(seed=0)
    for a in (0, inst.option_offset + 2, inst.nodes_offset):  # size, the CPU, its one node
        env.step(a)
    env.step(inst.end_offset + 1)  # layers 0-1 on the CPU (512 GB)
    for a in (inst.option_offset + 0, inst.nodes_offset + 1):  # both big nodes
        env.step(a)
    env.step(inst.end_offset + 5)
    env.step(inst.option_offset + 1)
    env.step(inst.nodes_offset + 2)  # every small node: nothing is left after it
    ends = action_mask(inst, env.state)[inst.end_offset :]
    assert ends.tolist() == [False] * 7 + [True]  # the rest, though it does not fit
    options = action_mask(inst, env.state)[inst.option_offset : inst.nodes_offset]
    assert not options.any()


def test_elite_starts_replay_a_prefix() -> None:
    p = problem()
    env = KindPlacementEnv({**config(p), "elite_starts": 1.0})
    space = scale_space(p, Search(p, "x", {}))
    plan = KindPlan((0, 5, 6, 8), ((0, 1), (1, 2), (2, 1)), space.sizes[1])
    elite = kind_actions(space.sizes, space.cat, plan)
    env.set_elites({p.profile.name: [elite]})
    starts = set()
    for seed in range(12):
        env.reset(seed=seed)
        assert tuple(env.actions) == elite[: len(env.actions)]
        starts.add(len(env.actions))
    assert len(starts) > 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sizes": [7]}, "sizes: divisors of global_batch 64 needed, got [7]"),
        ({"options": [("big", 5)]}, "options: kind 5 of ('big', 5) not in 0..2"),
        ({"options": [("cpu", 0)]}, "options: nodes of kind 0 have no device of type 'cpu'"),
        ({"kind_nodes": [["b-0"], ["x"]]}, "kind_nodes: no node 'x' in cluster 'owned'"),
        ({"objective": "cost"}, "objective: the kind-level MDP plans the batch time, got 'cost'"),
        ({"max_stages": 0}, "max_stages: must be >= 1, got 0"),
        ({"elite_starts": 2.0}, "elite_starts: must be in [0, 1], got 2.0"),
        ({"colour": 1}, "env config: unknown keys ['colour']"),
    ],
)
def test_bad_configs_name_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(EnvConfigError) as e:
        KindPlacementEnv({**config(problem()), **change})
    assert message in str(e.value)


def test_a_random_policy_mostly_fits() -> None:
    """The memory mask keeps most random episodes within memory."""
    env = KindPlacementEnv(config(problem()))
    rng = np.random.default_rng(0)
    feasible = 0
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        done = False
        while not done:
            obs, _, done, _, info = env.step(int(rng.choice(np.flatnonzero(obs["action_mask"]))))
        feasible += bool(info["feasible"])
    assert feasible >= 15
