"""A job that waits for devices (API.md, "The queue"): a ``waiting`` event puts it back to
``queued`` with ``waiting_for``; any later event makes it ``running`` again and clears it;
the API, the CLI's job lines and the dashboard show the reason."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from rich.console import Console
from rich.table import Table

from pipeplan.service.api.app import create_app
from pipeplan.service.api.auth import hash_token
from pipeplan.service.api.backend import BackendState, BackendStatus
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.schemas import EventIn, EventType, Job, JobKind, JobPage, JobState
from pipeplan.service.api.store import Store
from pipeplan.service.cli.job_view import job_lines, jobs_table
from pipeplan.service.web.format import waiting
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

SPEC: dict[str, Any] = {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"}
HELD: dict[str, Any] = {"devices": ["n1/mid:0", "n1/mid:1"], "held_by": ["pp-0123456789abcdef"]}


def _event(seq: int, type_: EventType, data: dict[str, Any]) -> EventIn:
    return EventIn(seq=seq, type=type_, data=data)


def test_waiting_queues_the_job_and_the_next_event_runs_it(db: Store) -> None:
    job = db.create_job(JobKind.PLAN, SPEC, None, hash_token("t"))
    db.add_event(job.id, _event(0, EventType.PROGRESS, {"evaluations": 0}))
    assert db.get_job(job.id).state is JobState.RUNNING
    db.add_event(job.id, _event(1, EventType.WAITING, HELD))
    waiting = db.get_job(job.id)
    assert waiting.state is JobState.QUEUED and waiting.waiting_for == HELD
    assert waiting.started_at is None
    db.add_event(job.id, _event(2, EventType.WAITING, {"devices": [], "waited_s": 3.5}))
    running = db.get_job(job.id)
    assert running.state is JobState.RUNNING and running.waiting_for is None
    assert running.started_at is not None
    db.add_event(job.id, _event(3, EventType.WAITING, HELD))
    db.add_event(job.id, _event(4, EventType.PROGRESS, {"evaluations": 1}))
    assert db.get_job(job.id).waiting_for is None
    assert db.get_job(job.id).state is JobState.RUNNING


def test_the_reason_shows_in_the_api_and_the_job_lines(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    job_id = app_client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC}).json()["id"]
    auth = {"Authorization": f"Bearer {fake_backend.token_of(job_id)}"}
    event = {"seq": 0, "type": "waiting", "data": HELD}
    assert app_client.post(f"/v1/jobs/{job_id}/events", json=event, headers=auth).is_success
    doc = app_client.get(f"/v1/jobs/{job_id}").json()
    assert doc["state"] == "queued" and doc["waiting_for"] == HELD
    queued = app_client.get("/v1/jobs", params={"state": "queued"}).json()["items"]
    assert [j["id"] for j in queued] == [job_id]
    text = "\n".join(job_lines(app_client_job(app_client, job_id)))
    assert "waiting for     2 x mid on n1, held by job pp-0123456789abcdef" in text


def app_client_job(client: TestClient, job_id: str) -> Job:
    return Job.model_validate(client.get(f"/v1/jobs/{job_id}").json())


def test_the_reason_reads_as_counts_by_type_and_node() -> None:
    two = {"devices": ["n0/fast:0", "n1/mid:0", "n1/mid:1"], "held_by": ["a", "b"]}
    assert waiting(two) == "1 x fast on n0 and 2 x mid on n1, held by jobs a, b"
    assert waiting({"devices": ["n0/fast:0"], "held_by": []}) == (
        "1 x fast on n0, held by other actors"
    )
    assert waiting(None) == "" and waiting({"devices": []}) == ""


# --- the queue's order ------------------------------------------------------------------------

MEASURE = {"model": "alexnet", "cluster": "local-hetero", "measure": True}
"""A job that runs on the devices (a measured profile)."""


def _post(
    client: TestClient, spec: dict[str, object], kind: str = "profile", **extra: object
) -> str:
    r = client.post("/v1/jobs", json={"kind": kind, "spec": spec, **extra})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _running(client: TestClient, backend: FakeBackend, job_id: str) -> None:
    """The job's work posts its first event: it runs (its devices reserved)."""
    auth = {"Authorization": f"Bearer {backend.token_of(job_id)}"}
    event = {"seq": 0, "type": "progress", "data": {"evaluations": 0}}
    assert client.post(f"/v1/jobs/{job_id}/events", json=event, headers=auth).is_success


def _started(backend: FakeBackend) -> list[str]:
    return [s.job_id for s in backend.submitted]


def test_device_jobs_start_one_at_a_time_in_priority_then_age_order(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    first = _post(app_client, MEASURE)
    low = _post(app_client, MEASURE)
    high = _post(app_client, MEASURE, priority=5)
    planned = _post(app_client, SPEC, kind="plan")  # needs no devices: starts at once
    assert _started(fake_backend) == [first, planned]
    queue = app_client.get("/v1/queue").json()
    assert [j["id"] for j in queue] == [first, planned, high, low]
    assert [j["priority"] for j in queue] == [0, 0, 5, 0]
    assert queue[2]["waiting_for"] == {"behind": [first]} and queue[2]["ray_job_id"] is None
    assert queue[3]["waiting_for"] == {"behind": [first, high]}
    _running(app_client, fake_backend, first)
    app_client.get("/v1/queue")  # the service's loop starts the next in its turn
    assert _wait_for(lambda: _started(fake_backend) == [first, planned, high])
    assert app_client.get(f"/v1/jobs/{low}").json()["waiting_for"] == {"behind": [high]}
    lines = job_lines(app_client_job(app_client, low))
    assert "waiting for     its turn, behind " + high in lines
    table = _text(jobs_table(JobPage.model_validate(app_client.get("/v1/jobs").json())))
    assert "queued (1 ahead)" in table
    _running(app_client, fake_backend, high)
    assert _wait_for(lambda: _started(fake_backend)[-1] == low)
    assert app_client.get(f"/v1/jobs/{low}").json()["waiting_for"] is None


def test_a_held_job_cancelled_never_starts_and_a_deadline_fails_it(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    first = _post(app_client, MEASURE)
    cancelled = _post(app_client, MEASURE)
    late = _post(app_client, MEASURE, deadline_s=0.2)
    assert app_client.post(f"/v1/jobs/{cancelled}/cancel").json()["state"] == "cancelled"
    assert fake_backend.stopped == []
    assert _wait_for(lambda: app_client.get(f"/v1/jobs/{late}").json()["state"] == "failed")
    assert app_client.get(f"/v1/jobs/{late}").json()["error"] == (
        "deadline: not started within deadline_s=0.2 s"
    )
    _running(app_client, fake_backend, first)
    assert _started(fake_backend) == [first]
    r = app_client.post("/v1/jobs", json={"kind": "profile", "spec": MEASURE, "priority": 10**6})
    assert r.status_code == 422 and "priority" in r.text


def test_held_jobs_outlive_a_restart_and_start_in_turn(
    tmp_path: Path, fake_backend: FakeBackend, fit_worker: FitWorker
) -> None:
    settings = make_settings(tmp_path, queue_every_s=0)
    with TestClient(
        create_app(settings, backend=fake_backend, fit_worker=fit_worker), headers=AUTH
    ) as c:
        first, second = _post(c, MEASURE), _post(c, MEASURE)
        assert _started(fake_backend) == [first]
    fake_backend.statuses[first] = BackendStatus(BackendState.SUCCEEDED)
    with TestClient(
        create_app(settings, backend=fake_backend, fit_worker=fit_worker), headers=AUTH
    ) as c:
        # the first ended without a result while the service was down: reconcile fails it,
        # and the queue starts the second
        assert c.get(f"/v1/jobs/{first}").json()["state"] == "failed"
        assert _started(fake_backend) == [first, second]
        token = fake_backend.token_of(second)
        assert c.get(f"/v1/jobs/{second}", headers={"Authorization": f"Bearer {token}"}).is_success


def _text(table: Table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def _wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _run_on(*devices: str) -> dict[str, Any]:
    """A ``run`` job of digits_cnn in one stage on ``devices`` of local-hetero."""
    stage = {"layers": [0, 8], "devices": list(devices), "microbatch": 8}
    plan = {"global_batch": 16, "stages": [stage]}
    return {"plan": plan, "model": "digits_cnn", "cluster": "local-hetero"}


def test_runs_on_other_devices_start_beside_each_other_and_competitors_wait(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    first = _post(app_client, _run_on("n0/fast:0"), kind="run")
    beside = _post(app_client, _run_on("n1/mid:0"), kind="run")
    rival = _post(app_client, _run_on("n0/fast:0", "n2/slow:0"), kind="run")
    same_type = _post(
        app_client, _run_on("n2/slow:1"), kind="run"
    )  # n2/slow, as rival: the same pair
    unknown = _post(app_client, MEASURE)  # a measured profile: its devices are not known
    assert _started(fake_backend) == [first, beside]
    assert app_client.get(f"/v1/jobs/{rival}").json()["waiting_for"] == {"behind": [first]}
    assert app_client.get(f"/v1/jobs/{same_type}").json()["waiting_for"] == {"behind": [rival]}
    assert app_client.get(f"/v1/jobs/{unknown}").json()["waiting_for"] == {
        "behind": [first, beside, rival, same_type]
    }
    _running(app_client, fake_backend, first)
    assert _wait_for(lambda: _started(fake_backend) == [first, beside, rival])
