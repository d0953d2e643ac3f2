"""MeasuredReward with ``concurrent``: new plans grouped into sets of pairwise disjoint
devices (first fit, in order), each set's plans run at once, the answer the same as one at
a time. Here the runs are faked (no cluster); a live run is in
``tests/service/test_cluster_use.py``."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest

from pipeplan.agents import Problem
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.measure import Measurement
from pipeplan.executor.measured_reward import (
    MeasuredReward,
    Outcome,
    concurrent_default,
    disjoint_groups,
)
from pipeplan.executor.model import ModelSource

ROOT = Path(__file__).resolve().parents[2]
GATE_S = 30.0
"""How long a fake run waits for the others of its set (reached only when they never come)."""


def test_groups_are_first_fit_and_pairwise_disjoint() -> None:
    sets = [
        frozenset({"a", "b"}),
        frozenset({"b"}),
        frozenset({"c"}),
        frozenset(),  # screened out: no devices, joins the first group
        frozenset({"a", "c"}),
        frozenset({"d"}),
    ]
    assert disjoint_groups(sets) == [[0, 2, 3, 5], [1, 4]]
    assert disjoint_groups([]) == []


def test_groups_never_share_a_device_and_keep_every_plan_once() -> None:
    sets = [frozenset({f"d{(i * 7 + k) % 5}" for k in range(i % 3 + 1)}) for i in range(20)]
    groups = disjoint_groups(sets)
    assert sorted(i for g in groups for i in g) == list(range(20))
    for g in groups:
        assert g == sorted(g)
        seen: set[str] = set()
        for i in g:
            assert seen.isdisjoint(sets[i])
            seen |= sets[i]


def test_concurrency_is_off_by_default_on_an_emulated_spec_only() -> None:
    hetero = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")
    assert concurrent_default(hetero) is False
    assert concurrent_default(_cluster()) is True
    assert MeasuredReward(ModelSource("digits_cnn", 8), hetero).concurrent is False
    assert MeasuredReward(ModelSource("digits_cnn", 8), hetero, concurrent=True).concurrent


def _cluster() -> ClusterSpec:
    cpu = DeviceType("cpu", flops=1e9, memory_gb=1)
    return ClusterSpec("four", {"cpu": cpu}, (Node("n", {"cpu": 4}),))


def _problem() -> Problem:
    timing = {"cpu": LayerTiming(1e-3, 2e-3)}
    layers = (
        LayerProfile("l0", "fc", 400, 10.0, 4, (1,), timing),
        LayerProfile("l1", "fc", 400, 10.0, 4, (), timing),
    )
    return Problem(ModelProfile("m", (4,), layers), _cluster(), global_batch=8)


def _plan(*devices: str, microbatch: int = 8) -> Plan:
    return Plan(8, (Stage((0, 2), devices, microbatch),))


def _fake(plan: Plan, seconds: float) -> Measurement:
    return Measurement(
        plan, 1, 0, (seconds,), seconds, 0.0, seconds, seconds, 8 / seconds, 0.0, (), (), (),
        False, (),
    )  # fmt: skip


class FakeRuns:
    """Stands in for ``MeasuredReward._measure``: records how many runs were in at once and
    when each ended; the plans in ``failing`` fail. A run waits (at most :data:`GATE_S`)
    until ``together`` runs have been in at once, so that runs started together are seen
    together however slowly their threads start; runs one at a time (``together`` 1) never
    wait."""

    def __init__(self, failing: tuple[Plan, ...] = (), together: int = 1) -> None:
        self.failing = failing
        self.together = together
        self.gate = threading.Condition()
        self.now = 0
        self.most = 0
        self.ended: dict[Plan, float] = {}

    def __call__(self, plan: Plan) -> Measurement:
        with self.gate:
            self.now += 1
            self.most = max(self.most, self.now)
            self.gate.notify_all()
            self.gate.wait_for(lambda: self.most >= self.together, timeout=GATE_S)
            self.now -= 1
            self.ended[plan] = time.time()
        if plan in self.failing:
            raise ExecutorError(f"stage 0 on {plan.devices[0]}: lost")
        return _fake(plan, 0.1 * len(plan.devices))


def _evaluate(
    monkeypatch: pytest.MonkeyPatch,
    plans: list[Plan],
    concurrent: bool,
    failing: tuple = (),
    together: int = 1,
) -> tuple[list[Outcome], list[Plan], FakeRuns]:
    monkeypatch.setattr(runtime, "is_connected", lambda: True)
    runs = FakeRuns(failing, together)
    seen: list[Plan] = []
    source = MeasuredReward(
        ModelSource("digits_cnn", 8),
        _cluster(),
        repeats=1,
        concurrent=concurrent,
        on_outcome=lambda o: seen.append(o.plan),
    )
    monkeypatch.setattr(source, "_measure", runs)
    outcomes = source.run(plans, _problem())
    return outcomes, seen, runs


PLANS = [
    _plan("n/cpu:0"),
    _plan("n/cpu:0", "n/cpu:1"),  # overlaps the first: the next set
    _plan("n/cpu:2"),
    _plan("n/cpu:3", "n/cpu:1", microbatch=1),  # 1 sample for 2 replicas: screened, no run
    _plan("n/cpu:3"),
    _plan("n/cpu:0"),  # the first again: cached
]


def test_disjoint_plans_run_at_once_with_the_answer_of_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alone, seen_alone, runs_alone = _evaluate(monkeypatch, PLANS, concurrent=False)
    together, seen_together, runs = _evaluate(monkeypatch, PLANS, concurrent=True, together=3)
    assert runs_alone.most == 1 and runs.most == 3  # {0, 2, 4} at once, then {1}
    assert [(o.plan, o.value, o.error) for o in together] == [
        (o.plan, o.value, o.error) for o in alone
    ]
    assert [o.value for o in together] == [0.1, 0.2, 0.1, math.inf, 0.1, 0.1]
    assert "replicas" in together[3].error and together[3].measurement is None
    assert seen_alone == PLANS[:5]
    assert seen_together == [PLANS[i] for i in (0, 2, 3, 4, 1)]  # set by set
    first = [PLANS[i] for i in (0, 2, 4)]
    # they overlapped: each began before any of them ended (and the next set after them)
    assert max(together[i].started for i in (0, 2, 4)) <= min(runs.ended[p] for p in first)
    assert together[1].started >= max(runs.ended[p] for p in first)


def test_failures_in_a_row_are_counted_in_order_within_a_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plans = [_plan("n/cpu:0"), _plan("n/cpu:1"), _plan("n/cpu:2")]
    outcomes, _, _ = _evaluate(monkeypatch, plans, True, tuple(plans[:2]), together=3)
    assert [o.value for o in outcomes] == [math.inf, math.inf, 0.1]
    assert outcomes[0].error == "stage 0 on n/cpu:0: lost"
    with pytest.raises(ExecutorError, match="3 plans failed in a row; last: stage 0 on n/cpu:2"):
        _evaluate(monkeypatch, plans, True, tuple(plans), together=3)
