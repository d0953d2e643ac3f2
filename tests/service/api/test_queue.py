"""A job that waits for devices (API.md, "The queue"): a ``waiting`` event puts it back to
``queued`` with ``waiting_for``; any later event makes it ``running`` again and clears it;
the API, the CLI's job lines and the dashboard show the reason."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pipeplan.service.api.auth import hash_token
from pipeplan.service.api.schemas import EventIn, EventType, Job, JobKind, JobState
from pipeplan.service.api.store import Store
from pipeplan.service.cli.job_view import job_lines
from pipeplan.service.web.format import waiting
from tests.service.api.conftest import FakeBackend

SPEC = {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"}
HELD = {"devices": ["n1/mid:0", "n1/mid:1"], "held_by": ["pp-0123456789abcdef"]}


def _event(seq: int, type_: EventType, data: dict[str, object]) -> EventIn:
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
