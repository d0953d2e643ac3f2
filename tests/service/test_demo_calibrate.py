"""``pipeplan demo --calibrate`` without Ray: the cluster, the profile and every run are
replaced by the synthetic calibration case (tests/calibration_cases.py), whose "measurements"
are the cost model's answers under a known calibration. The wiring is real: the probes are
``pipeplan calibrate``'s, the fit is real, the planners plan on what it fitted, and the
errors the demo reports leave out the plans that were probes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from rich.console import Console

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan
from pipeplan.executor.calibrate import probe_plans
from pipeplan.executor.measure import Measurement, relative_error
from pipeplan.executor.measured_reward import Outcome, plan_key
from pipeplan.service.cli.demo import fidelity_line
from pipeplan.service.render_runs import demo_table
from pipeplan.service.tasks import demo as demo_task
from pipeplan.service.tasks.demo import Demo, DemoRequest, DemoRow
from tests.calibration_cases import TRUTH, cluster, profile
from tests.service.api.test_calibration import measured

BATCH = 16


@pytest.fixture
def calibrated_demo(monkeypatch: pytest.MonkeyPatch) -> Demo:
    truth = cluster().calibrated(TRUTH)

    @contextlib.contextmanager
    def live_cluster(spec: ClusterSpec, address: Any, reporter: Any) -> Iterator[ClusterSpec]:
        yield cluster()

    def measure_probes(plans: Sequence[Any], *args: Any) -> list[Measurement]:
        return [measured(p, truth) for p in plans]

    def run_all(rows: Sequence[Any], *args: Any) -> list[DemoRow]:
        out = []
        for r in rows:
            m = measured(r.result.plan, truth)
            out.append(DemoRow(r.planner, r.result, Outcome(r.result.plan, m.batch_time_s, m)))
        return out

    monkeypatch.setattr(demo_task, "live_cluster", live_cluster)
    monkeypatch.setattr(demo_task, "measure_on_cluster", lambda *a, **k: profile())
    monkeypatch.setattr(demo_task, "measure_probes", measure_probes)
    monkeypatch.setattr(demo_task, "run_all", run_all)
    request = DemoRequest(model="digits_cnn", input_size=8, cluster="local-hetero",
                          batch=BATCH, tapp_iterations=2, calibrate=True)  # fmt: skip
    return demo_task.demo(request)


def test_the_demo_plans_on_the_cluster_fitted_to_its_probes(calibrated_demo: Demo) -> None:
    done, truth = calibrated_demo, cluster().calibrated(TRUTH)
    assert [q.plan for q in done.probes] == probe_plans(cluster(), profile(), BATCH)
    cal = done.problem.cluster.calibration
    assert cal is not None and cal.fit["by"] == "pipeplan demo --calibrate"
    # the fit recovered the truth: every plan the demo ran is predicted as "measured"
    for r in done.rows:
        if r.result is not None and r.measured_s is not None:
            assert abs(relative_error(r.result.estimate.batch_time_s, r.measured_s)) < 0.02
    uncalibrated = [
        abs(
            relative_error(simulate(r.result.plan, profile(), cluster()).batch_time_s, r.measured_s)
        )
        for r in done.rows
        if r.result is not None and r.measured_s is not None
    ]
    assert max(uncalibrated) > 0.05  # so the line above says something
    probes = done.to_dict()["probes"]
    assert [Plan.from_dict(q["plan"]) for q in probes] == [q.plan for q in done.probes]
    for q, plan in zip(probes, (q.plan for q in done.probes), strict=True):
        assert q["measured_batch_time_s"] == measured(plan, truth).batch_time_s
        assert abs(relative_error(q["predicted_s"], q["measured_batch_time_s"])) < 0.02
        uncal = simulate(plan, profile(), cluster()).batch_time_s
        assert q["predicted_uncalibrated_s"] == pytest.approx(uncal)


def test_plans_that_were_probes_are_left_out_of_the_errors_and_marked(
    calibrated_demo: Demo,
) -> None:
    done = calibrated_demo
    probes = {plan_key(p.plan) for p in done.probes}
    ran = {r.planner: r for r in done.rows if r.result is not None}
    was_probe = {n for n, r in ran.items() if plan_key(r.result.plan) in probes}  # type: ignore[union-attr]
    assert "bsp-all" in was_probe  # every device as replicas of one stage is a probe
    assert not set(done.errors()) & was_probe
    f = done.fidelity()
    assert f["calibrated"] and f["calibrated_by_demo_probes"] == len(done.probes)
    assert f["plans"] == len(done.errors()) >= 1
    line = fidelity_line(done)
    assert f"calibrated to this demo's {len(done.probes)} probe runs" in line
    assert "(those not among the probes)" in line
    console = Console(width=250, record=True)
    console.print(demo_table(done))
    text = console.export_text()
    cells = [line.split("│") for line in text.splitlines() if line.count("│") > 2]
    for name in ran:
        row = next(c for c in cells if c[1].strip().split(" ")[0] == name)
        assert ("(probe)" in row[5]) == (name in was_probe), row
