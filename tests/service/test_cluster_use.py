"""Searches use the cluster they run on: with ``address``, or inside a Ray Job (``RAY_ADDRESS``
set, no ``address``), PPO's env runners, the parallel reward's tasks and the measured
reward's stage actors run on that cluster and no private one starts.

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

from core.cluster import ClusterSpec, Node
from executor import runtime
from executor.local_cluster import LocalCluster
from service.tasks.live import JOB_ADDRESS_ENV
from service.tasks.plan import PlanRequest, plan

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
