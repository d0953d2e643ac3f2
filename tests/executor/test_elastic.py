"""Elastic training on real local Ray clusters: a worker node killed mid-run (GPipe and
1F1B, the last stage replicated) re-plans on what is left, choosing between ``dp``'s plan
and the folded one on the profile the run's measurements corrected, and ends with the
weights of single-process training of the same steps; a node that joins is put to use at
the next checkpoint when the gain pays for the switch.

The loss tests share one cluster of local-hetero's nodes (:func:`hetero`: the nodes a test
removed are started again before the next); the join test needs a cluster of another shape,
so it stops the shared one first and starts its own.

The model is a 2-layer GPT without dropout, trained with SGD and momentum (the momentum
buffers are re-sharded with the weights); the reference trains it in this process."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.objective import Objective
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.executor import checkpoint
from pipeplan.executor.data import synthetic_batches
from pipeplan.executor.elastic import (
    ElasticConfig,
    ElasticError,
    PlannerReplanner,
    Replanned,
    elastic_train,
)
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.model import ModelSource, OptimizerConfig, train_single_process
from pipeplan.executor.train import TrainConfig, TrainStep
from pipeplan.models import profiler
from tests.executor.actors import wait_no_workers
from tests.executor.train_plans import BATCH, three_stages

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
SPEC = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")
GPT = {"n_layer": 2, "d_model": 32, "n_head": 2, "n_ctx": 8, "vocab_size": 50, "dropout": 0.0}
MODEL = ModelSource("gpt", 8, seed=2, options=GPT)
SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9)


def config(steps: int, folder: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = {
        "steps": steps,
        "optimizer": SGD,
        "seed": 5,
        "checkpoint_dir": folder,
        "checkpoint_every": 2,
        "emulate": False,
        "deterministic": True,
        "timeout_s": 60,
        "start_timeout_s": 150,
    }
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


_SHARED: list[LocalCluster] = []
"""The running shared cluster, if any."""


def stop_shared() -> None:
    while _SHARED:
        _SHARED.pop().stop()


@pytest.fixture(scope="module", autouse=True)
def _stop_shared_at_the_end() -> Iterator[None]:
    yield
    stop_shared()


@pytest.fixture
def hetero() -> LocalCluster:
    """The shared cluster of ``SPEC``'s nodes, every one of them running (a node the test
    before removed is started again)."""
    if not _SHARED:
        cluster = LocalCluster(SPEC, object_store_mb=100, keep_awake=False)
        cluster.start()
        _SHARED.append(cluster)
    cluster = _SHARED[0]
    for node in SPEC.nodes:
        if node.name not in cluster.node_names:
            cluster.add_node(node)
    return cluster


def replanner(schedule: Schedule) -> PlannerReplanner:
    built, example = MODEL.build()
    prof = profiler.profile_model(built, example, name="gpt", device_type=None)
    return PlannerReplanner(prof, Objective.TIME, BATCH, schedule)


def assert_single_process_weights(folder: Path, steps: int, tmp: Path) -> None:
    model, example = MODEL.build()
    model.eval()
    with torch.no_grad():
        out_shape = tuple(model(example).shape)
    batches = synthetic_batches(example, out_shape, BATCH, steps, seed=5)
    ref = train_single_process(MODEL, batches, SGD, deterministic=True)
    got = checkpoint.export_state_dict(folder, tmp / f"export-{time.monotonic_ns()}.pt")
    for name, want in ref.parameters.items():
        assert torch.allclose(got[name], want, atol=1e-5), name


@pytest.mark.timeout(420)
@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_a_lost_node_replans_and_ends_with_the_same_weights(
    schedule: Schedule, tmp_path: Path, hetero: LocalCluster
) -> None:
    """n1 is killed once 3 steps are trained (checkpoint at 2): the run notices, plans on
    n0 and n2 (``dp``'s plan or the folded one, on the profile corrected by the 3 steps'
    stage times: a factor for each of the plan's types), trains step 3 again from the
    checkpoint, and reaches 6 steps with single-process training's weights."""
    folder = tmp_path / "ck"
    events: list[Replanned] = []
    cluster = hetero

    def kill_n1_after_step_3(step: TrainStep) -> None:
        if step.step == 2 and "n1" in cluster.node_names:
            cluster.remove_node("n1")  # the driver's next step finds it gone

    done = elastic_train(
        three_stages(schedule),
        MODEL,
        SPEC,
        config(6, folder),
        replanner(schedule),
        ElasticConfig(),
        on_step=kill_n1_after_step_3,
        on_replan=events.append,
    )
    assert wait_no_workers() == 0
    (event,) = events
    assert event.reason == "node_lost" and event.nodes == ("n1",) and event.switched
    assert event.step == 2 and event.steps_redone == 1
    assert event.noticed_s < 30 and event.predicted_step_s > 0
    assert set(event.speed_factors) == {"fast", "mid", "slow"}, event.to_dict()
    assert all(f > 0 for f in event.speed_factors.values())
    dp_s, folded_s = event.dp_predicted_step_s, event.folded_predicted_step_s
    assert dp_s is not None and folded_s is not None
    assert event.predicted_step_s == min(dp_s, folded_s)
    assert event.chosen == ("folded" if folded_s < dp_s else "dp")
    assert "n1" not in {d.split("/")[0] for d in event.plan.devices}
    assert event.plan.schedule is schedule
    assert [s.step for s in done.result.steps] == list(range(6))
    assert done.plans == (three_stages(schedule), event.plan)
    assert checkpoint.read_manifest(checkpoint.resolve(folder)).step == 6
    assert_single_process_weights(folder, 6, tmp_path)


@pytest.mark.timeout(300)
def test_what_is_left_cannot_hold_the_model_names_what_is_missing(
    tmp_path: Path, hetero: LocalCluster
) -> None:
    """The model's state is made to need more memory than n0 alone holds (the spec given
    says so; the cluster's nodes are the same): losing n1 and n2 ends the run with an error
    naming the nodes and the gigabytes missing."""
    plan = Plan(BATCH, (Stage((0, 15), ("n0/fast:0",), 8), Stage((15, 30), ("n1/mid:0",), 8)))
    planner = replanner(Schedule.GPIPE)
    need = 4 * sum(layer.params_bytes for layer in planner._profile().layers)
    tight = {
        t: dataclasses.replace(d, memory_gb=need / 1e9 * 0.6) for t, d in SPEC.device_types.items()
    }
    spec = dataclasses.replace(SPEC, device_types=tight)
    cluster = hetero

    def kill_after_step_1(step: TrainStep) -> None:
        if step.step == 0:
            cluster.remove_node("n1")
            cluster.remove_node("n2")

    with pytest.raises(ElasticError, match=r"node\(s\) n1, n2 lost at step 1") as err:
        elastic_train(
            plan, MODEL, spec, config(3, tmp_path / "ck"), planner,
            on_step=kill_after_step_1,
        )  # fmt: skip
    assert wait_no_workers() == 0
    assert "GB missing" in str(err.value) and "n0" in str(err.value)


CRAWL = dataclasses.replace(SPEC.device_types["slow"], name="crawl", flops=1.0e8)
"""A device type 400x slower than fast: emulated 1000x this core, so that the steps left
on it last long enough for a switch (deploying and restoring take seconds on a busy
machine) to pay off."""
JOINING = ClusterSpec(
    "joining",
    {"fast": SPEC.device_types["fast"], "mid": SPEC.device_types["mid"], "crawl": CRAWL},
    (SPEC.nodes[0], SPEC.nodes[1], Node("n2", {"crawl": 1})),
    SPEC.network,
    2.5,
)


@pytest.mark.timeout(420)
def test_a_joined_node_is_put_to_use_at_the_next_checkpoint(tmp_path: Path) -> None:
    """Training on n2's crawling device while n0 (fast) joins after the first step: at
    the checkpoint of step 2 the run plans on all, finds the plan on n0 faster by far,
    switches (threshold 0: any net gain), and ends with single-process training's
    weights."""
    start = dataclasses.replace(JOINING, nodes=JOINING.nodes[1:])
    plan = Plan(BATCH, (Stage((0, 30), ("n2/crawl:0",), 8),))
    folder = tmp_path / "ck"
    events: list[Replanned] = []
    stop_shared()  # one Ray cluster per process
    with LocalCluster(start, object_store_mb=100, keep_awake=False) as cluster:

        def join_n0_after_step_1(step: TrainStep) -> None:
            if step.step == 0:
                cluster.add_node(JOINING.nodes[0])

        done = elastic_train(
            plan,
            MODEL,
            JOINING,
            config(30, folder, checkpoint_every=2, emulate=True),
            replanner(Schedule.GPIPE),
            ElasticConfig(replan_threshold=0.0),
            on_step=join_n0_after_step_1,
            on_replan=events.append,
        )
        assert wait_no_workers() == 0
    (event,) = events
    assert event.reason == "node_joined" and event.nodes == ("n0",) and event.step == 2
    assert event.decision is not None and event.decision.gain > 0.5
    assert event.switched, event.to_dict()
    assert event.plan.devices == ("n0/fast:0",) and done.plan == event.plan
    assert [s.step for s in done.result.steps] == list(range(30))
    assert_single_process_weights(folder, 30, tmp_path)
