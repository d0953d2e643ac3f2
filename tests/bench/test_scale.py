"""bench.scale: a planner runs in a child process and comes back as ok, failed or timeout;
an instance's ratios to the bound and to the best planner; the index's headline."""

from __future__ import annotations

import pytest
from rich.console import Console

import bench.scale as scale
from bench.index import headline
from pipeplan.agents import Budget, Problem, make_planner
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.plan import Schedule
from pipeplan.models import shapes

QUIET = Console(quiet=True)
SMALL = {"n_layer": 4, "d_model": 128, "n_head": 4, "n_ctx": 64, "vocab_size": 500}


def small_problem(memory_gb: float = 16.0, seconds: float = 5.0) -> Problem:
    profile = shapes.generate("gpt-13b", None, SMALL)
    types = {"a": DeviceType("a", 1e13, memory_gb), "b": DeviceType("b", 4e12, memory_gb)}
    cluster = ClusterSpec("ab", types, (Node("n0", {"a": 2}), Node("n1", {"b": 2})))
    return Problem(profile, cluster, global_batch=16, budget=Budget(None, seconds))


def test_a_planner_answers_from_its_child_as_in_this_process() -> None:
    problem = small_problem()
    doc = scale.run_planner("greedy", problem, 5.0)
    here = make_planner("greedy").plan(problem)
    assert doc["status"] == "ok" and doc["fits"] is True
    assert doc["batch_time_s"] == here.estimate.batch_time_s
    assert doc["devices"] == sum(len(s.devices) for s in here.plan.stages)
    assert doc["stages"] == len(here.plan.stages) and doc["budget_s"] == 5.0


def test_a_refusal_is_recorded_with_its_reason() -> None:
    doc = scale.run_planner("greedy", small_problem(memory_gb=0.001), 5.0)
    assert doc["status"] == "failed"
    assert "memory" in doc["error"] or "fit" in doc["error"]


def test_a_planner_past_its_limit_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale, "limit_s", lambda seconds: 0.5)
    doc = scale.run_planner("genetic", small_problem(seconds=30.0), 30.0)
    assert doc["status"] == "timeout" and doc["error"] == "no answer within 0.5 s (stopped)"


def test_an_instance_has_the_bound_and_the_ratios() -> None:
    p = small_problem()
    doc = scale.measure(p.profile, p.cluster, 16, {"greedy": 5.0, "dp": 5.0}, Schedule.GPIPE, QUIET)
    runs = doc["planners"]
    assert {r["status"] for r in runs.values()} == {"ok"}
    best = min(r["batch_time_s"] for r in runs.values())
    assert doc["best_batch_time_s"] == best
    assert min(r["ratio_to_best"] for r in runs.values()) == 1.0
    for r in runs.values():
        assert r["ratio_to_bound"] == r["batch_time_s"] / doc["bound"]["lower_bound_s"] >= 1
    assert doc["best_ratio_to_bound"] == best / doc["bound"]["lower_bound_s"]
    result = {"instances": [doc, {**doc, "best_ratio_to_bound": None, "planners": {}}]}
    ratio = doc["best_ratio_to_bound"]
    assert headline("scale_quick", result) == (
        f"2 of 2 planner runs answered; best per instance {ratio:.2f}x-{ratio:.2f}x the bound; "
        "1 of 2 instances without a plan"
    )


def test_the_full_sweep_covers_every_model_and_cluster() -> None:
    assert len(scale.FULL.instances) == 15 and set(scale.BATCH) == set(shapes.MODELS)
    assert all(scale.cluster(c).name == c for c in ("dc-64", "dc-328", "dc-1024"))
