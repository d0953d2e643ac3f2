"""The placement MDP: gymnasium's checker, masks that never allow an invalid plan, rewards,
and the TAPP layer encoding."""

from __future__ import annotations

import warnings
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs
from core.cluster import ClusterSpec, DeviceType, Node
from core.costmodel import simulate
from core.profile import LayerProfile, ModelProfile
from envs.encoding import ABSENT, WIDTH, encode_profile, op_vector
from envs.placement import (
    EnvConfigError,
    PlacementEnv,
    action_mask,
    initial_state,
    make_instance,
    memory_mask,
    structural_mask,
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


def test_check_env_passes_without_warnings(tmp_path: Path) -> None:
    profile = tmp_path / "chain.json"
    chain(6).save(profile)
    config = {"profile": str(profile), "cluster": str(CLUSTER), "global_batch": 16}
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
    assert obs_space["observations"].shape == (WIDTH * 3 + 5 * 5 + 6,)
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
    # reference: all 4 layers on one device, 8 samples, fwd 1 GFLOP/1 TFLOP/s, bwd twice that
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
    s = transition(initial_state(), 1)
    assert action_mask(inst, s)[0] == 0  # 2 layers left, 2 stages still needed
    s = transition(s, 2)
    assert action_mask(inst, s)[0] == 0
    s = transition(s, 3)
    assert action_mask(inst, s).tolist() == [1, 0, 0, 0, 0, 0]  # terminal


def test_memory_mask_keeps_stages_within_memory() -> None:
    # 1 GB per layer of weights (x4 = 4 GB): two layers do not fit a 6 GB device
    inst = make_instance(chain(3, params=10**9, act=0), two_devices(6.0))
    s = transition(initial_state(), 1)
    assert memory_mask(inst, s).tolist() == [False, True, True]
    assert action_mask(inst, s).tolist() == [0, 0, 1]
    s = transition(s, 2)
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
        ({"objective": "speed"}, "objective"),
        ({"max_stages": 9}, "max_stages"),
        ({"colour": 1}, "unknown key 'colour'"),
        ({"profile": []}, "empty"),
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
    m=st.sampled_from([1, 2, 4]),
    data=st.data(),
)
def test_random_masked_rollouts_give_valid_plans(
    profile: ModelProfile, cluster: ClusterSpec, schedule: str, m: int, data: st.DataObject
) -> None:
    n_dev = len(cluster.device_ids)
    top = data.draw(st.integers(1, n_dev))
    low = data.draw(st.integers(1, min(top, len(profile))))
    env = PlacementEnv(
        {"profile": profile, "cluster": cluster, "global_batch": 8, "microbatches": m,
         "schedule": schedule, "min_stages": low, "max_stages": top}
    )  # fmt: skip
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    obs, _ = env.reset(seed=0)
    fell_back, done, info = False, False, {}
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
    if not fell_back and schedule == "gpipe":
        assert info["estimate"].fits  # the memory mask is exact for GPipe


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
