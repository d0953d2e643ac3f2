"""Failures on a small 2-node cluster of its own: a worker's exception comes back once with
its traceback; a node removed mid-run ends the run with an error naming stage, device and
node, and leaves no actor alive. Also runs :func:`executor.pipeline.run` end to end, and a
plan on PyTorch's pipeline schedules (``engine="torch-pipelining"``) against single-process
training."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.executor.data import digits_batches
from pipeplan.executor.errors import StageFailedError
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.model import ModelSource, OptimizerConfig, train_single_process
from pipeplan.executor.pipeline import Pipeline, RunConfig, run
from pipeplan.executor.reservation import PREFIX, Claimant, Waiting, claiming, owner_of
from tests.executor.actors import stage_workers_alive, wait_no_workers

pytestmark = pytest.mark.ray

HETERO = ClusterSpec.load(Path(__file__).parents[2] / "examples/clusters/local-hetero.yaml")
SPEC = ClusterSpec(
    "mini",
    {t: HETERO.device_types[t] for t in ("fast", "slow")},
    (Node("n0", {"fast": 1}), Node("n1", {"slow": 1})),
)
DIGITS = ModelSource("digits_cnn", 8, seed=0)
PLAN = Plan(16, (Stage((0, 3), ("n0/fast:0",), 8), Stage((3, 8), ("n1/slow:0",), 4)))


@pytest.mark.timeout(200)
def test_run_measures_a_plan(cluster: LocalCluster) -> None:
    m = run(PLAN, DIGITS, SPEC, RunConfig(steps=2, warmup=1, data="digits", timeout_s=60))
    assert m.emulated and len(m.losses) == 3 and m.steps == 2
    assert [p.node for p in m.placement] == ["n0", "n1"]
    assert wait_no_workers() == 0


@pytest.mark.timeout(120)
def test_worker_exception_comes_back_with_its_traceback(cluster: LocalCluster) -> None:
    config = RunConfig(emulate=False, timeout_s=60)
    with Pipeline(PLAN, DIGITS, SPEC, config) as pipe:
        x = torch.zeros(16, 1, 8, 8)
        bad_labels = torch.full((16,), 99)  # class 99 of 10: cross_entropy raises in stage 1
        with pytest.raises(StageFailedError) as err:
            pipe.step(x, bad_labels)
        # The run ended with its first error (its actors are gone): the next step says so.
        with pytest.raises(StageFailedError) as again:
            pipe.step(x, torch.zeros(16, dtype=torch.long))
    assert "cross_entropy" in again.value.traceback and again.value.stage == 1
    e = err.value
    assert (e.stage, e.replica, e.device, e.node) == (1, 0, "n1/slow:0", "n1")
    assert "operation F0 raised" in str(e) and "Traceback" in e.traceback
    assert "cross_entropy" in e.traceback
    assert wait_no_workers() == 0


@pytest.mark.timeout(150)
def test_torch_pipelining_trains_as_one_process_and_refuses_what_it_cannot_run(
    cluster: LocalCluster,
) -> None:
    optimizer = OptimizerConfig(lr=0.05, momentum=0.9)
    config = RunConfig(
        emulate=False, deterministic=True, optimizer=optimizer, engine="torch-pipelining"
    )
    with pytest.raises(PlanError, match=r"torch-pipelining cannot run this plan: unequal"):
        Pipeline(PLAN, DIGITS, SPEC, config).start()  # refused before any actor starts
    assert stage_workers_alive() == 0
    plan = Plan(16, (Stage((0, 3), ("n0/fast:0",), 4), PLAN.stages[1]), Schedule.ONE_F_ONE_B)
    batches = digits_batches(DIGITS.build()[1], 16, 3, seed=4)
    with Pipeline(plan, DIGITS, SPEC, config) as pipe:
        results = [pipe.step(x, y) for x, y in batches]
        params = pipe.parameters()
    ref = train_single_process(DIGITS, batches, optimizer, deterministic=True)
    for got, want in zip(results, ref.losses, strict=True):
        assert got.loss == pytest.approx(want, abs=1e-5)
    assert max(float((params[n] - ref.parameters[n]).abs().max()) for n in params) < 1e-5
    assert wait_no_workers() == 0


@pytest.mark.timeout(150)
def test_a_killed_stage_actor_ends_the_run_at_once_naming_it(cluster: LocalCluster) -> None:
    """Its neighbour waits on a receive that will never come; the driver does not wait for the
    process group's timeout (60 s here): the dead actor's step fails at once, and the run's
    other actors are killed with it."""

    config = RunConfig(emulate=False, timeout_s=60)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(10, (16,))
    with Pipeline(PLAN, DIGITS, SPEC, config) as pipe:
        pipe.step(x, y)
        killer = threading.Timer(0.3, ray.kill, args=(pipe.workers[1][0].actor,))
        killer.start()
        started = time.monotonic()
        try:
            with pytest.raises(StageFailedError) as err:
                while time.monotonic() - started < 60:
                    pipe.step(x, y)
        finally:
            killer.join()
        took = time.monotonic() - started
    e = err.value
    assert (e.stage, e.device, e.node) == (1, "n1/slow:0", "n1") and "died" in str(e)
    assert took < 30, f"the run took {took:.0f} s to end"
    assert wait_no_workers() == 0


@pytest.mark.timeout(150)
def test_node_removed_mid_run_names_stage_device_node(cluster: LocalCluster) -> None:
    config = RunConfig(emulate=True, timeout_s=60)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(10, (16,))
    started = time.monotonic()
    killer_started: list[float] = []

    def remove_n1() -> None:
        killer_started.append(time.monotonic())
        cluster.remove_node("n1")

    with pytest.raises(StageFailedError) as err, Pipeline(PLAN, DIGITS, SPEC, config) as pipe:
        pipe.step(x, y)
        killer = threading.Timer(0.5, remove_n1)
        killer.start()
        try:
            while time.monotonic() - started < 100:
                pipe.step(x, y)
        finally:
            killer.join()
    e = err.value
    print(str(e)[:700])
    assert time.monotonic() - killer_started[0] < 30, "the run took 30 s or more to end"
    assert (e.stage, e.device, e.node) == (1, "n1/slow:0", "n1")
    assert "died" in str(e) and "stage 1 replica 0 on device n1/slow:0 (node n1)" in str(e)
    assert wait_no_workers() == 0


@pytest.mark.timeout(240)
def test_a_run_on_held_devices_waits_for_them_and_says_who_holds_them(
    cluster: LocalCluster,
) -> None:
    """Each run reserves its devices as one placement group: a second run on the same
    devices waits (naming the first's owner) and starts once the first closes; no group
    is left after either. (On node n0 alone: a test above removes n1.)"""
    plan = Plan(16, (Stage((0, 8), ("n0/fast:0",), 8),))
    config = RunConfig(emulate=False, timeout_s=60)
    seen: list[Waiting] = []
    done: dict[str, object] = {}

    def second() -> None:
        who = Claimant("job-b", None, seen.append, lambda s: done.setdefault("waited_s", s))
        with claiming(who), Pipeline(plan, DIGITS, SPEC, config) as pipe:
            done["placement"] = pipe.placement

    first = Pipeline(plan, DIGITS, SPEC, config)
    with claiming(Claimant("job-a")):
        first.start()
    waiter = threading.Thread(target=second)
    try:
        held = {owner_of(name) for name, state in _pipeplan_groups().items() if state != "REMOVED"}
        assert held == {"job-a"}
        waiter.start()
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            time.sleep(0.2)
        assert seen and seen[0].held_by == ("job-a",), seen
        assert seen[0].devices == ("n0/fast:0",)
        assert "placement" not in done and waiter.is_alive()
    finally:
        first.close()
    waiter.join(timeout=120)
    assert not waiter.is_alive() and "placement" in done
    assert float(done["waited_s"]) > 0  # type: ignore[arg-type]
    assert set(_pipeplan_groups().values()) <= {"REMOVED"}
    assert wait_no_workers() == 0


def _pipeplan_groups() -> dict[str, str]:
    """Name -> state of every pipeplan placement group Ray knows."""
    return {
        str(g["name"]): str(g["state"])
        for g in placement_group_table().values()
        if str(g.get("name", "")).startswith(PREFIX)
    }
