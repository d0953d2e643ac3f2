"""Searches use the cluster they run on: with ``address``, or inside a Ray Job (``RAY_ADDRESS``
set, no ``address``), PPO's env runners, the parallel reward's tasks and the measured
reward's stage actors run on that cluster and no private one starts. A measured reward
with ``concurrent`` runs plans on disjoint devices at once there.

One small local cluster (``fast`` on n0, ``mid`` on n1, one logical CPU each) is shared by
the module and started without connecting this process, as a ``ray start`` cluster or a Ray
Job's would be. Every test forbids this process to start a cluster of its own
(:func:`no_private_cluster`), so a search that ran could only have run there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import runtime
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.measured_reward import MeasuredReward, Outcome
from pipeplan.executor.model import ModelSource
from pipeplan.service.tasks.common import RequestError
from pipeplan.service.tasks.live import JOB_ADDRESS_ENV
from pipeplan.service.tasks.plan import PlanRequest, check_plan_fields, plan

HETERO = ClusterSpec.load(Path(__file__).parents[2] / "examples/clusters/local-hetero.yaml")
SMALL = ClusterSpec(
    "small-hetero",
    {t: HETERO.device_types[t] for t in ("fast", "mid")},
    (Node("n0", {"fast": 1}), Node("n1", {"mid": 1})),
    HETERO.network,
)
PPO_TINY = {"iterations": 1, "train_batch": 64, "minibatch": 32, "epochs": 1}
"""One short PPO iteration: 64 steps, so the default caps the env runners at 64 // 32 = 2."""


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with LocalCluster(SMALL, object_store_mb=100, connect=False) as cluster:
        yield cluster.address


@pytest.fixture
def no_private_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a Ray of this process's own, or a local cluster, fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a private Ray cluster was started")

    monkeypatch.setattr(runtime, "start_local", refuse)
    monkeypatch.setattr(LocalCluster, "start", refuse)


def actor_classes(address: str) -> list[str]:
    """The class names of every actor the cluster at ``address`` has known."""
    runtime.connect(address)
    try:
        return [str(a["ActorClassName"]) for a in runtime.actors()]
    finally:
        runtime.shutdown()


def request(**fields: Any) -> PlanRequest:
    base: dict[str, Any] = {"cluster": SMALL.to_dict(), "model": "digits_cnn", "batch": 16}
    return PlanRequest.model_validate(base | fields)


@pytest.mark.ray
@pytest.mark.rllib
@pytest.mark.timeout(240)
def test_ppo_with_address_samples_on_that_cluster_with_its_spare_cpus(  # type: ignore[no-untyped-def]
    address, no_private_cluster
) -> None:
    before = actor_classes(address).count("SingleAgentEnvRunner")
    done = plan(request(planner="ppo", options=PPO_TINY, address=address))
    assert not runtime.is_connected()  # joined for the search, left afterwards
    # two logical CPUs, one kept for the driver: one env runner, an actor of that cluster
    assert done.result.options["num_env_runners"] == 1
    assert actor_classes(address).count("SingleAgentEnvRunner") == before + 1
    assert done.result.evaluations > 0


@pytest.mark.ray
@pytest.mark.rllib
@pytest.mark.timeout(240)
def test_ppo_in_a_ray_job_samples_on_the_jobs_cluster(  # type: ignore[no-untyped-def]
    monkeypatch, address, no_private_cluster
) -> None:
    monkeypatch.setenv(JOB_ADDRESS_ENV, address)
    before = actor_classes(address).count("SingleAgentEnvRunner")
    options = PPO_TINY | {"num_env_runners": 2}  # an explicit count wins over the default
    done = plan(request(planner="ppo", options=options))
    assert not runtime.is_connected()
    assert done.result.options["num_env_runners"] == 2
    assert actor_classes(address).count("SingleAgentEnvRunner") == before + 2


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_parallel_reward_in_a_ray_job_costs_plans_on_the_jobs_cluster(  # type: ignore[no-untyped-def]
    monkeypatch, address, no_private_cluster
) -> None:
    monkeypatch.setenv(JOB_ADDRESS_ENV, address)
    common = {"planner": "genetic", "budget": {"evaluations": 100}}
    parallel = plan(request(**common, reward="parallel", workers=2))
    assert not runtime.is_connected()
    monkeypatch.delenv(JOB_ADDRESS_ENV)
    alone = plan(request(**common))
    assert parallel.result.plan == alone.result.plan
    assert parallel.result.evaluations == alone.result.evaluations > 0
    assert parallel.result.options["reward"] == "parallel"


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_measured_search_in_a_ray_job_runs_its_plans_on_the_jobs_cluster(  # type: ignore[no-untyped-def]
    monkeypatch, address, no_private_cluster
) -> None:
    monkeypatch.setenv(JOB_ADDRESS_ENV, address)
    done = plan(
        request(
            planner="tapp",
            reward="measured",
            options={"iterations": 1, "batch_size": 2},
            budget={"evaluations": 2},
            repeats=1,
            warmup=0,
        )
    )
    assert not runtime.is_connected()
    assert done.measured is not None
    assert done.measured.reward.runs >= 1
    assert actor_classes(address).count("StageWorker") >= 1


def _overlap(a: Outcome, b: Outcome) -> bool:
    return a.started < b.started + b.seconds and b.started < a.started + a.seconds


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_measured_plans_on_disjoint_devices_run_at_once(address, no_private_cluster) -> None:  # type: ignore[no-untyped-def]
    plans = [
        Plan(16, (Stage((0, 8), ("n0/fast:0",), 8),)),
        Plan(16, (Stage((0, 8), ("n1/mid:0",), 8),)),
        Plan(16, (Stage((0, 4), ("n0/fast:0",), 8), Stage((4, 8), ("n1/mid:0",), 8))),
    ]
    source = ModelSource("digits_cnn", 8)
    runtime.connect(address)
    try:
        with MeasuredReward(source, SMALL, repeats=2, warmup=0, concurrent=True) as reward:
            together = reward.run(plans)
            assert reward.pipelines_started == 3
        with MeasuredReward(source, SMALL, repeats=2, warmup=0, concurrent=False) as reward:
            alone = reward.run(plans)
    finally:
        runtime.shutdown()
    assert _overlap(together[0], together[1])  # the first two at once, the third after
    assert not _overlap(together[0], together[2]) and not _overlap(together[1], together[2])
    assert not _overlap(alone[0], alone[1])
    for a, b in zip(together, alone, strict=True):
        assert a.error == b.error == "" and a.measurement and b.measurement
        assert a.plan == b.plan == a.measurement.plan
        assert a.value == a.measurement.batch_time_s > 0
        assert len(a.measurement.batch_times_s) == len(b.measurement.batch_times_s) == 2
        assert a.measurement.to_dict().keys() == b.measurement.to_dict().keys()
        assert [p.node for p in a.measurement.placement] == [
            p.node for p in b.measurement.placement
        ]
    assert [p.node for p in together[2].measurement.placement] == ["n0", "n1"]  # type: ignore[union-attr]


def test_concurrent_goes_with_a_measured_reward_only() -> None:
    with pytest.raises(RequestError, match="concurrent: goes with reward measured, not 'parallel'"):
        check_plan_fields(request(planner="tapp", reward="parallel", workers=2, concurrent=True))
    check_plan_fields(request(planner="tapp", reward="measured", concurrent=False))
