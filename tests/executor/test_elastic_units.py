"""Elastic training's pure parts, without Ray: the switch decision, which failures may be
a loss, which nodes joined, the settings' checks, and the join check at a checkpoint (the
live cluster read through a stub)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeplan.agents.problem import InfeasibleError
from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.objective import Objective
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.executor import elastic
from pipeplan.executor.config import TrainConfig
from pipeplan.executor.elastic import (
    ElasticConfig,
    PlannerReplanner,
    Replanned,
    added_devices,
    decide,
    may_be_a_loss,
)
from pipeplan.executor.errors import ExecutorTimeoutError, StageFailedError
from pipeplan.executor.live_cluster import LiveNode
from pipeplan.executor.train import TrainStep

ROOT = Path(__file__).resolve().parents[2]
SPEC = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")
OLD = Plan(8, (Stage((0, 30), ("n1/mid:0",), 8),))
NEW = Plan(8, (Stage((0, 30), ("n0/fast:0",), 8),))


def test_decide_switches_when_the_gain_less_the_switch_cost_clears_the_threshold() -> None:
    # 2 s -> 1 s predicted: gain 0.5; 100 steps of 1 s left, a 10 s switch: 0.1 of them.
    d = decide(2.0, 1.0, 1.0, 100, 10.0, 0.10)
    assert (d.gain, d.remaining_s, d.net_gain, d.switch) == (0.5, 100.0, 0.4, True)
    # The same gain with 12 steps left: the switch costs 10/12 of them.
    late = decide(2.0, 1.0, 1.0, 12, 10.0, 0.10)
    assert late.net_gain == pytest.approx(0.5 - 10 / 12) and not late.switch
    # A gain under the threshold, even for free, is left.
    assert not decide(1.0, 0.95, 1.0, 100, 0.0, 0.10).switch
    # A slower candidate is never taken; nothing left to train neither.
    assert not decide(1.0, 1.5, 1.0, 100, 0.0, 0.0).switch
    assert not decide(2.0, 1.0, 1.0, 0, 0.0, 0.0).switch


def test_only_a_death_a_timeout_or_a_lost_peer_may_be_a_loss() -> None:
    died = StageFailedError(1, 0, "n1/mid:0", "n1", "step 3: the actor and its node died")
    raised = StageFailedError(1, 0, "n1/mid:0", "n1", "operation F0 raised", "ValueError: x")
    peer = StageFailedError(0, 0, "n0/fast:0", "n0", "operation F1 raised", "Connection closed")
    assert may_be_a_loss(died) and may_be_a_loss(peer)
    assert may_be_a_loss(ExecutorTimeoutError("step 3: no answer in time"))
    assert not may_be_a_loss(raised)


def test_added_devices_names_new_nodes_and_nodes_with_more_devices() -> None:
    before = ClusterSpec("c", SPEC.device_types, (Node("n0", {"fast": 1}), Node("n2", {"slow": 1})))
    now = [
        LiveNode("n0", "a", {"fast": 1}, True),
        LiveNode("n1", "b", {"mid": 1}, True),
        LiveNode("n2", "c", {"slow": 2}, True),
    ]
    assert added_devices(before, now) == ("n1", "n2")
    assert added_devices(before, now[:1]) == ()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("replan_threshold", 1.5, r"replan_threshold: must be in \[0, 1\], got 1.5"),
        ("replan_threshold", -0.1, r"replan_threshold: must be in \[0, 1\], got -0.1"),
        ("max_replans", -1, r"max_replans: must be >= 0, got -1"),
        ("notice_s", 0.0, r"notice_s: must be > 0, got 0.0"),
    ],
)
def test_elastic_config_names_the_bad_field(field: str, value: float, message: str) -> None:
    with pytest.raises(PipeplanError, match=message):
        ElasticConfig(**{field: value})  # type: ignore[arg-type]


class FixedReplanner:
    """Predicts from a table; plans ``NEW``."""

    def __init__(self, new_s: float, old_s: float) -> None:
        self.new_s, self.old_s, self.planned = new_s, old_s, 0

    def plan(self, cluster: ClusterSpec) -> tuple[Plan, float]:
        self.planned += 1
        return NEW, self.new_s

    def predict(self, plan: Plan, cluster: ClusterSpec) -> float:
        return self.old_s

    def shortfall(self, cluster: ClusterSpec) -> str:
        return ""


def a_run(tmp_path: Path) -> elastic._Run:
    start = ClusterSpec("c", SPEC.device_types, (Node("n1", {"mid": 1}),))
    cfg = TrainConfig(steps=100, checkpoint_dir=tmp_path, checkpoint_every=5)
    run = elastic._Run(
        OLD, start, 2.0, cfg, checkpoint=tmp_path / "step-00000005", checkpoint_step=5
    )
    run.segment = [TrainStep(t, 1.0, 0.0, 1.0, 8.0) for t in range(5)]
    run.startup_s, run.save_s = 8.0, 2.0
    return run


@pytest.mark.parametrize(("new_s", "switch"), [(1.0, True), (1.9, False)])
def test_a_join_is_decided_and_reported_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_s: float, switch: bool
) -> None:
    """n0 joined: planned on all; switched when 1 - new/old less (8 + 2 s) / 95 s clears
    0.10 (new 1.0 s: 0.5 - 0.105; new 1.9 s: 0.05 - 0.105), reported either way, and the
    same join is not decided again at the next checkpoint."""
    live = [LiveNode("n0", "a", {"fast": 1}, True), LiveNode("n1", "b", {"mid": 1}, True)]
    monkeypatch.setattr(elastic, "live_nodes", lambda: live)
    spec = ClusterSpec("c", SPEC.device_types, (Node("n0", {"fast": 1}), Node("n1", {"mid": 1})))
    monkeypatch.setattr(elastic, "live_spec", lambda reference: spec)
    run, seen = a_run(tmp_path), []
    planner = FixedReplanner(new_s, 2.0)
    assert elastic._joined(run, 5, planner, ElasticConfig(), seen.append) is switch
    (event,) = seen
    assert isinstance(event, Replanned) and event.reason == "node_joined"
    assert event.nodes == ("n0",) and event.switched is switch and event.plan == NEW
    assert event.decision is not None
    assert event.decision.switch_cost_s == 10.0 and event.decision.remaining_s == 95.0
    assert run.plan == (NEW if switch else OLD)
    assert run.config.resume == (tmp_path / "step-00000005" if switch else None)
    assert elastic._joined(run, 10, planner, ElasticConfig(), seen.append) is False
    assert len(seen) == 1 and planner.planned == 1
    doc = event.to_dict()
    assert doc["reason"] == "node_joined" and doc["switched"] is switch
    assert doc["net_gain"] == pytest.approx(event.decision.net_gain)


def test_joins_are_not_watched_when_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(elastic, "live_nodes", lambda: pytest.fail("read the cluster"))
    run = a_run(tmp_path)
    off = ElasticConfig(watch_joins=False)
    assert elastic._joined(run, 5, FixedReplanner(1.0, 2.0), off, None) is False


PROFILE = ModelProfile.load(ROOT / "tests/data/alexnet224_local_pipeline.profile.json")
PIPELINE = ClusterSpec.load(ROOT / "examples/clusters/local-pipeline.yaml")


def test_the_replanner_plans_on_what_is_left_and_says_what_is_missing() -> None:
    """dp on local-pipeline without n1: a plan on n0 and n2 only, its prediction the cost
    model's; on devices of 0.5 GB, no plan, and the shortfall in gigabytes."""
    left = dataclasses.replace(PIPELINE, nodes=(PIPELINE.nodes[0], PIPELINE.nodes[2]))
    planner = PlannerReplanner(PROFILE, Objective.TIME, 32, Schedule.ONE_F_ONE_B)
    plan, predicted = planner.plan(left)
    assert {d.split("/")[0] for d in plan.devices} <= {"n0", "n2"}
    assert plan.schedule is Schedule.ONE_F_ONE_B and plan.global_batch == 32
    assert predicted == pytest.approx(simulate(plan, PROFILE, left).batch_time_s)
    assert planner.predict(plan, left) == pytest.approx(predicted)
    assert planner.shortfall(left) == ""
    tiny = {t: dataclasses.replace(d, memory_gb=0.05) for t, d in left.device_types.items()}
    small = dataclasses.replace(left, device_types=tiny)
    with pytest.raises(InfeasibleError):
        planner.plan(small)
    need = 4 * sum(layer.params_bytes for layer in PROFILE.layers) / 1e9
    assert planner.shortfall(small) == (
        f"the model's weights, gradients and optimizer state need {need:.3g} GB, the devices "
        f"left hold {0.15:.3g} GB ({need - 0.15:.3g} GB missing)"
    )


def test_a_timeout_with_every_node_there_is_not_a_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's timeout passed but Ray still lists the plan's node: the error ends the run
    as it is (no re-plan, no event); an actor that died there resumes on the same plan."""
    monkeypatch.setattr(elastic, "live_nodes", lambda: [LiveNode("n1", "b", {"mid": 1}, True)])
    run, seen = a_run(tmp_path), []
    timeout = ExecutorTimeoutError("step 7: no answer in time")
    fast = ElasticConfig(notice_s=0.01)
    with pytest.raises(ExecutorTimeoutError, match="step 7"):
        elastic._after_loss(run, timeout, SPEC, FixedReplanner(1.0, 2.0), fast, seen.append)
    assert seen == []
    died = StageFailedError(0, 0, "n1/mid:0", "n1", "step 7: the actor died (ActorDiedError)")
    run.predicted = None  # not predicted yet: the profile is made when first needed
    elastic._after_loss(run, died, SPEC, FixedReplanner(1.0, 2.0), fast, seen.append)
    (event,) = seen
    assert event.reason == "actor_lost" and not event.switched and run.plan == OLD
    assert event.predicted_step_s == event.previous_predicted_step_s == 2.0
    assert run.config.resume == tmp_path / "step-00000005" and event.step == 5
