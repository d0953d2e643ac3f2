"""bench.tapp_table's choice of the Planned and Pipelined rows, and its held-out calibrations
(no Ray: the planners run on a small synthetic profile, the runs are the cost model's)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import tapp_table
from bench.common import BLIND, Observed
from bench.tapp_table import (
    PIPELINED,
    best_candidate,
    calibrate_rows,
    plan_with,
    planning_spec,
)
from pipeplan.core.calibration import Calibration
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Stage
from tests.calibration_cases import cluster, profile
from tests.executor.test_calibrate import heavy, observe

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


PLANS = {
    "SingleCPU": Plan(16, (Stage((0, 6), (S0,), 16),)),
    "BSP": Plan(16, (Stage((0, 6), (S0, S1), 8),)),
    "Planned": Plan(16, (Stage((0, 3), (F,), 8), Stage((3, 6), (S0, S1), 8))),
    "Pipe-Torch": Plan(16, (Stage((0, 4), (F,), 8), Stage((4, 6), (S0,), 8))),
}


def measured_rows() -> tuple[list[dict[str, Any]], dict[tuple[str, str], Observed]]:
    """Two "models" (the same profile under two labels), :data:`PLANS` each, "measured" as
    the cost model's answers on a cluster whose slow type updates at 6 GB/s (the spec says
    30); each model's Pipelined row is its Planned row's twin."""
    truth = cluster().calibrated(Calibration(memory_bandwidth_gbps={"slow": 6.0}))
    docs, observed = [], {}
    for model in ("A", "B"):
        rows = []
        for method, plan in PLANS.items():
            o = observe(truth, plan, heavy())
            predicted = simulate(plan, heavy(), cluster()).batch_time_s
            rows.append(row_doc(method, o.batch_time_s, predicted))
            observed[(model, method)] = Observed(model, plan, heavy(), (o,))
        rows.append(row_doc("Pipelined", rows[2]["measured_s"], rows[2]["predicted_s"], "Planned"))
        docs.append({"model": model, "rows": rows})
    return docs, observed


def test_rows_get_their_plans_held_out_predictions_and_a_twin_its_twins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bookkeeping of ``calibrate_rows`` (the fits stand-ins: each held-out kind predicts
    a fixed factor of the measured time, further off when blind to the updates): every
    measured row gets each kind's prediction and error, the blind kinds are fitted to the
    runs without their updates, a twin row takes its twin's and is counted once."""
    factors = {"held-out model": 1.02, "held-out plan": 0.99}
    calls: list[list[Observed]] = []

    def fake_held_out(
        rows: list[Observed], spec: object
    ) -> tuple[list[dict[str, float]], dict[str, Any]]:
        calls.append(list(rows))
        blind = all(o.update_s == () for r in rows for o in r.runs)
        return [
            {k: r.runs[0].batch_time_s * (f + 0.1 if blind else f) for k, f in factors.items()}
            for r in rows
        ], {}

    monkeypatch.setattr(tapp_table, "held_out", fake_held_out)
    docs, observed = measured_rows()
    verdicts = calibrate_rows(docs, observed, cluster())
    assert [[r.plan for r in rows] for rows in calls] == [[o.plan for o in observed.values()]] * 2
    assert all(o.update_s for r in calls[0] for o in r.runs)  # the runs as measured
    assert all(o.update_s == () for r in calls[1] for o in r.runs)  # then blind to the updates
    assert verdicts["uncalibrated"]["max"] > 0.05 and verdicts["uncalibrated"]["plans"] == 8
    for kind, f in factors.items():
        assert verdicts[kind] == {"median": pytest.approx(abs(f - 1)),
                                  "max": pytest.approx(abs(f - 1)), "plans": 8}  # fmt: skip
        assert verdicts[kind + BLIND]["max"] == pytest.approx(abs(f + 0.1 - 1))
    for d in docs:
        for r in d["rows"]:
            assert r["calibrated_predicted_s"] == {
                k: pytest.approx(r["measured_s"] * f) for k, f in factors.items()
            } | {k + BLIND: pytest.approx(r["measured_s"] * (f + 0.1)) for k, f in factors.items()}
            assert r["calibrated_rel_error"] == {
                k: pytest.approx(v / r["measured_s"] - 1)
                for k, v in r["calibrated_predicted_s"].items()
            }
        assert d["rows"][4]["calibrated_predicted_s"] == d["rows"][2]["calibrated_predicted_s"]


@pytest.mark.slow
def test_rows_get_held_out_calibrated_predictions_with_and_without_the_update_term() -> None:
    """:func:`measured_rows` with the real held-out fits (20 of them, ~15 s): every measured
    row gets its held-out predictions, a twin row its twin's, and the fits that see the
    updates predict the held-out plans better than the ones blind to them."""
    docs, observed = measured_rows()
    verdicts = calibrate_rows(docs, observed, cluster())
    kinds = {"held-out model", "held-out plan"}
    assert set(verdicts) == {"uncalibrated"} | kinds | {k + BLIND for k in kinds}
    assert all(v["plans"] == 8 for v in verdicts.values())  # the twins counted once
    for d in docs:
        assert all(set(r["calibrated_rel_error"]) == set(verdicts) - {"uncalibrated"}
                   for r in d["rows"])  # fmt: skip
        assert d["rows"][4]["calibrated_predicted_s"] == d["rows"][2]["calibrated_predicted_s"]
    assert verdicts["held-out plan"]["max"] < 0.01
    assert verdicts["held-out plan" + BLIND]["max"] > 0.05
    assert verdicts["uncalibrated"]["max"] > 0.05


def row_doc(
    method: str, measured: float, predicted: float, twin: str | None = None
) -> dict[str, Any]:
    return {
        "method": method,
        "measured_s": measured,
        "predicted_s": predicted,
        "same_plan_as": twin,
    }


def test_a_model_is_planned_on_the_calibration_fitted_to_the_runs_before_it() -> None:
    """Nothing measured yet: the spec itself. Runs "measured" on a cluster whose slow type
    updates at 6 GB/s: the planning spec is fitted to them (its slow type's update bandwidth
    moves towards 6 GB/s), names the models it saw, and predicts their runs closer."""
    spec = cluster()
    assert planning_spec(spec, {}) == (spec, [])
    truth = spec.calibrated(Calibration(memory_bandwidth_gbps={"slow": 6.0}))
    plans = (
        Plan(16, (Stage((0, 6), (S0, S1), 8),)),
        Plan(16, (Stage((0, 3), (F,), 8), Stage((3, 6), (S0, S1), 8))),
        Plan(16, (Stage((0, 4), (F,), 8), Stage((4, 6), (S0,), 8))),
    )
    observed = {
        ("A", str(k)): Observed("A", plan, heavy(), (observe(truth, plan, heavy()),))
        for k, plan in enumerate(plans)
    }
    planning, models = planning_spec(spec, observed)
    assert models == ["A"] and planning != spec
    assert planning.calibration is not None
    assert planning.calibration.memory_bandwidth_gbps["slow"] < 15.0
    for seen in observed.values():
        measured = seen.runs[0].batch_time_s
        before = abs(simulate(seen.plan, heavy(), spec).batch_time_s - measured)
        after = abs(simulate(seen.plan, heavy(), planning).batch_time_s - measured)
        assert after <= before
