"""Calibration from use: measured plans posted as events feed the cluster's calibration, its
held-out error improves, new jobs predict with it, the API and the cluster page show it, and
bad observations are refused naming the field. No Ray: the "measurements" are the cost
model's own answers under a known calibration (as in tests/executor/test_calibrate.py); the
fit is real."""

from __future__ import annotations

import logging
import os
import signal
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text as sql
from sqlalchemy import update

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan
from pipeplan.executor.measure import Measurement, StageMeasurement
from pipeplan.service.api.calibration import MIN_RUNS, Calibrator, fit_payload, parse_observations
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.schemas import ClusterCalibration, EventIn, EventType, Job, JobKind
from pipeplan.service.api.store import Store
from pipeplan.service.cli.job_view import predictions_line
from pipeplan.service.tasks.events import EventReporter
from pipeplan.service.tasks.observations import OBSERVATION_KEY, observation_doc, spec_sha256
from pipeplan.service.tasks.run import measured_run
from pipeplan.service.web.cluster_view import calibration_panel
from tests.calibration_cases import TRUTH, cluster, plans, profile
from tests.service.api.conftest import FakeBackend


def measured(plan: Plan, truth: ClusterSpec) -> Measurement:
    """``plan`` "measured" on ``truth``: the cost model's answer under its calibration."""
    est = simulate(plan, profile(), truth)
    stages = tuple(
        StageMeasurement(
            i, s.layers, s.devices, s.microbatch,
            e.forward_s * plan.microbatches(i), e.backward_s * plan.microbatches(i),
            e.update_s, 0.0, 0.0, 0.0, 0.0, allreduce_s=e.allreduce_s,
        )
        for i, (s, e) in enumerate(zip(plan.stages, est.stages, strict=True))
    )  # fmt: skip
    t = est.batch_time_s
    return Measurement(
        plan, 3, 1, (t,), t, 0.0, t, t, plan.global_batch / t, 0.0, stages, (2.3,), (0.1,),
        True, (),
    )  # fmt: skip


def evaluation(plan: Plan, truth: ClusterSpec) -> dict[str, Any]:
    """An evaluation event's data for ``plan`` as a measured search posts it."""
    m = measured(plan, truth)
    return {
        "plan": plan.to_dict(),
        "value": m.batch_time_s,
        "source": "measured",
        "batch_time_s": m.batch_time_s,
        OBSERVATION_KEY: observation_doc(m, profile(), cluster()),
    }


def new_job(client: TestClient, fake_backend: FakeBackend, **extra: Any) -> dict[str, Any]:
    spec = {"cluster": cluster().to_dict(), "profile": profile().to_dict(), "planner": "dp",
            "batch": 16}  # fmt: skip
    r = client.post("/v1/jobs", json={"kind": "plan", "spec": spec, **extra})
    assert r.status_code == 201, r.text
    doc: dict[str, Any] = r.json()
    return doc


def post(client: TestClient, fake_backend: FakeBackend, job_id: str, body: Any) -> Any:
    token = fake_backend.token_of(job_id)
    return client.post(
        f"/v1/jobs/{job_id}/events", json=body, headers={"Authorization": f"Bearer {token}"}
    )


def calibrator(app: FastAPI) -> Calibrator:
    c: Calibrator = app.state.context.calibrator
    return c


def feed(client: TestClient, app: FastAPI, fake_backend: FakeBackend, chosen: list[Plan]) -> str:
    """Post ``chosen`` as one job's measured evaluations (each profile once); the job id."""
    job = new_job(client, fake_backend)
    truth = cluster().calibrated(TRUTH)
    sent: set[str] = set()
    for seq, plan in enumerate(chosen):
        data = evaluation(plan, truth)
        sha = data[OBSERVATION_KEY]["profile_sha256"]
        if sha in sent:
            del data[OBSERVATION_KEY]["profile"]
        sent.add(sha)
        r = post(client, fake_backend, job["id"], {"seq": seq, "type": "evaluation", "data": data})
        assert r.status_code == 200, r.text
    assert calibrator(app).wait_idle(120)
    return str(job["id"])


def test_runs_feed_a_calibration_that_improves_held_out_error_and_new_jobs_use_it(
    app_client: TestClient, app: FastAPI, fake_backend: FakeBackend
) -> None:
    assert app_client.get("/v1/clusters/c/calibration").status_code == 404
    feed(app_client, app, fake_backend, plans())
    r = app_client.get("/v1/clusters/c/calibration")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["state"] == "fitted" and doc["observations"] == len(plans())
    assert doc["runs"] == len(plans()) and not doc["stale"]
    assert doc["spec_sha256"] == spec_sha256(cluster())
    held = doc["held_out"]
    assert held["method"] == "newest quarter" and held["plans"] == 3
    assert held["median_abs_error_before"] > 0.1  # there was something to fit
    assert held["median_abs_error_after"] < min(0.03, held["median_abs_error_before"] / 4)
    assert doc["applied"] is True
    assert doc["calibration"]["compute_scale"]["slow"] == pytest.approx(1.3, rel=0.05)
    assert doc["calibration"]["fit"]["source"] == "service"

    job = new_job(app_client, fake_backend)
    assert predictions_line(Job.model_validate(job)).startswith(
        f"calibrated from {len(plans())} runs (fitted 20"
    )  # as `pipeplan jobs show` says it
    calibrated = job["spec"]["cluster"]
    spec = ClusterSpec.from_dict(calibrated)
    assert spec.calibration is not None
    assert spec.calibration.scale("slow") == pytest.approx(1.3, rel=0.05)
    assert spec_sha256(spec) == doc["spec_sha256"]  # the same cluster, calibrated
    as_given = new_job(app_client, fake_backend, calibration=False)["spec"]["cluster"]
    assert "calibration" not in as_given


def test_a_few_runs_are_judged_leave_one_out_and_not_yet_used(
    app_client: TestClient, app: FastAPI, fake_backend: FakeBackend
) -> None:
    feed(app_client, app, fake_backend, plans()[: MIN_RUNS - 1])
    doc = app_client.get("/v1/clusters/c/calibration").json()
    assert doc["state"] == "fitted" and doc["held_out"]["method"] == "leave-one-out"
    assert doc["applied"] is False and f"from {MIN_RUNS}" in doc["why"]
    assert "calibration" not in new_job(app_client, fake_backend)["spec"]["cluster"]


def test_a_changed_spec_starts_over_and_a_plan_counts_once_per_job(
    app_client: TestClient, app: FastAPI, fake_backend: FakeBackend
) -> None:
    job = feed(app_client, app, fake_backend, plans()[:2])
    again = evaluation(plans()[0], cluster().calibrated(TRUTH))
    assert post(app_client, fake_backend, job, {"seq": 10, "type": "evaluation",
                                                "data": again}).status_code == 200  # fmt: skip
    assert calibrator(app).wait_idle(60)
    assert app_client.get("/v1/clusters/c/calibration").json()["observations"] == 2
    other = cluster().to_dict()
    other["network"]["inter_node"]["latency_us"] = 10.0
    sha = spec_sha256(ClusterSpec.from_dict(other))
    r = app_client.get("/v1/clusters/c/calibration", params={"spec_sha256": sha})
    assert r.status_code == 404 and "no calibration yet" in r.json()["detail"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda o: o.pop("batch_time_s"), "data.observation.batch_time_s"),
        (lambda o: o.update(batch_time_s=-1.0), "data.observation.batch_time_s"),
        (lambda o: o.update(forward_s=[0.1, 0.2, 0.3]), "data.observation.forward_s"),
        (lambda o: o.update(backward_s=["x"]), "data.observation.backward_s[0]"),
        (lambda o: o.update(profile_sha256="0" * 64), "data.observation.profile_sha256"),
        (lambda o: o.pop("profile"), "data.observation.profile_sha256"),
        (lambda o: o.update(cluster={"name": "c"}), "data.observation.cluster"),
        (lambda o: o.update(emulated="yes"), "data.observation.emulated"),
        (
            lambda o: o.update(allreduce_s=[-1.0]),
            "data.observation.allreduce_s[0]: must be a number >= 0",
        ),
        (lambda o: o.update(allreduce_s=[0.1, 0.2]), "data.observation.allreduce_s: 2 values"),
        (lambda o: o.update(update_s=["soon"]), "data.observation.update_s[0]"),
        (lambda o: o.update(update_s=[]), "data.observation.update_s: 0 values"),
        (lambda o: o.update(extra=1), "data.observation: unknown key 'extra'"),
    ],
)
def test_a_bad_observation_is_refused_naming_the_field(
    app_client: TestClient, fake_backend: FakeBackend, change: Any, field: str
) -> None:
    job = new_job(app_client, fake_backend)
    data = evaluation(plans()[0], cluster().calibrated(TRUTH))
    change(data[OBSERVATION_KEY])
    r = post(app_client, fake_backend, job["id"], {"seq": 0, "type": "evaluation", "data": data})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith(field), r.json()["detail"]
    assert app_client.get(f"/v1/jobs/{job['id']}/events").json() == []  # nothing stored


def test_a_batch_names_the_event_and_may_name_a_profile_sent_earlier_in_it(
    app_client: TestClient, app: FastAPI, fake_backend: FakeBackend
) -> None:
    job = new_job(app_client, fake_backend)
    truth = cluster().calibrated(TRUTH)
    first, second = evaluation(plans()[0], truth), evaluation(plans()[1], truth)
    del second[OBSERVATION_KEY]["profile"]
    bad = {**second, "plan": {**second["plan"], "global_batch": 0}}
    batch = [{"seq": 0, "type": "evaluation", "data": first},
             {"seq": 1, "type": "evaluation", "data": bad}]  # fmt: skip
    r = post(app_client, fake_backend, job["id"], batch)
    assert r.status_code == 422 and r.json()["detail"].startswith("events[1].data.plan")
    batch[1]["data"] = second
    r = post(app_client, fake_backend, job["id"], batch)
    assert r.status_code == 200 and [a["stored"] for a in r.json()] == [True, True]
    assert calibrator(app).wait_idle(60)
    assert app_client.get("/v1/clusters/c/calibration").json()["observations"] == 2


def test_the_cluster_page_shows_the_calibration_and_its_error(
    app_client: TestClient, app: FastAPI, fake_backend: FakeBackend
) -> None:
    page = app_client.get("/cluster").text
    assert 'id="calibration"' in page and "No run measured" in page
    feed(app_client, app, fake_backend, plans())
    page = app_client.get("/cluster").text
    assert 'id="calibration-c"' in page
    shown = ("compute scale", "fwd overhead", "inter_node", "step overhead", "11 runs",
             "newest quarter", "held-out", "new jobs on this cluster predict with it",
             'class="calibration-models"', profile().model_key)  # fmt: skip
    for text in shown:
        assert text in page, text


def test_the_reporter_sends_a_profile_once_per_job() -> None:
    emitted: list[dict[str, Any]] = []

    class Channel:
        def emit(self, type_: str, data: dict[str, Any]) -> int:
            emitted.append(data)
            return len(emitted) - 1

    reporter = EventReporter(Channel(), source="measured")  # type: ignore[arg-type]
    truth = cluster().calibrated(TRUTH)
    for plan in plans()[:2]:
        data = evaluation(plan, truth)
        reporter.evaluated([plan], [data["value"]], [{OBSERVATION_KEY: data[OBSERVATION_KEY]}])  # type: ignore[arg-type]
    assert "profile" in emitted[0][OBSERVATION_KEY]
    assert "profile" not in emitted[1][OBSERVATION_KEY]
    assert (
        emitted[1][OBSERVATION_KEY]["profile_sha256"]
        == emitted[0][OBSERVATION_KEY]["profile_sha256"]
    )


def test_a_run_reports_its_plan_as_a_measured_evaluation_with_its_observation(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    plan = plans()[2]
    live = cluster().calibrated(TRUTH)  # a job's cluster the service had calibrated
    m = measured(plan, live)
    detail = measured_run(m, simulate(plan, profile(), live), profile(), live)
    assert detail["source"] == "measured" and detail["calibrated"] is True
    observation = detail[OBSERVATION_KEY]
    assert "calibration" not in observation["cluster"]  # filed under the uncalibrated spec
    assert observation["forward_s"][0] == pytest.approx(m.stages[0].forward_s / 4)  # per call
    job = new_job(app_client, fake_backend)
    data = {"plan": plan.to_dict(), "value": m.batch_time_s, **detail}
    r = post(app_client, fake_backend, job["id"], {"seq": 0, "type": "evaluation", "data": data})
    assert r.status_code == 200, r.text


def stored_runs(db: Store, n: int) -> str:
    """``n`` measured plans of one job stored (with their observations); the job id."""
    job = db.create_job(JobKind.PLAN, {}, None, "hash").id
    truth = cluster().calibrated(TRUTH)
    posted = [
        EventIn(seq=i, type=EventType.EVALUATION, data=evaluation(p, truth))
        for i, p in enumerate(plans()[:n])
    ]
    observations = parse_observations(posted, db)
    assert db.add_events(job, posted, observations) == [True] * n
    assert db.add_events(job, posted, observations) == [False] * n  # repeats: nothing
    return job


def test_the_store_keeps_observations_and_fits_on_either_database(
    db: Store, fit_worker: FitWorker
) -> None:
    stored_runs(db, 4)
    record = db.calibration("c")
    assert record is not None and record.observations == 4 and record.stale
    refitted = Calibrator(db, worker=fit_worker).refit(("c", spec_sha256(cluster())))
    assert refitted is not None and not refitted.stale and refitted.fit is not None
    assert refitted.fit["runs"] == 4 and refitted.fit_error is None
    assert len(db.observations("c", spec_sha256(cluster()), 3)) == 3


def test_the_store_keeps_each_stages_measured_all_reduce_and_the_fit_reads_it(db: Store) -> None:
    stored_runs(db, len(plans()))
    stored = db.observations("c", spec_sha256(cluster()), 20)
    replicated = plans()[9]  # its second stage on n1's two slow devices
    row = next(o for o in stored if Plan.from_dict(o.plan) == replicated)
    ring = simulate(replicated, profile(), cluster().calibrated(TRUTH)).stages[1].allreduce_s
    assert row.allreduce_s == pytest.approx((0.0, ring)) and ring > 0
    runs = fit_payload(cluster().to_dict(), stored)["runs"]
    assert runs[stored.index(row)]["allreduce_s"] == pytest.approx([0.0, ring])
    updates = [s.update_s for s in simulate(replicated, profile(), cluster()).stages]
    assert row.update_s == pytest.approx(tuple(updates)) and min(updates) > 0
    assert runs[stored.index(row)]["update_s"] == pytest.approx(updates)


def test_a_database_from_before_the_all_reduce_gets_its_columns_and_keeps_its_rows(
    db: Store,
) -> None:
    """A database written before the columns existed (dropped here): opening it adds them,
    and the rows it had read as observations without a measured all-reduce and update."""
    stored_runs(db, 2)
    table = db.cal_observations.name
    with db.engine.begin() as conn:
        conn.execute(sql(f'ALTER TABLE "{table}" DROP COLUMN allreduce_s'))
        conn.execute(sql(f'ALTER TABLE "{table}" DROP COLUMN update_s'))
    again = Store(db.engine.url.render_as_string(hide_password=False), prefix=db.prefix)
    try:
        again.create_tables()
        old = again.observations("c", spec_sha256(cluster()), 10)
        assert len(old) == 2 and all(o.allreduce_s == () == o.update_s for o in old)
        stored_runs(again, 3)  # a new job's three: the rows before stay, new ones land
        new = again.observations("c", spec_sha256(cluster()), 10)
        assert len(new) == 5 and all(len(o.allreduce_s) == len(o.plan["stages"]) for o in new[2:])
        assert all(len(o.update_s) == len(o.plan["stages"]) for o in new[2:])
    finally:
        again.close()


def test_the_fit_runs_in_a_child_process_from_plain_data(db: Store, fit_worker: FitWorker) -> None:
    stored_runs(db, 4)
    stored = db.observations("c", spec_sha256(cluster()), 10)
    payload = fit_payload(cluster().to_dict(), stored)
    assert len(payload["profiles"]) == 1 and len(payload["runs"]) == 4  # each profile once
    outcome = fit_worker.fit(payload)
    assert outcome["pid"] != os.getpid() and outcome["error"] is None
    assert outcome["fit"] is not None and outcome["fit"]["runs"] == 4
    assert fit_worker.fit(payload)["pid"] == outcome["pid"]  # the worker stays for the next


def test_a_fit_that_fails_is_stored_and_logged_and_the_previous_fit_kept(
    db: Store, fit_worker: FitWorker, caplog: pytest.LogCaptureFixture
) -> None:
    stored_runs(db, 4)
    key = ("c", spec_sha256(cluster()))
    calibrator = Calibrator(db, worker=fit_worker)
    good = calibrator.refit(key)
    assert good is not None and good.fit is not None
    c = db.cal_clusters
    with db.engine.begin() as conn:  # a spec the worker cannot read
        conn.execute(update(c).where(c.c.name == "c").values(spec={"name": "c"}))
    with caplog.at_level(logging.WARNING, logger="pipeplan.service.calibration"):
        failed = calibrator.refit(key, force=True)
    assert failed is not None and failed.fit_error == "cluster.device_types: missing"
    assert failed.fit == good.fit  # the previous fit kept
    assert "cluster.device_types: missing" in caplog.text


def test_an_error_in_the_worker_is_raised_in_the_caller_and_the_next_fit_runs(
    db: Store, fit_worker: FitWorker
) -> None:
    stored_runs(db, 2)
    payload = fit_payload(cluster().to_dict(), db.observations("c", spec_sha256(cluster()), 10))
    broken = {**payload, "runs": [{**payload["runs"][0], "profile_sha256": "x"}]}
    with pytest.raises(KeyError, match="'x'"):  # not a refusal: raised where it is awaited
        fit_worker.fit(broken)  # type: ignore[arg-type]
    assert fit_worker.fit(payload)["fit"] is not None


@pytest.mark.slow
def test_a_worker_that_died_fails_its_fit_and_the_next_fit_has_a_new_one(store: Store) -> None:
    stored_runs(store, 2)
    payload = fit_payload(cluster().to_dict(), store.observations("c", spec_sha256(cluster()), 10))
    worker = FitWorker()
    try:
        pid = worker.fit(payload)["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(BrokenProcessPool):
            worker.fit(payload)
        again = worker.fit(payload)
        assert again["fit"] is not None and again["pid"] not in (pid, os.getpid())
    finally:
        worker.close()


def test_the_cluster_pages_links_show_the_sends_and_the_ring_rounds_spec_and_fitted() -> None:
    spec = ClusterSpec.from_dict(
        {
            **cluster().to_dict(),
            "network": {
                "inter_node": {
                    "bandwidth_gbps": 1.5,
                    "latency_us": 8000,
                    "all_reduce": {"bandwidth_gbps": 2.7, "latency_us": 21000},
                }
            },
        }
    )
    info = fitted_info({"network": {"inter_node": {"bandwidth_gbps": 2.0, "latency_us": 5000}}})
    rows = {row.name: row for row in calibration_panel(info, spec, ours=True).links}
    assert (rows["inter_node"].spec_gbps, rows["inter_node"].fitted_gbps) == (1.5, 2.0)
    ring = rows["inter_node all-reduce"]
    assert (ring.spec_gbps, ring.spec_us, ring.fitted_gbps) == (2.7, 21000, None)  # not fitted
    assert "intra_node all-reduce" not in rows  # the spec has no ring numbers, none fitted
    fitted = info.model_copy(
        update={
            "calibration": {
                "all_reduce": {"intra_node": {"bandwidth_gbps": 3.0, "latency_us": 900}},
            }
        }
    )
    rows = {row.name: row for row in calibration_panel(fitted, spec, ours=True).links}
    ring = rows["intra_node all-reduce"]  # the spec's link's own numbers beside the fitted
    assert (ring.spec_gbps, ring.fitted_gbps, ring.fitted_us) == (
        spec.network.intra_node.bandwidth_gbps,
        3.0,
        900,
    )
    assert rows["inter_node all-reduce"].fitted_gbps is None


def fitted_info(calibration: dict[str, Any]) -> ClusterCalibration:
    """Cluster ``c``'s calibration from use, fitted to ``calibration``."""
    return ClusterCalibration(
        cluster="c",
        spec_sha256="0" * 64,
        state="fitted",
        observations=3,
        last_observed_at=datetime.now(UTC),
        calibration=calibration,
    )


def test_the_cluster_pages_models_show_their_compute_scale() -> None:
    info = fitted_info({"model_scale": {"gpt@32:0123abcd": 1.2, "alexnet@3x64x64:89abcdef": 0.9}})
    panel = calibration_panel(info, cluster(), ours=True)
    assert panel.models == (("alexnet@3x64x64:89abcdef", 0.9), ("gpt@32:0123abcd", 1.2))
    assert calibration_panel(fitted_info({}), cluster(), ours=True).models == ()


def test_the_cluster_pages_types_show_the_update_bandwidth_spec_and_fitted() -> None:
    info = fitted_info(
        {
            "call_overhead": {"fast": {"fwd_s": 0.001, "bwd_s": 0.002}},
            "memory_bandwidth_gbps": {"slow": 12.5},
        }
    )
    rows = {t.name: t for t in calibration_panel(info, cluster(), ours=True).types}
    assert (rows["slow"].spec_update_gbps, rows["slow"].fitted_update_gbps) == (30.0, 12.5)
    assert (rows["fast"].spec_update_gbps, rows["fast"].fitted_update_gbps) == (30.0, None)
