"""bench.scheduler's figures (no Ray): the devices held over time from the jobs' intervals,
the bound, the percentiles, when a job's devices were released, which jobs waited, and the
draw of the jobs."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bench.scheduler import (
    LAYERS,
    assign_devices,
    bound,
    busy_area,
    draw_jobs,
    percentiles,
    plan_devices,
    plan_doc,
    released_before,
    summarise,
    timeline,
    waited,
)
from pipeplan.core.plan import Plan

DEVICES = ["n0/fast:0", "n1/mid:0", "n1/mid:1", "n1/mid:2", "n2/slow:0", "n2/slow:1"]


def test_timeline_is_a_step_function_of_the_devices_held() -> None:
    times, held = timeline([(0.0, 10.0, 2), (5.0, 15.0, 3), (10.0, 12.0, 1)])
    assert times == [0.0, 5.0, 10.0, 12.0, 15.0]
    assert held == [2, 5, 4, 3, 0]  # at 10 one job ends as another starts: 5 - 2 + 1
    assert busy_area(times, held) == 2 * 5 + 5 * 5 + 4 * 2 + 3 * 3
    assert timeline([]) == ([], [])


def test_the_bound_is_the_device_seconds_over_the_devices() -> None:
    intervals = [(0.0, 10.0, 2), (5.0, 15.0, 3), (10.0, 12.0, 1)]
    assert bound(intervals, 6) == pytest.approx((20 + 30 + 2) / 6)
    times, held = timeline(intervals)
    assert busy_area(times, held) == pytest.approx(bound(intervals, 1))


def test_percentiles() -> None:
    got = percentiles([float(x) for x in range(1, 101)])
    assert got["p50_s"] == pytest.approx(50.5)
    assert got["p99_s"] == pytest.approx(99.01)
    assert got["max_s"] == 100.0 and got["n"] == 100
    assert percentiles([]) == {"p50_s": None, "p99_s": None, "max_s": None, "n": 0}


def job(submit: float, start: float, end: float, devices: list[str], **kw: Any) -> dict[str, Any]:
    return {"submit": submit, "start": start, "end": end, "devices": devices, "held": devices} | kw


def test_released_before_is_the_last_end_on_a_shared_device_before_the_start() -> None:
    a = job(0, 1, 10, ["d0", "d1"])
    b = job(0, 2, 20, ["d2"])
    c = job(0, 21, 30, ["d1", "d2"])
    late = job(25, 26, 31, ["d3"])
    jobs = [a, b, c, late]
    assert released_before(c, jobs) == 20  # b freed d2 last
    assert released_before(late, jobs) == 25  # nothing before it on d3: its submission
    assert released_before(a, jobs) == 0


def test_a_job_naming_a_held_device_gets_another_of_its_node_and_type() -> None:
    first = job(0, 0, 10, ["n1/mid:0", "n0/fast:0"])
    second = job(0, 5, 15, ["n1/mid:0", "n2/slow:1"])  # mid:0 held: mid:1 is free
    third = job(0, 6, 16, ["n0/fast:0"])  # the only fast one is held: shared
    fourth = job(0, 12, 20, ["n1/mid:0", "n1/mid:1"])  # mid:1 still held: mid:2
    got = assign_devices([fourth, third, second, first], DEVICES)
    assert got == [
        ["n1/mid:0", "n1/mid:2"],
        ["n0/fast:0"],
        ["n1/mid:1", "n2/slow:1"],
        ["n1/mid:0", "n0/fast:0"],
    ]


def test_a_job_waited_if_it_waited_for_devices_or_was_seen_behind_others() -> None:
    wait = {"type": "waiting", "data": {"devices": ["n1/mid:0"], "held_by": ["j1"]}}
    granted = {"type": "waiting", "data": {"devices": [], "held_by": [], "waited_s": 3.0}}
    progress = {"type": "progress", "data": {"step": 1}}
    assert waited([progress, wait, granted], behind_seen=False)
    assert not waited([progress, granted], behind_seen=False)
    assert waited([progress], behind_seen=True)


def test_summary_of_two_jobs_on_one_device() -> None:
    first = job(0.0, 2.0, 12.0, ["d0"], waited=False, ray_wait_s=None)
    second = job(0.0, 13.0, 23.0, ["d0"], waited=True, ray_wait_s=9.0)
    s = summarise([first, second], devices=2)
    assert s["makespan_s"] == 23.0
    assert s["bound_s"] == 10.0 and s["makespan_over_bound"] == 2.3
    assert s["mean_utilisation"] == pytest.approx(20 / (2 * 23))
    assert s["overhead_no_wait"]["p50_s"] == 2.0
    assert s["overhead_after_release"]["p50_s"] == 1.0  # released at 12, running at 13
    assert s["queue_wait"]["max_s"] == 13.0 and s["jobs_waited"] == 1
    assert s["max_devices_held"] == 1
    assert s["start_interval"]["p50_s"] == 11.0 and s["start_interval"]["n"] == 1


def test_the_jobs_drawn_are_valid_plans_and_the_same_for_a_seed() -> None:
    jobs = draw_jobs(30, 7, DEVICES)
    assert jobs == draw_jobs(30, 7, DEVICES)
    assert jobs != draw_jobs(30, 8, DEVICES)
    for j in jobs:
        plan = Plan.from_dict(j["plan"])
        devices = plan_devices(j["plan"])
        assert 1 <= len(devices) <= 4 and len(set(devices)) == len(devices)
        assert set(devices) <= set(DEVICES)
        assert plan.stages[0].start == 0 and plan.num_layers == LAYERS
    assert {len(plan_devices(j["plan"])) for j in jobs} == {1, 2, 3, 4}
    assert any(j["priority"] > 0 for j in jobs) and any(j["priority"] == 0 for j in jobs)
    assert len({j["steps"] for j in jobs}) > 1


def test_plan_doc_cuts_the_layers_into_one_stage_per_device() -> None:
    doc = plan_doc(random.Random(0), DEVICES, 4)
    layers = [s["layers"] for s in doc["stages"]]
    assert layers[0][0] == 0 and layers[-1][1] == LAYERS
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(layers, layers[1:], strict=False))
    assert all(len(s["devices"]) == 1 for s in doc["stages"])
