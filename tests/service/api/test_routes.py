"""The routes of API.md against a fake backend: a job's life through its events, pages,
bad specs refused before anything is stored, limits, 413, readiness, metrics, reconcile."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeplan.service.api.app import create_app, reconcile
from pipeplan.service.api.backend import BackendState, BackendStatus
from pipeplan.service.api.schemas import JobKind
from pipeplan.service.api.store import Store
from tests.core.test_formats import CLUSTER, PROFILE
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

SPEC = {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"}
BIG_NODE = {
    "name": "huge",
    "device_types": {"cpu": {"flops": 1e11, "memory_gb": 4}},
    "nodes": [{"name": "n0", "devices": {"cpu": 100_000_000}}],
}


def _submit(client: TestClient, kind: str = "plan", spec: Any = SPEC, **extra: Any) -> Any:
    r = client.post("/v1/jobs", json={"kind": kind, "spec": spec, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def _event(client: TestClient, job_id: str, seq: int, type_: str, data: Any) -> Any:
    r = client.post(f"/v1/jobs/{job_id}/events", json={"seq": seq, "type": type_, "data": data})
    return r


def test_a_job_lives_through_its_events(app_client: TestClient, fake_backend: FakeBackend) -> None:
    job = _submit(app_client, name="first")
    assert job["state"] == "queued" and job["name"] == "first" and job["ray_job_id"] == job["id"]
    assert [s.job_id for s in fake_backend.submitted] == [job["id"]]
    jid = job["id"]
    progress = {"evaluations": 10, "best_value": 0.5, "elapsed_s": 1.0}
    assert _event(app_client, jid, 0, "progress", progress).json() == {"seq": 0, "stored": True}
    got = app_client.get(f"/v1/jobs/{jid}").json()
    assert got["state"] == "running" and got["progress"] == progress and got["started_at"]
    assert _event(app_client, jid, 0, "progress", progress).json() == {"seq": 0, "stored": False}
    evaluation = {"plan": {}, "value": 0.4, "batch_time_s": 0.4, "source": "simulated"}
    assert _event(app_client, jid, 1, "evaluation", evaluation).json()["stored"]
    result = {"plan": {"global_batch": 64}, "estimate": {"batch_time_s": 0.4}}
    assert _event(app_client, jid, 2, "result", result).json()["stored"]
    got = app_client.get(f"/v1/jobs/{jid}").json()
    assert got["state"] == "succeeded" and got["result"] == result and got["finished_at"]
    r = _event(app_client, jid, 3, "progress", progress)
    assert r.status_code == 409 and "succeeded" in r.json()["detail"]
    assert _event(app_client, jid, 2, "result", result).json() == {"seq": 2, "stored": False}
    events = app_client.get(f"/v1/jobs/{jid}/events").json()
    assert [(e["seq"], e["type"]) for e in events] == [
        (0, "progress"),
        (1, "evaluation"),
        (2, "result"),
    ]
    assert [e["seq"] for e in app_client.get(f"/v1/jobs/{jid}/events?after=0").json()] == [1, 2]
    r = app_client.post(f"/v1/jobs/{jid}/cancel")
    assert r.status_code == 409 and "succeeded" in r.json()["detail"]


def test_a_batch_of_events_is_stored_at_once_with_one_ack_each(app_client: TestClient) -> None:
    jid = _submit(app_client)["id"]
    url = f"/v1/jobs/{jid}/events"
    batch = [{"seq": s, "type": "evaluation", "data": {"value": s}} for s in range(3)]
    r = app_client.post(url, json=batch)
    assert r.status_code == 200 and [a["stored"] for a in r.json()] == [True] * 3
    batch += [{"seq": 3, "type": "progress", "data": {"evaluations": 4}}]
    batch += [{"seq": 4, "type": "result", "data": {"best": 1}}]
    acks = app_client.post(url, json=batch).json()
    assert acks == [{"seq": s, "stored": s >= 3} for s in range(5)]
    got = app_client.get(f"/v1/jobs/{jid}").json()
    assert got["state"] == "succeeded" and got["progress"] == {"evaluations": 4}
    assert [e["seq"] for e in app_client.get(url).json()] == list(range(5))


def test_a_malformed_batch_is_refused_naming_the_event(app_client: TestClient) -> None:
    jid = _submit(app_client)["id"]
    url = f"/v1/jobs/{jid}/events"
    twice = [{"seq": 0, "type": "progress", "data": {}}] * 2
    r = app_client.post(url, json=twice)
    assert r.status_code == 422 and "events[1].seq: 0 appears twice" in r.json()["detail"]
    early = [{"seq": 0, "type": "error", "data": {}}, {"seq": 1, "type": "progress", "data": {}}]
    r = app_client.post(url, json=early)
    assert r.status_code == 422 and "'error' at seq 0 ends the job" in r.json()["detail"]
    assert app_client.post(url, json=[]).status_code == 422
    too_many = [{"seq": s, "type": "progress", "data": {}} for s in range(1001)]
    r = app_client.post(url, json=too_many)
    assert r.status_code == 422 and "1000" in r.json()["detail"]
    assert app_client.get(url).json() == []
    assert app_client.get(f"/v1/jobs/{jid}").json()["state"] == "queued"


def test_cancel_stops_the_work_and_an_error_event_fails_a_job(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    a, b = _submit(app_client)["id"], _submit(app_client)["id"]
    r = app_client.post(f"/v1/jobs/{a}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert fake_backend.stopped == [a]
    assert app_client.post(f"/v1/jobs/{a}/cancel").status_code == 409
    assert _event(app_client, b, 0, "error", {"message": "planner: boom"}).status_code == 200
    got = app_client.get(f"/v1/jobs/{b}").json()
    assert got["state"] == "failed" and got["error"] == "planner: boom"
    assert app_client.get("/v1/jobs/pp-missing").status_code == 404
    assert app_client.post("/v1/jobs/pp-missing/cancel").status_code == 404


def test_logs_come_from_the_backend(app_client: TestClient, fake_backend: FakeBackend) -> None:
    jid = _submit(app_client)["id"]
    fake_backend.log_text[jid] = "line 1\nline 2\n"
    r = app_client.get(f"/v1/jobs/{jid}/logs")
    assert r.status_code == 200 and r.text == "line 1\nline 2\n"
    assert r.headers["content-type"].startswith("text/plain")


def test_a_live_stream_sends_the_events_and_ends_with_the_job(app_client: TestClient) -> None:
    jid = _submit(app_client)["id"]
    _event(app_client, jid, 0, "progress", {"evaluations": 1})
    _event(app_client, jid, 1, "result", {"plan": {}})
    with app_client.stream(
        "GET", f"/v1/jobs/{jid}/events", headers={"Accept": "text/event-stream"}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    assert "id: 0\nevent: progress\n" in text and "id: 1\nevent: result\n" in text
    assert text.rstrip().endswith('event: end\ndata: {"state": "succeeded"}')


def test_a_submission_the_backend_refuses_ends_failed(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    fake_backend.fail_submit = "no Ray cluster at 127.0.0.1:1"
    job = _submit(app_client)
    assert job["state"] == "failed"
    assert job["error"] == "submit: RuntimeError: no Ray cluster at 127.0.0.1:1"


def test_pages_newest_first(app_client: TestClient) -> None:
    ids = [_submit(app_client)["id"] for _ in range(5)]
    _submit(app_client, "profile", {"model": "alexnet"})
    r = app_client.get("/v1/jobs", params={"limit": 2, "kind": "plan"}).json()
    assert [j["id"] for j in r["items"]] == ids[::-1][:2]
    seen = [j["id"] for j in r["items"]]
    while r["next"]:
        r = app_client.get("/v1/jobs", params={"limit": 2, "kind": "plan", "cursor": r["next"]})
        r = r.json()
        seen += [j["id"] for j in r["items"]]
    assert seen == ids[::-1]
    assert len(app_client.get("/v1/jobs", params={"state": "queued"}).json()["items"]) == 6
    r = app_client.get("/v1/jobs", params={"cursor": "xyz"})
    assert r.status_code == 422 and r.json()["detail"].startswith("cursor:")
    r = app_client.get("/v1/jobs", params={"limit": 0})
    assert r.status_code == 422 and r.json()["detail"].startswith("limit:")


BAD_SPECS = [
    ("plan", SPEC | {"planner": "nope"}, "planner: unknown planner 'nope'"),
    ("plan", SPEC | {"options": {"bogus": 1}}, "bad options {'bogus': 1}"),
    ("plan", SPEC | {"cluster": "nowhere"}, "cluster: unknown preset 'nowhere'"),
    ("plan", SPEC | {"model": "lenet"}, "model: unknown model 'lenet'"),
    ("plan", SPEC | {"objective": "cost"}, "min_throughput: required with objective cost"),
    ("plan", SPEC | {"objective": "speed"}, "spec.objective: Input should be"),
    ("plan", SPEC | {"batch": 0}, "spec.batch: must be >= 1, got 0"),
    ("plan", SPEC | {"input_size": 5}, "alexnet.input_size: must be >= 63, got 5"),
    ("plan", SPEC | {"unknown": 1}, "spec.unknown: Extra inputs are not permitted"),
    (
        "plan",
        {"cluster": CLUSTER, "profile": {"name": "m", "layers": [{"name": "a"}]}, "planner": "dp"},
        "layers[0].op: missing",
    ),
    (
        "compare",
        {"cluster": "local-hetero", "model": "alexnet", "planners": ["dp", "zz"]},
        "planners: unknown planner 'zz'",
    ),
    ("profile", {"model": "alexnet", "address": "auto"}, "address: only applies with measure"),
    ("run", {"plan": {"global_batch": 8}, "model": "alexnet", "cluster": CLUSTER}, "stages"),
    (
        "run",
        {
            "plan": {
                "global_batch": 8,
                "stages": [
                    {"layers": [0, 3], "devices": ["n0/fast:0"], "microbatch": 4},
                    {"layers": [3, 8], "devices": ["n1/mid:0"], "microbatch": 8},
                ],
            },
            "model": "digits_cnn",
            "cluster": "local-hetero",
            "engine": "torch-pipelining",
            "emulate": False,
        },
        "engine torch-pipelining cannot run this plan: unequal microbatches [4, 8]",
    ),
    ("plan", {k: v for k, v in SPEC.items() if k != "planner"}, "spec.planner: Field required"),
]


@pytest.mark.parametrize(("kind", "spec", "message"), BAD_SPECS)
def test_a_bad_spec_is_422_naming_the_field_and_nothing_is_queued(
    app_client: TestClient, fake_backend: FakeBackend, kind: str, spec: Any, message: str
) -> None:
    r = app_client.post("/v1/jobs", json={"kind": kind, "spec": spec})
    assert r.status_code == 422, r.text
    assert message in r.json()["detail"]
    assert fake_backend.submitted == []
    assert app_client.get("/v1/jobs").json()["items"] == []


def test_limits_are_422_within_a_second(app_client: TestClient) -> None:
    start = time.perf_counter()
    r = app_client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC | {"cluster": BIG_NODE}})
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "spec.cluster.nodes[0].devices: 100000000 devices is over the limit of 4096"
    )
    plan = {
        "global_batch": 10**18,
        "stages": [{"layers": [0, 3], "devices": ["n0/t4:0"], "microbatch": 1}],
    }
    r = app_client.post("/v1/simulate", json={"profile": PROFILE, "cluster": CLUSTER, "plan": plan})
    assert r.status_code == 422
    assert (
        r.json()["detail"] == "plan.global_batch: 1000000000000000000 is over the limit of 16777216"
    )
    r = app_client.post(
        "/v1/simulate", json={"profile": PROFILE, "cluster": BIG_NODE, "plan": plan}
    )
    assert r.status_code == 422 and "over the limit of 4096" in r.json()["detail"]
    wide = {**BIG_NODE, "nodes": [{"name": f"n{i}", "devices": {"cpu": 4096}} for i in range(20)]}
    r = app_client.post("/v1/simulate", json={"profile": PROFILE, "cluster": wide, "plan": plan})
    assert r.json()["detail"] == "cluster.nodes: 81920 devices in all is over the limit of 65536"
    long = {
        "global_batch": 65536,
        "stages": [
            {"layers": [i, i + 1], "devices": [f"n0/t4:{i}"], "microbatch": 1} for i in range(32)
        ],
    }
    r = app_client.post("/v1/simulate", json={"profile": PROFILE, "cluster": CLUSTER, "plan": long})
    assert r.status_code == 422
    assert r.json()["detail"] == (
        "plan.stages: 2097152 microbatches over all stages is over the limit of 65536"
    )
    assert time.perf_counter() - start < 1.0


def test_simulate_answers_the_estimate(app_client: TestClient) -> None:
    n = len(PROFILE["layers"])
    plan = {
        "global_batch": 8,
        "stages": [{"layers": [0, n], "devices": ["n0/t4:0"], "microbatch": 2}],
    }
    r = app_client.post("/v1/simulate", json={"profile": PROFILE, "cluster": CLUSTER, "plan": plan})
    assert r.status_code == 200, r.text
    assert r.json()["batch_time_s"] > 0
    r = app_client.post("/v1/simulate", json={"profile": PROFILE, "cluster": CLUSTER})
    assert r.status_code == 422 and r.json()["detail"].startswith("plan, uniform:")


def test_an_oversized_body_is_413(tmp_path: Path, fake_backend: FakeBackend) -> None:
    settings = make_settings(tmp_path, max_body_bytes=1000)
    with TestClient(create_app(settings, backend=fake_backend), headers=AUTH) as client:
        r = client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC | {"name": "x" * 2000}})
        assert r.status_code == 413
        assert r.json()["detail"].endswith("is over the limit of 1000 bytes")
        chunks = (b" " * 100 for _ in range(20))
        r = client.post(
            "/v1/simulate", content=chunks, headers={"content-type": "application/json"}
        )
        assert r.status_code == 413


def test_readyz_names_what_does_not_answer(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    assert app_client.get("/readyz").json()["status"] == "ready"
    fake_backend.not_ready = "Ray at http://127.0.0.1:1: connection refused"
    r = app_client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["detail"] == "not ready: backend: Ray at http://127.0.0.1:1: connection refused"


def test_metrics_count_requests_jobs_and_events(app_client: TestClient) -> None:
    jid = _submit(app_client)["id"]
    _event(app_client, jid, 0, "progress", {})
    _event(app_client, jid, 0, "progress", {})
    text = app_client.get("/metrics").text
    assert 'pipeplan_http_requests_total{method="POST",route="/v1/jobs",status="201"} 1.0' in text
    assert 'route="/v1/jobs/{job_id}/events"' in text
    assert 'pipeplan_jobs{kind="plan",state="running"} 1.0' in text
    assert 'pipeplan_events_ingested_total{type="progress"} 1.0' in text
    assert "pipeplan_http_request_duration_seconds_bucket" in text


def test_catalog_names_planners_models_and_presets(app_client: TestClient) -> None:
    planners = {p["name"]: p for p in app_client.get("/v1/planners").json()}
    assert "dp" in planners and "max_states" in planners["dp"]["options"]
    assert "alexnet" in [m["name"] for m in app_client.get("/v1/models").json()]
    clusters = {c["name"]: c for c in app_client.get("/v1/clusters").json()}
    assert clusters["local-hetero"]["cluster"]["nodes"]


def test_reconcile_fails_a_job_whose_work_ended_without_a_result(
    tmp_path: Path, fake_backend: FakeBackend
) -> None:
    settings = make_settings(tmp_path)
    store = Store(settings.database_url)
    store.create_tables()
    dead = store.create_job(JobKind.PLAN, SPEC, None, "h").id
    alive = store.create_job(JobKind.PLAN, SPEC, None, "h").id
    done = store.create_job(JobKind.PLAN, SPEC, None, "h").id
    for job_id in (dead, alive, done):  # handed to the backend (else the queue starts them)
        store.set_ray_job_id(job_id, job_id)
    fake_backend.statuses[dead] = BackendStatus(BackendState.FAILED, "driver exited with 137")
    fake_backend.log_text[dead] = "x" * 5000 + "Killed\n"
    fake_backend.statuses[alive] = BackendStatus(BackendState.RUNNING)
    fake_backend.statuses[done] = BackendStatus(BackendState.SUCCEEDED)
    with TestClient(create_app(settings, store, fake_backend), headers=AUTH) as client:
        got = client.get(f"/v1/jobs/{dead}").json()
        assert got["state"] == "failed"
        assert got["error"].startswith(
            "the job's work ended (failed) without a result: driver exited with 137\n"
        )
        assert got["error"].endswith("Killed\n") and len(got["error"]) < 2200
        assert client.get(f"/v1/jobs/{alive}").json()["state"] == "queued"
        assert client.get(f"/v1/jobs/{done}").json()["state"] == "failed"
    assert reconcile(store, fake_backend) == []


def test_a_job_whose_work_dies_while_the_service_runs_ends_failed(
    tmp_path: Path, fake_backend: FakeBackend
) -> None:
    settings = make_settings(tmp_path, reconcile_every_s=0.05)
    with TestClient(create_app(settings, backend=fake_backend), headers=AUTH) as client:
        jid = _submit(client)["id"]
        _event(client, jid, 0, "progress", {"evaluations": 1})
        fake_backend.statuses[jid] = BackendStatus(BackendState.FAILED, "driver died")
        deadline = time.monotonic() + 10
        while client.get(f"/v1/jobs/{jid}").json()["state"] != "failed":
            assert time.monotonic() < deadline, "the job was not reconciled"
            time.sleep(0.05)
        assert "driver died" in client.get(f"/v1/jobs/{jid}").json()["error"]
