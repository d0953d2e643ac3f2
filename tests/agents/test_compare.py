"""agents/compare.py: planners against the exact answer, as data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pipeplan.agents.baselines.every_device import bsp_all
from pipeplan.agents.compare import (
    Entry,
    Row,
    comparison_doc,
    default_planners,
    exact_reference,
    fixed_plan_row,
    ratio,
    ratios,
    run_comparison,
)
from pipeplan.agents.problem import InfeasibleError, PlanResult, Problem
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.formats.pipedream import load_pipedream

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def problem() -> Problem:
    profile = load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")
    cluster = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")
    return Problem(profile, cluster, global_batch=16)


def _row(name: str, result: PlanResult, value: float) -> Row:
    return Row(name, PlanResult(result.plan, result.estimate, value, (), 1, 0.0, name))


def test_ratio_handles_free_plans() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(0.0, 0.0) == 1.0
    assert ratio(1.0, 0.0) == math.inf


def test_rows_failures_and_bugs(problem: Problem) -> None:
    def run(entry: Entry, p: Problem) -> PlanResult:
        if entry.planner == "refuses":
            raise InfeasibleError("refuses: no plan fits")
        if entry.planner == "buggy":
            raise KeyError("oops")
        return fixed_plan_row(entry.label, p, bsp_all).result  # type: ignore[return-value]

    entries = [Entry("a", "ok"), Entry("b", "refuses"), Entry("c", "buggy")]
    rows = run_comparison(problem, entries, run)
    assert [r.planner for r in rows] == ["a", "b", "c"]
    assert rows[0].result is not None and rows[0].value == rows[0].result.value
    assert rows[1].error == "refuses: no plan fits" and rows[1].value == math.inf
    assert rows[2].error == "internal error: KeyError: 'oops'"
    with pytest.raises(KeyError):
        run_comparison(problem, entries, run, catch_bugs=False)


def test_exact_reference_prefers_brute_and_ratios_follow_it(problem: Problem) -> None:
    base = fixed_plan_row("bsp-all", problem, bsp_all).result
    assert base is not None
    rows = [_row("dp", base, 2.0), _row("greedy", base, 3.0), Row("brute", error="too big")]
    assert exact_reference(rows) is rows[0]
    rows.append(_row("brute", base, 1.5))
    assert exact_reference(rows) is rows[-1]
    to_best, to_exact = ratios(rows)
    assert to_best == {"dp": 2.0 / 1.5, "greedy": 2.0, "brute": 1.0}
    assert to_exact == to_best
    doc = comparison_doc(problem, rows)
    assert doc["exact_reference"] == "brute" and doc["best"] == "brute"
    failed = next(r for r in doc["results"] if not r["ok"])
    assert failed == {"planner": "brute", "ok": False, "error": "too big", "search_s": 0.0}


def test_no_exact_reference_without_brute_or_dp(problem: Problem) -> None:
    base = fixed_plan_row("bsp-all", problem, bsp_all).result
    assert base is not None
    rows = [_row("greedy", base, 3.0)]
    assert exact_reference(rows) is None and ratios(rows) == ({"greedy": 1.0}, {})
    assert comparison_doc(problem, rows)["results"][0]["ratio_to_exact"] is None


def test_fixed_plan_row_scores_the_plan(problem: Problem) -> None:
    row = fixed_plan_row("bsp-all", problem, bsp_all)
    assert row.result is not None
    assert row.result.value == problem.score_estimate(row.result.estimate)
    assert row.result.evaluations == len(problem.microbatch_sizes())


def test_real_planners_and_the_default_list(problem: Problem) -> None:
    rows = run_comparison(problem, [Entry("uniform", "uniform"), Entry("eq", "uniform")])
    assert rows[0].value == rows[1].value  # one planner under two labels, same answer
    assert {"uniform", "balanced", "data_parallel", "greedy", "dp", "brute"} <= set(
        default_planners()
    )
    assert "tapp" not in default_planners() and "ppo" not in default_planners()
