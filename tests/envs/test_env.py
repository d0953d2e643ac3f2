"""The placement MDP: gymnasium's checker, masks that never allow an invalid plan, rewards,
and the TAPP layer encoding."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan import envs
from pipeplan.agents import Budget, InfeasibleError, Problem, make_planner
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.profile import LayerProfile, ModelProfile
from pipeplan.envs.config import EnvConfigError, make_instance
from pipeplan.envs.encoding import ABSENT, WIDTH, encode_profile, op_vector
from pipeplan.envs.env import PlacementEnv
from pipeplan.envs.mdp import (
    GLOBAL_FEATURES,
    action_kinds,
    action_mask,
    end_features,
    exploring_start,
    global_offset,
    initial_state,
    is_terminal,
    memory_mask,
    observation_size,
    observe,
    size_features,
    slot_groups,
    structural_mask,
    to_plan,
    transition,
)
from tests.core.strategies import clusters, profiles

CLUSTER = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "tapp-paper.yaml"


def chain(n: int, op: str = "conv", params: int = 10**6, act: int = 10**5) -> ModelProfile:
    layers = [
        LayerProfile(f"l{i}", op, params, 1e9, act, (i + 1,) if i < n - 1 else ()) for i in range(n)
    ]
    return ModelProfile("chain", (3, 8, 8), tuple(layers))


def two_devices(memory_gb: float = 16.0) -> ClusterSpec:
    types = {"g": DeviceType("g", 1e12, memory_gb)}
    return ClusterSpec("two", types, (Node("n0", {"g": 1}), Node("n1", {"g": 1})))


# --- gymnasium ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"microbatches": None, "max_replicas": 3},
        {"actions": "stages"},
        {"actions": "stages", "microbatches": None, "max_replicas": 3},
        {"actions": "stages", "microbatches": None, "max_replicas": 3, "stage_sizes": True},
        {"actions": "stages", "max_replicas": 2, "twin_opens": True},
    ],
    ids=["fixed", "choices+replicas", "stages", "stages+choices+replicas", "stage_sizes", "twins"],
)
def test_check_env_passes_without_warnings(tmp_path: Path, extra: dict[str, object]) -> None:
    profile = tmp_path / "chain.json"
    chain(6).save(profile)
    config = {"profile": str(profile), "cluster": str(CLUSTER), "global_batch": 16, **extra}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = gymnasium.make(envs.ENV_ID, config=config)
        check_env(env.unwrapped)
    assert isinstance(env.unwrapped, PlacementEnv)


def test_spaces_are_what_rllib_action_masking_expects() -> None:
    env = envs.make_env({"profile": chain(4), "cluster": ClusterSpec.load(CLUSTER)})
    assert env.action_space.n == 6  # stay + 5 devices
    obs_space = env.observation_space
    assert set(obs_space.spaces) == {"observations", "action_mask"}
    assert obs_space["action_mask"].shape == (6,)
    assert obs_space["observations"].shape == (WIDTH * 3 + 5 * 5 + 10,)
    obs, _ = env.reset(seed=0)
    assert obs_space.contains(obs)
    assert obs["action_mask"].tolist() == [0, 1, 1, 1, 1, 1]  # layer 0 must open a stage


def test_episode_reward_is_reference_over_batch_time() -> None:
    env = PlacementEnv({"profile": chain(4), "cluster": two_devices(), "global_batch": 8})
    env.reset(seed=0)
    rewards = [env.step(a)[1] for a in (1, 0, 2)]
    obs, r, terminated, truncated, info = env.step(0)
    assert rewards == [0.0, 0.0, 0.0] and terminated and not truncated
    plan = info["plan"]
    assert [s.layers for s in plan.stages] == [(0, 2), (2, 4)]
    assert [s.devices for s in plan.stages] == [("n0/g:0",), ("n1/g:0",)]
    est = simulate(plan, env.instance.profile, env.instance.cluster)
    assert info["estimate"] == est and info["value"] == est.batch_time_s
    # reference: the whole batch (8 samples) at once through 4 layers on one device,
    # fwd 1 GFLOP/1 TFLOP/s per sample, bwd twice that
    assert env.instance.reference == pytest.approx(8 * 4 * 3e-3)
    assert r == pytest.approx(env.instance.reference / est.batch_time_s)


def test_infeasible_plan_gets_the_infeasible_reward() -> None:
    # each layer needs 4 MB of weights + 4 x 2 samples x 1 GB of activations > 1 GB
    big = chain(2, act=10**9)
    env = PlacementEnv(
        {"profile": big, "cluster": two_devices(1.0), "global_batch": 8,
         "infeasible_reward": -1.0}
    )  # fmt: skip
    env.reset(seed=0)
    env.step(1)
    _, r, done, _, info = env.step(0)
    assert done and not info["feasible"] and r == -1.0


def test_masked_action_is_repaired_and_flagged() -> None:
    env = PlacementEnv({"profile": chain(3), "cluster": two_devices()})
    env.reset(seed=0)
    _, _, _, _, info = env.step(0)  # staying at layer 0 is not allowed
    assert info == {"action": 1, "repaired": True}
    _, _, _, _, info = env.step(1)  # device 0 is used: repaired to "stay"
    assert info == {"action": 0, "repaired": True}


def test_min_stages_forces_opening_when_layers_run_short() -> None:
    inst = make_instance(chain(3), ClusterSpec.load(CLUSTER), min_stages=3, max_stages=3)
    s = transition(inst, initial_state(inst), 1)
    assert action_mask(inst, s)[0] == 0  # 2 layers left, 2 stages still needed
    s = transition(inst, s, 2)
    assert action_mask(inst, s)[0] == 0
    s = transition(inst, s, 3)
    assert action_mask(inst, s).tolist() == [1, 0, 0, 0, 0, 0]  # terminal


def test_memory_mask_keeps_stages_within_memory() -> None:
    # 1 GB per layer of weights (x4 = 4 GB): two layers do not fit a 6 GB device
    inst = make_instance(chain(3, params=10**9, act=0), two_devices(6.0))
    s = transition(inst, initial_state(inst), 1)
    assert memory_mask(inst, s).tolist() == [False, True, True]
    assert action_mask(inst, s).tolist() == [0, 0, 1]
    s = transition(inst, s, 2)
    # nothing fits any more: fall back to the structurally valid actions (an infeasible plan)
    assert not (structural_mask(inst, s) & memory_mask(inst, s)).any()
    assert action_mask(inst, s).tolist() == [1, 0, 0]


def test_several_profiles_are_sampled_with_the_seed() -> None:
    env = PlacementEnv({"profile": [chain(3), chain(5), chain(7)], "cluster": two_devices()})

    def sizes() -> list[int]:
        out = []
        for seed in range(8):
            env.reset(seed=seed)
            out.append(len(env.instance.profile))
        return out

    first = sizes()
    assert first == sizes() and len(set(first)) > 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"microbatches": 3}, "microbatches"),
        ({"microbatches": [2, 2]}, "repeated counts"),
        ({"microbatches": []}, "microbatches"),
        ({"max_replicas": 3}, "max_replicas"),
        ({"objective": "speed"}, "objective"),
        ({"max_stages": 9}, "max_stages"),
        ({"colour": 1}, "unknown key 'colour'"),
        ({"profile": []}, "empty"),
        ({"actions": "layer"}, "actions: unknown 'layer'"),
        ({"exploring_starts": 1.5}, r"exploring_starts: must be in \[0, 1\], got 1.5"),
        ({"start_steps": 0}, "start_steps: must be an integer >= 1, got 0"),
        ({"elite_starts": -0.1}, r"elite_starts: must be in \[0, 1\], got -0.1"),
        ({"elite_mutations": 2}, r"elite_mutations: must be in \[0, 1\], got 2"),
        ({"stage_sizes": "yes"}, "stage_sizes: must be true or false, got 'yes'"),
        ({"stage_sizes": True, "microbatches": None}, "stage_sizes: True needs actions 'stages'"),
        (
            {"stage_sizes": True, "actions": "stages", "microbatches": 2},
            r"stage_sizes: .* several microbatch counts, got actions 'stages' and counts \[2\]",
        ),
        ({"twin_opens": 1}, "twin_opens: must be true or false, got 1"),
        ({"twin_opens": True}, "twin_opens: True needs actions 'stages', got actions 'layers'"),
    ],
)
def test_bad_config_names_the_key(change: dict[str, object], message: str) -> None:
    config = {"profile": chain(3), "cluster": two_devices(), "global_batch": 8, **change}
    with pytest.raises(EnvConfigError, match=message):
        PlacementEnv(config)


# --- random masked rollouts always give valid plans -----------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=profiles(min_layers=1, max_layers=10),
    cluster=clusters(),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    m=st.sampled_from([1, 2, 4, None, [8, 2]]),
    actions=st.sampled_from(["layers", "stages", "stage_sizes"]),
    twins=st.booleans(),
    data=st.data(),
)
def test_random_masked_rollouts_give_valid_plans(
    profile: ModelProfile,
    cluster: ClusterSpec,
    schedule: str,
    m: int | list[int] | None,
    actions: str,
    twins: bool,
    data: st.DataObject,
) -> None:
    n_dev = len(cluster.device_ids)
    top = data.draw(st.integers(1, n_dev))
    low = data.draw(st.integers(1, min(top, len(profile))))
    replicas = data.draw(st.integers(1, n_dev))
    sizes = actions == "stage_sizes" and not isinstance(m, int)  # per stage, from several
    env = PlacementEnv(
        {"profile": profile, "cluster": cluster, "global_batch": 8, "microbatches": m,
         "schedule": schedule, "min_stages": low, "max_stages": top, "max_replicas": replicas,
         "actions": "layers" if actions == "layers" else "stages", "stage_sizes": sizes,
         "twin_opens": twins and actions != "layers"}
    )  # fmt: skip
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    obs, _ = env.reset(seed=0)
    fell_back, done = False, False
    info: dict[str, Any] = {}
    while not done:
        assert env.observation_space.contains(obs)
        inst, state = env.instance, env.state
        fell_back |= not (structural_mask(inst, state) & memory_mask(inst, state)).any()
        action = int(rng.choice(np.flatnonzero(obs["action_mask"])))
        obs, _, done, _, info = env.step(action)
        assert not info["repaired"]
    plan = info["plan"]
    plan.validate(profile, cluster)  # contiguous, known devices (Plan checks no device twice)
    assert low <= plan.num_stages <= top
    assert all(s.replicas <= replicas for s in plan.stages)
    if isinstance(m, int):
        assert {s.microbatch for s in plan.stages} == {8 // m}
    elif sizes:
        assert {s.microbatch for s in plan.stages} <= set(env.instance.sizes)
    else:
        assert len({s.microbatch for s in plan.stages}) == 1
    if not fell_back and schedule == "gpipe":
        assert info["estimate"].fits  # the memory mask is exact for GPipe


# --- choosing the microbatch count, adding replicas ------------------------------------------


def test_first_step_chooses_the_microbatch_count() -> None:
    env = PlacementEnv(
        {"profile": chain(2), "cluster": two_devices(), "global_batch": 8, "microbatches": None}
    )
    inst = env.instance
    assert inst.counts == (1, 2, 4, 8) and env.action_space.n == 1 + 2 + 4
    obs, _ = env.reset(seed=0)
    assert obs["action_mask"].tolist() == [0, 0, 0, 1, 1, 1, 1]  # only the counts
    assert obs["observations"][-1] == 1.0  # "choosing the microbatch count"
    obs, *_ = env.step(3 + 2)  # M = 4
    assert obs["action_mask"].tolist() == [0, 1, 1, 0, 0, 0, 0]
    assert obs["observations"][-1] == 0.0
    env.step(1)
    *_, done, _, info = env.step(0)
    assert done and [s.microbatch for s in info["plan"].stages] == [2]


def test_a_replica_joins_the_stage_just_opened_and_the_end_can_take_one() -> None:
    cluster = ClusterSpec.load(CLUSTER)  # 5 devices
    env = PlacementEnv({"profile": chain(3), "cluster": cluster, "max_replicas": 2})
    inst = env.instance
    assert env.action_space.n == 1 + 5 + 5 and inst.replica_offset == 6
    env.reset(seed=0)
    obs, *_ = env.step(1)  # stage on device 0 holds layer 0
    assert obs["action_mask"][6:].tolist() == [0, 1, 1, 1, 1]  # replicas on unused devices
    obs, *_ = env.step(6 + 2)  # device 2 joins; no layer placed
    assert env.state.layer == 1 and env.state.devices == ((0, 2),)
    assert obs["action_mask"][6:].sum() == 0  # max_replicas reached
    obs, *_ = env.step(0)  # layer 1 stays
    obs, *_ = env.step(2)  # layer 2 opens a stage on device 1
    assert env.state.layer == 3 and not is_terminal(inst, env.state)
    assert obs["action_mask"].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    obs, r, done, _, info = env.step(0)  # "stay" at the end: no replica, done
    assert done and r > 0
    ids = cluster.device_ids
    assert [s.devices for s in info["plan"].stages] == [(ids[0], ids[2]), (ids[1],)]


def test_replicas_leave_the_devices_min_stages_needs() -> None:
    inst = make_instance(chain(3), two_devices(), min_stages=2, max_replicas=2)
    s = transition(inst, initial_state(inst), 1)
    assert structural_mask(inst, s)[3:].tolist() == [False, False]
    inst = make_instance(chain(3), two_devices(), max_replicas=2)
    s = transition(inst, initial_state(inst), 1)
    assert structural_mask(inst, s)[3:].tolist() == [False, True]


def test_a_replica_halves_the_activation_share_it_must_fit() -> None:
    # 2 layers of 1 GB of activations per sample, batch 4 in one microbatch: 4 GB per layer on
    # one device, 2 GB on each of two replicas; devices of 5 GB
    big = chain(2, params=0, act=10**9)
    inst = make_instance(big, two_devices(5.0), global_batch=4, microbatches=1, max_replicas=2)
    s = transition(inst, initial_state(inst), 1)
    assert memory_mask(inst, s).tolist() == [False, True, True, True, True]
    assert action_mask(inst, s).tolist() == [0, 0, 1, 0, 1]  # stay does not fit: open or replica
    s = transition(inst, s, 3 + 1)
    assert action_mask(inst, s).tolist() == [1, 0, 0, 0, 0]  # 2 x 2 GB on each replica fits
    s = transition(inst, s, 0)
    assert is_terminal(inst, s)
    est = simulate(to_plan(inst, s), inst.profile, inst.cluster)
    assert est.fits


@st.composite
def small_clusters(draw: st.DrawFn) -> ClusterSpec:
    """1-4 devices of 1-3 types on 1-2 nodes: small enough for ``brute``."""
    big = draw(clusters())
    nodes = tuple(
        Node(f"n{k}", {t: draw(st.integers(0, 1)) for t in big.device_types})
        for k in range(draw(st.integers(1, 2)))
    )
    if not any(sum(n.devices.values()) for n in nodes):
        nodes = (Node("n0", {next(iter(big.device_types)): 1}), *nodes[1:])
    return ClusterSpec("small", big.device_types, nodes, big.network)


def optimum_actions(inst: Any, plan: Any, ids: tuple[str, ...]) -> list[int]:
    """The actions that build ``plan`` in ``inst``'s action space (the shared count: the
    first stage's)."""
    actions = [inst.count_offset + inst.counts.index(8 // plan.stages[0].microbatch)]
    for st_ in plan.stages:
        first, *rest = (ids.index(d) for d in st_.devices)
        actions += [inst.open_offset + first] + [inst.replica_offset + d for d in rest]
        if inst.by_stage:
            actions.append(inst.end_offset + st_.end - 1)
        else:
            actions += [0] * (st_.end - st_.start - 1)
        if inst.stage_sizes:
            actions.append(inst.size_offset + inst.sizes.index(st_.microbatch))
    return actions


def replay(env: PlacementEnv, actions: list[int]) -> dict[str, Any]:
    """Step ``actions`` from a reset (none repaired, the last one ends the episode, or a
    final ``0`` does: ``layers``, the last stage could still take a replica); its info."""
    env.reset(seed=0)
    info: dict[str, Any] = {}
    done = False
    for a in actions:
        assert not done
        _, _, done, _, info = env.step(a)
        assert not info["repaired"]
    if not done and not env.instance.by_stage:
        _, _, done, _, info = env.step(0)
    assert done
    return info


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=profiles(min_layers=1, max_layers=5),
    cluster=small_clusters(),
    actions=st.sampled_from(["layers", "stages"]),
)
def test_the_exact_optimum_is_an_episode_of_the_env(
    profile: ModelProfile, cluster: ClusterSpec, actions: str
) -> None:
    n_dev = len(cluster.device_ids)
    assert n_dev <= 6
    problem = Problem(profile, cluster, global_batch=8, budget=Budget(None, None))
    try:
        best = make_planner("brute", max_stages=min(3, n_dev)).plan(problem)
    except InfeasibleError:
        return
    env = PlacementEnv(
        {"profile": profile, "cluster": cluster, "global_batch": 8, "microbatches": None,
         "max_replicas": n_dev, "max_stages": min(3, n_dev), "actions": actions}
    )  # fmt: skip
    info = replay(env, optimum_actions(env.instance, best.plan, cluster.device_ids))
    assert info["value"] == pytest.approx(best.value, rel=1e-9)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(min_layers=1, max_layers=4), cluster=small_clusters())
def test_the_exact_unequal_optimum_is_an_episode_of_the_env_with_stage_sizes(
    profile: ModelProfile, cluster: ClusterSpec
) -> None:
    n_dev = len(cluster.device_ids)
    problem = Problem(profile, cluster, global_batch=8, budget=Budget(None, None))
    try:
        best = make_planner("brute", max_stages=min(3, n_dev), unequal=True).plan(problem)
    except InfeasibleError:
        return
    env = PlacementEnv(
        {"profile": profile, "cluster": cluster, "global_batch": 8, "microbatches": None,
         "max_replicas": n_dev, "max_stages": min(3, n_dev), "actions": "stages",
         "stage_sizes": True}
    )  # fmt: skip
    info = replay(env, optimum_actions(env.instance, best.plan, cluster.device_ids))
    assert info["plan"] == best.plan
    assert info["value"] == pytest.approx(best.value, rel=1e-9)


def test_stage_actions_open_add_replicas_then_choose_the_end() -> None:
    cluster = ClusterSpec.load(CLUSTER)  # 5 devices
    env = PlacementEnv(
        {"profile": chain(4), "cluster": cluster, "max_replicas": 2, "actions": "stages"}
    )
    inst = env.instance
    assert (inst.open_offset, inst.replica_offset, inst.end_offset) == (0, 5, 10)
    assert env.action_space.n == 5 + 5 + 4
    obs, _ = env.reset(seed=0)
    assert obs["action_mask"].tolist() == [1] * 5 + [0] * 9  # open a stage on any device
    obs, *_ = env.step(0)
    assert obs["action_mask"].tolist() == [0] * 5 + [0, 1, 1, 1, 1] + [1, 1, 1, 1]
    obs, *_ = env.step(5 + 3)  # device 3 joins as a replica: none more (max_replicas 2)
    assert obs["action_mask"].tolist() == [0] * 10 + [1, 1, 1, 1]
    obs, r, done, *_ = env.step(10 + 1)  # the stage ends after layer 1: layers [0, 2)
    assert env.state.layer == 2 and not done and r == 0.0
    assert obs["action_mask"].tolist() == [0, 1, 1, 0, 1] + [0] * 9
    env.step(1)
    *_, done, _, info = env.step(10 + 3)
    ids = cluster.device_ids
    assert done and [s.layers for s in info["plan"].stages] == [(0, 2), (2, 4)]
    assert [s.devices for s in info["plan"].stages] == [(ids[0], ids[3]), (ids[1],)]


def test_a_twin_open_takes_the_device_and_its_free_twins_at_once() -> None:
    cluster = ClusterSpec.load(CLUSTER)  # xeon | 2 x gtx1080ti on gpu0 | 2 x p100 on gpu1
    ids = cluster.device_ids
    gtx = [k for k, d in enumerate(ids) if "gtx1080ti" in d]
    config = {"profile": chain(4), "cluster": cluster, "max_replicas": 2, "actions": "stages"}
    env = PlacementEnv({**config, "twin_opens": True})
    inst = env.instance
    assert (inst.open_offset, inst.twin_offset, inst.replica_offset, inst.end_offset) == (
        0, 5, 10, 15)  # fmt: skip
    obs, _ = env.reset(seed=0)
    xeon = ids.index(next(d for d in ids if "xeon" in d))
    twin_ok = obs["action_mask"][inst.twin_offset : inst.replica_offset]
    assert twin_ok.tolist() == [k != xeon for k in range(5)]  # the xeon has no twin
    env.step(inst.twin_offset + gtx[1])
    assert env.state.devices == ((gtx[1], gtx[0]),)  # the device first, its twin a replica
    plain = PlacementEnv(config).instance  # the same stage by an open and a replica step
    s = transition(plain, transition(plain, initial_state(plain), gtx[1]), 5 + gtx[0])
    assert s.devices == env.state.devices and s.starts == env.state.starts
    obs, *_ = env.step(inst.end_offset + 1)
    twin_ok = obs["action_mask"][inst.twin_offset : inst.replica_offset]
    assert not twin_ok[gtx].any() and twin_ok.sum() == 2  # both gtx used: the p100s remain
    one = make_instance(chain(4), cluster, actions="stages", twin_opens=True)  # max_replicas 1
    assert not action_mask(one, initial_state(one))[one.twin_offset : one.replica_offset].any()
    need = make_instance(chain(4), cluster, actions="stages", twin_opens=True, max_replicas=2,
                         min_stages=4)  # fmt: skip
    s = transition(need, initial_state(need), need.twin_offset + gtx[0])  # 3 devices left
    s = transition(need, s, need.end_offset)
    assert action_mask(need, s)[need.twin_offset : need.replica_offset].sum() == 0  # 3 stages


def test_exploring_starts_draw_a_kind_of_action_then_an_action() -> None:
    cluster = ClusterSpec.load(CLUSTER)
    inst = make_instance(chain(40), cluster, actions="stages", max_replicas=2)
    kinds = action_kinds(inst, np.arange(inst.n_actions))
    assert kinds[: inst.replica_offset].tolist() == [1] * 5  # open; no twins
    assert set(kinds[inst.replica_offset : inst.end_offset]) == {3}  # replicas
    assert set(kinds[inst.end_offset :]) == {4}  # 40 ends
    starts = replace(inst, exploring_starts=1.0, start_steps=2)
    seconds = [exploring_start(starts, np.random.default_rng(seed))[1] for seed in range(600)]
    seconds = [taken[1] for taken in seconds if len(taken) == 2]  # the step after the open
    replicas = sum(a < inst.end_offset for a in seconds) / len(seconds)
    # a replica (4 free devices) or an end (40): each kind half the time, not 4 / 44 of it
    assert len(seconds) > 200 and 0.35 < replicas < 0.65


def test_slot_groups_locate_each_action_row_in_the_observation() -> None:
    inst = make_instance(chain(6), ClusterSpec.load(CLUSTER), actions="stages", max_replicas=2,
                         microbatches=None, global_batch=8, stage_sizes=True)  # fmt: skip
    ends, sizes = slot_groups(inst)
    assert (ends.action_offset, ends.count, ends.features) == (inst.end_offset, 6, 3)
    assert (sizes.action_offset, sizes.count, sizes.features) == (inst.size_offset, 4, 4)
    assert sizes.obs_offset + 4 * 4 == observation_size(inst)
    state = transition(inst, transition(inst, initial_state(inst), inst.count_offset + 1), 2)
    obs = observe(inst, state)  # a stage's end pending
    rows = obs[ends.obs_offset : ends.obs_offset + 3 * 6].reshape(6, 3)
    assert rows == pytest.approx(end_features(inst, state), abs=1e-6) and rows.any()
    state = transition(inst, state, inst.end_offset + 2)  # its size pending
    obs = observe(inst, state)
    rows = obs[sizes.obs_offset : sizes.obs_offset + 4 * 4].reshape(4, 4)
    assert rows == pytest.approx(size_features(inst, state), abs=1e-6) and rows.any()
    context = obs[global_offset(inst) : global_offset(inst) + GLOBAL_FEATURES]
    assert context[0] == pytest.approx(3 / 6)  # progress: the global features start there
    assert slot_groups(make_instance(chain(6), ClusterSpec.load(CLUSTER))) == ()  # layers


def test_stage_ends_leave_layers_for_min_stages_and_stop_at_max_stages() -> None:
    cluster = ClusterSpec.load(CLUSTER)
    inst = make_instance(chain(5), cluster, min_stages=3, max_stages=3, actions="stages")
    ends = slice(inst.end_offset, inst.end_offset + 5)
    s = transition(inst, initial_state(inst), 0)
    assert action_mask(inst, s)[ends].tolist() == [1, 1, 1, 0, 0]  # 2 layers for 2 stages
    s = transition(inst, transition(inst, s, inst.end_offset + 2), 1)
    assert action_mask(inst, s)[ends].tolist() == [0, 0, 0, 1, 0]  # 1 layer left for 1 stage
    s = transition(inst, transition(inst, s, inst.end_offset + 3), 2)
    assert action_mask(inst, s)[ends].tolist() == [0, 0, 0, 0, 1]  # max_stages: the last layer


def test_end_features_say_where_a_stage_balances_the_rest() -> None:
    # 4 equal layers, two equal devices: ending the first stage after layer 1 leaves the other
    # device as much as this one takes (share 0.5); later ends take more (share > 0.5)
    inst = make_instance(chain(4), two_devices(), actions="stages", microbatches=1)
    s = transition(inst, initial_state(inst), 0)
    feats = observe(inst, s)[-3 * 4 :].reshape(4, 3)
    assert feats[1, 1] == pytest.approx(0.5)
    assert feats[0, 1] < 0.5 < feats[2, 1] and feats[3, 1] == 1.0  # the last end takes all
    assert (np.diff(feats[:, 0]) > 0).all()  # longer stages, more load
    # a cut sends 10^5 bytes per sample each way between the two nodes; none at the end
    assert (feats[:3, 2] > 0).all() and feats[3, 2] == 0.0
    assert len(set(feats[:3, 2].round(9))) == 1  # every cut of the chain carries as much
    assert not observe(inst, initial_state(inst))[-12:].any()  # no stage pending: zeros


def test_stage_sizes_choose_each_stage_its_own_microbatch_after_its_end() -> None:
    env = PlacementEnv(
        {"profile": chain(3), "cluster": two_devices(), "global_batch": 8, "microbatches": None,
         "actions": "stages", "stage_sizes": True}
    )  # fmt: skip
    inst = env.instance
    assert inst.counts == (1, 2, 4, 8) and inst.sizes == (8, 4, 2, 1)
    # open on 2 devices, end after 3 layers, the shared count, a stage's size (no replicas)
    assert (inst.end_offset, inst.count_offset, inst.size_offset) == (2, 5, 9)
    assert env.action_space.n == 2 + 3 + 4 + 4
    assert env.observation_space["observations"].shape == (WIDTH * 3 + 5 * 2 + 10 + 3 * 3 + 4 * 4,)
    obs, _ = env.reset(seed=0)
    assert obs["action_mask"].tolist() == [0] * 5 + [1] * 4 + [0] * 4  # the shared count
    assert not obs["observations"][-16:].any()  # no size pending
    env.step(5 + 2)  # M = 4: the ends and memory are priced at 2 samples
    env.step(0)  # a stage on device 0
    obs, r, done, *_ = env.step(2 + 1)  # ends after layer 1: [0, 2)
    assert not done and r == 0.0 and env.state.sizes == ()
    assert obs["action_mask"].tolist() == [0] * 9 + [1] * 4  # only its size
    assert obs["observations"][-16:].reshape(4, 4)[:, 1].tolist() == [0, 0, 1, 0]  # shared
    obs, *_ = env.step(9 + 3)  # 1 sample per microbatch
    assert env.state.sizes == (3,)
    assert obs["action_mask"].tolist() == [0, 1] + [0] * 11  # open the next stage
    assert not obs["observations"][-16:].any()
    env.step(1)
    obs, _, done, *_ = env.step(2 + 2)  # the last stage ends at the last layer: its size next
    assert not done and obs["action_mask"].tolist() == [0] * 9 + [1] * 4
    _, r, done, _, info = env.step(9 + 0)  # the whole batch at once
    plan = info["plan"]
    assert done and [(s.layers, s.microbatch) for s in plan.stages] == [((0, 2), 1), ((2, 3), 8)]
    est = simulate(plan, inst.profile, inst.cluster)
    assert info["value"] == est.batch_time_s and r == pytest.approx(
        inst.reference / est.batch_time_s
    )


def test_size_features_rank_sizes_by_the_stage_busy_time_over_the_batch() -> None:
    # layer 0 has no parameters, layer 1 1 GB: its update streams 4 GB at 100 GB/s, 0.04 s,
    # and each of M microbatches but the first adds that (rule 2b); the compute over the
    # batch, 8 samples x 3 ms, is the same at every size (no fixed time)
    layers = [
        LayerProfile("conv", "conv", 0, 1e9, 10**5, (1,)),
        LayerProfile("fc", "fc", 10**9, 1e9, 10**5, ()),
    ]
    inst = make_instance(
        ModelProfile("two", (3, 8, 8), tuple(layers)), two_devices(), global_batch=8,
        microbatches=None, actions="stages", stage_sizes=True
    )  # fmt: skip
    shared = transition(inst, initial_state(inst), inst.count_offset + 2)  # M = 4, b = 2
    s = transition(inst, transition(inst, shared, 0), inst.end_offset + 0)  # [0, 1) on dev 0
    first = size_features(inst, s)
    assert first[:, 0].tolist() == [1.0] * 4  # no parameters: every size is as busy
    assert first[:, 1].tolist() == [0, 0, 1, 0]
    assert first[:, 2].tolist() == pytest.approx([1, 2 / 3, 1 / 3, 0])  # log b / log 8
    # the whole model on one device over the batch, over 2 devices: 8 x 6 ms / 2 = 24 ms
    assert first[:, 3].tolist() == pytest.approx([0.024 / 0.048] * 4)
    s = transition(inst, transition(inst, s, inst.size_offset + 2), 1)
    s = transition(inst, s, inst.end_offset + 1)  # [1, 2) on dev 1: fc
    feats = observe(inst, s)[-16:].reshape(4, 4)
    busy = np.array([0.024 + (m - 1) * 0.04 for m in (1, 2, 4, 8)])
    assert feats[:, 0] == pytest.approx(0.024 / busy, rel=1e-6)  # the whole batch is best
    assert feats[:, 3] == pytest.approx(busy / (busy + 0.024), rel=1e-6)
    assert (np.diff(feats[:, 0]) < 0).all()  # sizes 8 > 4 > 2 > 1


@pytest.mark.parametrize(
    ("actions", "sizes"), [("layers", False), ("stages", False), ("stages", True)]
)
def test_exploring_starts_begin_after_a_few_random_legal_actions(actions: str, sizes: bool) -> None:
    config = {"profile": chain(6), "cluster": ClusterSpec.load(CLUSTER), "global_batch": 16,
              "microbatches": None, "max_replicas": 2, "actions": actions,
              "stage_sizes": sizes}  # fmt: skip
    plain = PlacementEnv(config)
    env = PlacementEnv({**config, "exploring_starts": 1.0, "start_steps": 3})
    starts = set()
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        assert env.observation_space.contains(obs)
        state = env.state
        assert state != initial_state(env.instance) and not is_terminal(env.instance, state)
        assert state.count >= 0  # the first random action chose the microbatch count
        replicas = sum(len(d) - 1 for d in state.devices)
        if actions == "layers":  # a step places a layer or adds a replica
            steps = state.layer + replicas
        else:  # a step opens a stage, adds a replica, ends a stage or chooses its size
            pending = bool(state.starts) and state.starts[-1] == state.layer
            steps = 2 * len(state.starts) - pending + replicas + len(state.sizes)
        assert steps <= 2  # at most 3 random actions, the first chose the count
        starts.add(state)
        again, _ = env.reset(seed=seed)
        assert env.state == state  # drawn with the env's seeded generator
        done = False
        while not done:
            obs, _, done, _, info = env.step(int(np.flatnonzero(obs["action_mask"])[0]))
        info["plan"].validate(env.instance.profile, env.instance.cluster)
    assert len(starts) > 5
    plain.reset(seed=0)
    assert plain.state == initial_state(plain.instance)  # exploring_starts 0: the empty plan


def _rollout(env: PlacementEnv, seed: int) -> tuple[tuple[int, ...], dict[str, Any]]:
    """An episode of uniformly random legal actions; its actions and last info."""
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    done, info = False, dict[str, Any]()
    while not done:
        action = int(rng.choice(np.flatnonzero(obs["action_mask"])))
        obs, _, done, _, info = env.step(action)
    return info["actions"], info


@pytest.mark.parametrize(("actions", "sizes"), [("layers", False), ("stages", True)])
def test_elite_starts_replay_a_proper_prefix_of_an_elite_episode(actions: str, sizes: bool) -> None:
    config = {"profile": chain(6), "cluster": ClusterSpec.load(CLUSTER), "global_batch": 16,
              "microbatches": None, "max_replicas": 2, "actions": actions,
              "stage_sizes": sizes}  # fmt: skip
    elite, info = _rollout(PlacementEnv(config), seed=3)
    assert len(elite) >= 4
    env = PlacementEnv({**config, "elite_starts": 1.0})
    env.reset(seed=0)
    assert env.state == initial_state(env.instance) and env.actions == []  # no elites yet
    env.set_elites({"other-model": [elite]})
    env.reset(seed=0)
    assert env.actions == []  # elites of another profile are not this one's
    env.set_elites({"chain": [elite]})
    prefixes = set()
    for seed in range(30):
        obs, _ = env.reset(seed=seed)
        start = tuple(env.actions)
        assert 1 <= len(start) < len(elite) and start == elite[: len(start)]
        replayed = initial_state(env.instance)
        for a in start:
            replayed = transition(env.instance, replayed, a)
        assert env.state == replayed
        assert obs["action_mask"].tolist() == action_mask(env.instance, replayed).tolist()
        prefixes.add(start)
        done, end = False, dict[str, Any]()
        for a in elite[len(start) :]:  # the elite's own continuation gives the elite's plan
            assert not done
            obs, _, done, _, end = env.step(a)
        assert done and end["actions"] == elite and end["plan"] == info["plan"]
    assert len(prefixes) > len(elite) // 2  # prefix lengths drawn, not one fixed
    env.reset(seed=5)
    first = tuple(env.actions)
    env.reset(seed=5)
    assert tuple(env.actions) == first  # drawn with the env's seeded generator


def test_an_elite_mutation_changes_the_prefix_last_action_to_another_of_its_kind() -> None:
    config = {"profile": chain(8), "cluster": ClusterSpec.load(CLUSTER), "global_batch": 16,
              "microbatches": None, "max_replicas": 2, "actions": "stages",
              "stage_sizes": True, "twin_opens": True}  # fmt: skip
    elite, _ = _rollout(PlacementEnv(config), seed=3)
    env = PlacementEnv({**config, "elite_starts": 1.0, "elite_mutations": 1.0})
    env.set_elites({"chain": [elite]})
    inst, changed = env.instance, 0
    for seed in range(40):
        env.reset(seed=seed)
        start = tuple(env.actions)
        assert 1 <= len(start) < len(elite) and start[:-1] == elite[: len(start) - 1]
        last, was = start[-1], elite[len(start) - 1]
        assert action_kinds(inst, np.array([last])) == action_kinds(inst, np.array([was]))
        changed += last != was  # the same when its kind has no other legal action
        assert not is_terminal(inst, env.state)
        done = False
        while not done:  # the episode goes on to a valid plan
            *_, done, _, info = env.step(int(np.flatnonzero(env.mask)[0]))
        info["plan"].validate(inst.profile, inst.cluster)
    assert changed > 20
    plain = PlacementEnv({**config, "elite_starts": 1.0})
    plain.set_elites({"chain": [elite]})
    plain.reset(seed=0)
    assert tuple(plain.actions) == elite[: len(plain.actions)]  # no mutation by default


def test_an_elite_start_stops_at_an_action_the_mask_forbids() -> None:
    config = {"profile": chain(6), "cluster": ClusterSpec.load(CLUSTER), "global_batch": 16,
              "microbatches": None, "actions": "stages", "elite_starts": 1.0}  # fmt: skip
    env = PlacementEnv(config)
    count = env.instance.count_offset  # choose the first count: legal on the first step
    env.set_elites({"chain": [(count, 10_000, 1, 2)]})  # then an action this env has not
    for seed in range(5):
        obs, _ = env.reset(seed=seed)
        assert env.actions == [count]  # never past the action it could not replay
        done, info = False, dict[str, Any]()
        while not done:
            obs, _, done, _, info = env.step(int(np.flatnonzero(obs["action_mask"])[0]))
        info["plan"].validate(env.instance.profile, env.instance.cluster)


# --- the encoding ---------------------------------------------------------------------------


def test_encoding_is_32_wide_deterministic_and_marks_absent_successors() -> None:
    profile = chain(4)
    enc = encode_profile(profile)
    assert enc.shape == (4, 32) and enc.dtype == np.float32
    assert np.array_equal(enc, encode_profile(profile))
    assert enc[3, 28:].tolist() == pytest.approx([ABSENT] * 4)  # last layer: no successor
    assert enc[0, 28:].tolist() == pytest.approx([0.25, 0.0, ABSENT, ABSENT])  # next: layer 1
    assert enc[:, 16 + 1].tolist() == pytest.approx([0.25] * 4)  # params share
    assert enc[:, 16 + 2].tolist() == pytest.approx([0.0, 0.25, 0.5, 0.75])  # share before
    assert (enc >= -0.1).all() and (enc <= 1.0).all()


def test_op_vectors_are_one_hot_plus_shared_attributes() -> None:
    conv, fc, add = op_vector("conv"), op_vector("fc"), op_vector("add")
    assert conv[:13].sum() == 1 and conv[0] == 1 and conv[13] == 1  # has weights
    assert float(conv @ fc) == 1.0  # alike through "has weights" only
    assert add[14] == 1 and add[15] == 1  # elementwise, joins branches
    assert np.array_equal(op_vector("nonsense"), op_vector("other"))


def test_far_successor_is_the_second_next_layer_number() -> None:
    layers = [
        LayerProfile("a", "conv", 0, 0.0, 0, (1, 2, 3)),
        LayerProfile("b", "relu", 0, 0.0, 0, (3,)),
        LayerProfile("c", "relu", 0, 0.0, 0, (3,)),
        LayerProfile("d", "add", 0, 0.0, 0, ()),
    ]
    enc = encode_profile(ModelProfile("skip", (1,), tuple(layers)))
    assert enc[0, 28:].tolist() == pytest.approx([0.25, 0.0, 0.75, np.log(3) / np.log(4)])
    assert enc[:, 16:28].tolist() == [[0.0] * 12] * 4  # all-zero metrics stay 0
