"""bench.tapp_table's choice of the Planned and Pipelined rows (no Ray: the planners run on
a small synthetic profile)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.tapp_table import PIPELINED, best_candidate, plan_with
from core.costmodel import simulate
from core.plan import Plan, Stage
from tests.calibration_cases import cluster, profile

F, S0, S1 = "n0/fast:0", "n1/slow:0", "n1/slow:1"


def candidate(plan: Plan) -> dict[str, Any]:
    return {
        "plan": plan.to_dict(),
        "predicted_s": simulate(plan, profile(), cluster()).batch_time_s,
    }


def test_pipelined_is_the_fastest_plan_of_several_stages() -> None:
    one = Plan(16, (Stage((0, 6), (F,), 16),))
    two = Plan(16, (Stage((0, 4), (F,), 8), Stage((4, 6), (S0,), 8)))
    three = Plan(16, (Stage((0, 2), (S0,), 4), Stage((2, 4), (F,), 4), Stage((4, 6), (S1,), 4)))
    candidates = {"one": candidate(one), "two": candidate(two), "three": candidate(three)}
    by_time = sorted(candidates, key=lambda n: candidates[n]["predicted_s"])
    assert best_candidate(candidates) == by_time[0]
    several = [n for n in by_time if n != "one"]
    assert best_candidate(candidates, min_stages=2) == several[0]
    with pytest.raises(ValueError, match="no candidate plan has 4 stages or more"):
        best_candidate(candidates, min_stages=4)


def test_the_pipelined_search_keeps_several_stages() -> None:
    spec, prof = cluster(), profile()
    alone, _ = plan_with(PIPELINED, prof, spec, 16, seconds=10.0, seed=0)
    piped, _ = plan_with(PIPELINED, prof, spec, 16, seconds=10.0, seed=0, min_stages=2)
    assert alone.num_stages == 1  # this cluster's optimum: the whole model on the fast device
    assert piped.num_stages >= 2
    piped.validate(prof, spec)
