"""Elastic training's pure parts, without Ray: the switch decision, which failures may be
a loss, which nodes joined, the settings' checks, the join check at a checkpoint and the
re-plan after a loss (the live cluster read through a stub), the fold of a plan onto what
is left, the speed factors fitted from measured stage times, and the choice between
``dp``'s plan and the folded one."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from pipeplan.agents.problem import InfeasibleError
from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.costmodel import Estimate, simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.objective import Objective
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.executor import elastic
from pipeplan.executor.config import TrainConfig
from pipeplan.executor.elastic import (
    ElasticConfig,
    ElasticError,
    PlannerReplanner,
    Replanned,
    added_devices,
    choose,
    corrected_profile,
    decide,
    fold_plan,
    may_be_a_loss,
    measured_microbatches,
    measured_stage_s,
    speed_factors,
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

    def estimate(self, plan: Plan, cluster: ClusterSpec) -> Estimate:
        """Only what the choice reads: the step time and that it fits."""
        return cast(Estimate, SimpleNamespace(batch_time_s=self.old_s, fits=True, stages=()))

    def corrected(
        self, factors: object, cluster: ClusterSpec, microbatches: int | None = None
    ) -> FixedReplanner:
        return self


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
    run = a_run(tmp_path)
    seen: list[Replanned] = []
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
    run = a_run(tmp_path)
    seen: list[Replanned] = []
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


# --- the fold, the speed factors and the choice ------------------------------------------

THREE = Plan(
    32,
    (
        Stage((0, 9), ("n0/fast:0",), 8),
        Stage((9, 16), ("n2/slow:0", "n2/slow:1"), 8),
        Stage((16, 21), ("n1/mid:0", "n1/mid:1", "n1/mid:2"), 4),
    ),
    Schedule.ONE_F_ONE_B,
)


def without(spec: ClusterSpec, *devices: str) -> ClusterSpec:
    """``spec`` less ``devices`` (a node left without devices goes too)."""
    nodes = []
    for node in spec.nodes:
        counts = dict(node.devices)
        for d in devices:
            name, rest = d.split("/")
            if name == node.name:
                counts[rest.split(":")[0]] -= 1
        counts = {t: c for t, c in counts.items() if c > 0}
        if counts:
            nodes.append(Node(node.name, counts))
    return dataclasses.replace(spec, nodes=tuple(nodes))


def test_fold_drops_a_lost_replica_and_keeps_cuts_and_microbatches() -> None:
    # n1/mid:2 gone (ids are renumbered per node: the spec left has mid:0 and mid:1).
    left = without(PIPELINE, "n1/mid:2")
    folded = fold_plan(THREE, left)
    assert [s.layers for s in folded.stages] == [(0, 9), (9, 16), (16, 21)]
    assert folded.stages[2].devices == ("n1/mid:0", "n1/mid:1")
    assert [s.microbatch for s in folded.stages] == [8, 8, 4]
    assert folded.schedule is Schedule.ONE_F_ONE_B and folded.global_batch == 32
    folded.validate(PROFILE, left)


def test_fold_merges_a_stage_left_empty_into_the_one_before() -> None:
    left = without(PIPELINE, "n2/slow:0", "n2/slow:1")
    folded = fold_plan(THREE, left)
    assert [(s.layers, s.devices, s.microbatch) for s in folded.stages] == [
        ((0, 16), ("n0/fast:0",), 8),
        ((16, 21), ("n1/mid:0", "n1/mid:1", "n1/mid:2"), 4),
    ]


def test_fold_merges_an_empty_first_stage_into_the_second() -> None:
    left = without(PIPELINE, "n0/fast:0")
    folded = fold_plan(THREE, left)
    assert [(s.layers, s.devices) for s in folded.stages] == [
        ((0, 16), ("n2/slow:0", "n2/slow:1")),
        ((16, 21), ("n1/mid:0", "n1/mid:1", "n1/mid:2")),
    ]
    # The first two gone: the third takes every layer.
    only_mids = fold_plan(THREE, without(left, "n2/slow:0", "n2/slow:1"))
    assert [(s.layers, s.microbatch) for s in only_mids.stages] == [((0, 21), 4)]


def test_fold_with_nothing_of_the_plan_left_names_the_devices() -> None:
    plan = Plan(32, (Stage((0, 21), ("n2/slow:0", "n2/slow:1"), 8),))
    left = without(PIPELINE, "n2/slow:0", "n2/slow:1")
    with pytest.raises(ElasticError, match=r"none of the plan's devices \(n2/slow:0, n2/slow:1\)"):
        fold_plan(plan, left)


def test_speed_factors_are_measured_over_predicted_per_type() -> None:
    """fast measured 2x its prediction; mid 3x and 5x on two stages (median 4); slow not
    measured (a mixed stage, or a zero time, says nothing): left out, so factor 1."""
    plan = Plan(
        32,
        (
            Stage((0, 5), ("n0/fast:0",), 8),
            Stage((5, 9), ("n1/mid:0",), 8),
            Stage((9, 16), ("n1/mid:1",), 8),
            Stage((16, 19), ("n1/mid:2", "n2/slow:0"), 8),
            Stage((19, 21), ("n2/slow:1",), 8),
        ),
    )
    est = simulate(plan, PROFILE, PIPELINE)
    predicted = [s.compute_s for s in est.stages]
    measured = [2 * predicted[0], 3 * predicted[1], 5 * predicted[2], 9 * predicted[3], 0.0]
    factors = speed_factors(plan, measured, est, PIPELINE)
    assert factors == pytest.approx({"fast": 2.0, "mid": 4.0})
    with pytest.raises(PipeplanError, match="measured: 4 stage times"):
        speed_factors(plan, measured[:4], est, PIPELINE)


def test_the_corrected_profile_scales_one_types_compute() -> None:
    """A factor of 2 on fast doubles a fast stage's predicted forward (its compute too but
    for rule 2b's accumulation, which is the update's) and leaves a mid stage's as it was;
    the FLOP fallback of a type without timings is scaled too."""
    plan = Plan(32, (Stage((0, 9), ("n0/fast:0",), 8), Stage((9, 21), ("n1/mid:0",), 8)))
    before = simulate(plan, PROFILE, PIPELINE).stages
    after = simulate(plan, corrected_profile(PROFILE, PIPELINE, {"fast": 2.0}), PIPELINE).stages
    assert after[0].forward_s == pytest.approx(2 * before[0].forward_s)
    assert after[0].compute_s == pytest.approx(2 * before[0].compute_s, rel=1e-3)
    assert after[1].compute_s == pytest.approx(before[1].compute_s)
    analytic = dataclasses.replace(
        PROFILE, layers=tuple(dataclasses.replace(x, timings={}) for x in PROFILE.layers)
    )
    flops = simulate(plan, analytic, PIPELINE).stages[0].forward_s
    scaled = corrected_profile(analytic, PIPELINE, {"fast": 3.0})
    assert simulate(plan, scaled, PIPELINE).stages[0].forward_s == pytest.approx(3 * flops)
    with pytest.raises(PipeplanError, match="speed_factors: 'tpu' is not a device type"):
        corrected_profile(PROFILE, PIPELINE, {"tpu": 2.0})


def test_measured_stage_times_are_medians_without_the_first_step() -> None:
    assert measured_stage_s([]) is None
    assert measured_stage_s([(9.0, 9.0)]) == (9.0, 9.0)
    assert measured_stage_s([(9.0, 9.0), (1.0, 2.0), (3.0, 4.0), (2.0, 3.0)]) == (2.0, 3.0)


@dataclasses.dataclass
class FixedPlanReplanner(PlannerReplanner):
    """``dp`` searching a space without the folded plan: it always answers ``fixed``,
    predicted on its (possibly corrected) profile."""

    fixed: Plan | None = None

    def plan(self, cluster: ClusterSpec) -> tuple[Plan, float]:
        assert self.fixed is not None
        return self.fixed, self.predict(self.fixed, cluster)


ALL_MIDS = Plan(
    32, (Stage((0, 21), ("n1/mid:0", "n1/mid:1", "n1/mid:2"), 8),), Schedule.ONE_F_ONE_B
)


def measured_as(plan: Plan, factors: dict[str, float]) -> list[float]:
    """Stage compute times as if each type ran ``factors`` x its prediction."""
    est = simulate(plan, PROFILE, PIPELINE)
    types = [PIPELINE.device(s.devices[0]).type for s in plan.stages]
    return [e.compute_s * factors.get(t, 1.0) for e, t in zip(est.stages, types, strict=True)]


@pytest.mark.parametrize(
    ("slower", "chosen"),
    [("mid", "folded"), ("fast", "dp")],
)
def test_the_choice_follows_the_measured_speeds(slower: str, chosen: str) -> None:
    """n2 lost; dp answers every layer on the three mids, the fold is fast + mids. Measured
    mids 4x slower than predicted: the folded plan (less on the mids) is predicted faster;
    fast 4x slower: dp's. Both predictions are on the corrected profile."""
    left = without(PIPELINE, "n2/slow:0", "n2/slow:1")
    replanner = FixedPlanReplanner(
        PROFILE, Objective.TIME, 32, Schedule.ONE_F_ONE_B, fixed=ALL_MIDS
    )
    choice = choose(replanner, THREE, left, measured_as(THREE, {slower: 4.0}), PIPELINE)
    assert choice.chosen == chosen
    assert choice.factors == pytest.approx({"fast": 1.0, "mid": 1.0, "slow": 1.0, slower: 4.0})
    corrected = corrected_profile(PROFILE, left, choice.factors)
    folded = fold_plan(THREE, left)
    assert choice.folded_s == pytest.approx(simulate(folded, corrected, left).batch_time_s)
    assert choice.dp_s == pytest.approx(simulate(ALL_MIDS, corrected, left).batch_time_s)
    assert choice.plan == (folded if chosen == "folded" else ALL_MIDS)
    assert choice.predicted_s == min(choice.dp_s, choice.folded_s)


def test_a_corrected_replan_keeps_the_measured_microbatch_count() -> None:
    """The speed factors hold at the microbatch size they were measured at, so ``dp`` on
    the corrected profile plans with the measured plan's count; a plan of mixed sizes
    leaves it free."""
    left = without(PIPELINE, "n2/slow:0", "n2/slow:1")
    replanner = PlannerReplanner(PROFILE, Objective.TIME, 32, Schedule.ONE_F_ONE_B)
    even = Plan(32, tuple(replace(st, microbatch=8) for st in THREE.stages), THREE.schedule)
    assert measured_microbatches(even) == 4 and measured_microbatches(THREE) is None
    choice = choose(replanner, even, left, measured_as(even, {"mid": 20.0}), PIPELINE)
    assert choice.factors and {st.microbatch for st in choice.dp_plan.stages} == {8}


def test_without_measurements_the_real_dp_wins_on_the_profile_as_it_is() -> None:
    """No step measured: no correction; ``dp`` is exact on the profile, so its plan is
    predicted no slower than the fold, and a tie keeps it."""
    left = without(PIPELINE, "n2/slow:0", "n2/slow:1")
    replanner = PlannerReplanner(PROFILE, Objective.TIME, 32, Schedule.ONE_F_ONE_B)
    choice = choose(replanner, THREE, left, None, PIPELINE)
    assert choice.chosen == "dp" and choice.factors == {}
    assert choice.folded_s is not None and choice.dp_s <= choice.folded_s
    assert choice.dp_s == pytest.approx(simulate(choice.plan, PROFILE, left).batch_time_s)


def test_a_loss_records_the_winner_and_both_predictions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n2 lost after steps measured mids 4x slow: the run goes on with the folded plan, and
    the event says so, with both predictions and the factors, in its document and line."""
    left = without(PIPELINE, "n2/slow:0", "n2/slow:1")
    monkeypatch.setattr(elastic, "wait_for_loss", lambda used, known, notice: (("n2",), 0.5))
    monkeypatch.setattr(elastic, "live_spec", lambda reference: left)
    cfg = TrainConfig(steps=20, checkpoint_dir=tmp_path, checkpoint_every=4)
    run = elastic._Run(THREE, PIPELINE, None, cfg, checkpoint=tmp_path / "s4", checkpoint_step=4)
    run.steps = {t: TrainStep(t, 1.0, 0.0, 1.0, 32.0) for t in range(6)}
    times = tuple(measured_as(THREE, {"mid": 4.0}))
    run.stage_times = [tuple(9 * x for x in times), times, times]  # the first: warm-up
    replanner = FixedPlanReplanner(
        PROFILE, Objective.TIME, 32, Schedule.ONE_F_ONE_B, fixed=ALL_MIDS
    )
    seen: list[Replanned] = []
    died = StageFailedError(1, 0, "n2/slow:0", "n2", "step 6: the actor and its node died")
    elastic._after_loss(run, died, PIPELINE, replanner, ElasticConfig(), seen.append)
    (event,) = seen
    assert event.reason == "node_lost" and event.chosen == "folded" and event.switched
    assert run.plan == event.plan == fold_plan(THREE, left) and run.spec == left
    assert event.speed_factors == pytest.approx({"fast": 1.0, "mid": 4.0, "slow": 1.0})
    assert event.folded_predicted_step_s is not None and event.dp_predicted_step_s is not None
    assert event.predicted_step_s == event.folded_predicted_step_s < event.dp_predicted_step_s
    assert event.steps_redone == 2 and run.config.resume == tmp_path / "s4"
    doc = event.to_dict()
    assert doc["chosen"] == "folded" and doc["speed_factors"]["mid"] == pytest.approx(4.0)
    assert doc["dp_predicted_step_s"] == event.dp_predicted_step_s
    assert "folded chosen: dp " in event.text()
