"""MeasuredReward without a cluster: a measured batch time is scored for the problem's
objective (``measured_value``), bad settings and a missing cluster are refused with what to
do. Runs on a live cluster are in ``tests/service/test_run_cli.py``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeplan.agents import Problem
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.objective import COST_TIE_WEIGHT, Objective
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.measured_reward import MeasuredReward, measured_value
from pipeplan.executor.model import ModelSource

ROOT = Path(__file__).resolve().parents[2]


def cloud() -> ClusterSpec:
    return ClusterSpec.load(ROOT / "examples/clusters/cloud-mix.yaml")


def profile() -> ModelProfile:
    return load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")


def two_devices(cluster: ClusterSpec) -> Plan:
    a, b = cluster.device_ids[0], cluster.device_ids[-1]
    return Plan(32, (Stage((0, 4), (a,), 8), Stage((4, len(profile())), (b,), 8)))


def test_the_time_objective_is_the_measured_batch_time() -> None:
    cluster = cloud()
    p = Problem(profile(), cluster, global_batch=32)
    assert measured_value(p, two_devices(cluster), 0.25) == 0.25


def test_the_cost_objective_is_dollars_per_sample_under_the_floor() -> None:
    cluster = cloud()
    plan = two_devices(cluster)
    price = sum(cluster.device_type(d).price_per_hour for d in plan.devices)
    p = Problem(profile(), cluster, objective=Objective.COST, global_batch=32, min_throughput=100.0)
    want = price * 0.25 / 3600 / 32 + COST_TIE_WEIGHT * 0.25
    assert measured_value(p, plan, 0.25) == pytest.approx(want, rel=1e-12)
    assert math.isinf(measured_value(p, plan, 0.5))  # 64 samples/s: below the floor


def test_bad_settings_are_refused() -> None:
    with pytest.raises(PipeplanError, match="repeats >= 1"):
        MeasuredReward(ModelSource("digits_cnn", 8), cloud(), repeats=0)


def test_without_a_connected_cluster_it_says_what_to_do() -> None:
    assert not runtime.is_connected(), "Ray is connected: a test before this one left it so"
    reward = MeasuredReward(ModelSource("digits_cnn", 8), cloud())
    with pytest.raises(ExecutorError, match="not connected to a Ray cluster"):
        reward.run([two_devices(cloud())])
