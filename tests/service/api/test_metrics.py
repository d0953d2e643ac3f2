"""``GET /metrics`` scraped and parsed as Prometheus does (``prometheus_client.parser``): the
HTTP, jobs and events families, each job's best value and evaluation count read from the
store at scrape time, and the bound on which jobs those are."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pipeplan.service.api.metrics import CONTENT_TYPE, RECENT_JOBS, RUNNING_JOBS, progress_window
from pipeplan.service.api.schemas import EventIn, EventType, JobKind, JobState
from pipeplan.service.api.store import Store

SPEC = {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"}


def scrape(client: TestClient) -> dict[str, list[Sample]]:
    """Every family of ``/metrics`` by name, with its samples."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == CONTENT_TYPE
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def values(samples: list[Sample], name: str, **labels: str) -> list[float]:
    """Values of the samples called ``name`` whose labels include ``labels``."""
    return [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]


def by_job(samples: list[Sample]) -> dict[str, float]:
    return {s.labels["job"]: s.value for s in samples}


def submit(client: TestClient) -> str:
    r = client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def post(client: TestClient, job_id: str, seq: int, type_: str, data: Any) -> None:
    r = client.post(f"/v1/jobs/{job_id}/events", json={"seq": seq, "type": type_, "data": data})
    assert r.status_code == 200, r.text


def add_job(store: Store, progress: Any = None, end: EventType | None = None) -> str:
    """A job straight in the store: queued, or running with ``progress``, or ended."""
    job = store.create_job(JobKind.PLAN, SPEC, None, "hash")
    if progress is not None:
        store.add_event(job.id, EventIn(seq=0, type=EventType.PROGRESS, data=progress))
    if end is not None:
        store.add_event(job.id, EventIn(seq=1, type=end, data={"error": "boom"}))
    return job.id


def test_every_family_parses_with_the_requests_jobs_and_events_counted(
    app_client: TestClient,
) -> None:
    jid = submit(app_client)
    post(app_client, jid, 0, "progress", {"evaluations": 3, "best_value": 0.25})
    post(app_client, jid, 0, "progress", {"evaluations": 3, "best_value": 0.25})  # a repeat
    post(app_client, jid, 1, "evaluation", {"plan": {}, "value": 0.25, "source": "simulated"})
    app_client.get("/healthz")
    got = scrape(app_client)

    requests = got["pipeplan_http_requests"]
    assert values(requests, "pipeplan_http_requests_total", route="/v1/jobs", status="201") == [1.0]
    events_route = "/v1/jobs/{job_id}/events"
    assert values(requests, "pipeplan_http_requests_total", route=events_route) == [3.0]
    latency = got["pipeplan_http_request_duration_seconds"]
    count = "pipeplan_http_request_duration_seconds_count"
    assert values(latency, count, route="/healthz", method="GET") == [1.0]
    assert values(got["pipeplan_jobs"], "pipeplan_jobs", state="running", kind="plan") == [1.0]
    ingested = got["pipeplan_events_ingested"]
    assert values(ingested, "pipeplan_events_ingested_total", type="progress") == [1.0]
    assert values(ingested, "pipeplan_events_ingested_total", type="evaluation") == [1.0]
    assert by_job(got["pipeplan_job_best_value"]) == {jid: 0.25}
    assert by_job(got["pipeplan_job_evaluations"]) == {jid: 3.0}
    assert got["pipeplan_job_best_value"][0].labels == {"job": jid, "kind": "plan"}


def test_progress_is_read_from_the_store_at_each_scrape(
    app_client: TestClient, store: Store
) -> None:
    running = add_job(store, {"evaluations": 40, "best_value": 0.125, "elapsed_s": 2.0})
    ended = add_job(store, {"evaluations": 7, "best_value": 2.5}, end=EventType.ERROR)
    queued = add_job(store)
    nothing_feasible = add_job(store, {"evaluations": 12, "best_value": None})
    malformed = add_job(store, {"evaluations": "many", "best_value": True})
    got = scrape(app_client)
    assert by_job(got["pipeplan_job_best_value"]) == {running: 0.125, ended: 2.5}
    assert by_job(got["pipeplan_job_evaluations"]) == {
        running: 40.0,
        ended: 7.0,
        nothing_feasible: 12.0,
    }
    assert queued not in by_job(got["pipeplan_job_evaluations"])
    assert malformed not in by_job(got["pipeplan_job_evaluations"])

    store.add_event(
        running,
        EventIn(seq=1, type=EventType.PROGRESS, data={"evaluations": 80, "best_value": 0.1}),
    )
    got = scrape(app_client)
    assert by_job(got["pipeplan_job_best_value"])[running] == 0.1
    assert by_job(got["pipeplan_job_evaluations"])[running] == 80.0


def test_a_scrape_reports_the_newest_jobs_and_the_running_ones(store: Store) -> None:
    """Oldest first: two running jobs, two finished ones, then the two newest (running)."""
    old_running = [add_job(store, {"evaluations": 1}) for _ in range(2)]
    old_finished = [add_job(store, {"evaluations": 1}, end=EventType.ERROR) for _ in range(2)]
    newest = [add_job(store, {"evaluations": 1}) for _ in range(2)]
    assert store.get_job(old_finished[0]).state is JobState.FAILED

    ids = [j.id for j in progress_window(store, recent=2, running=3)]
    assert ids == [newest[1], newest[0], old_running[1]]  # the newest, then running ones
    ids = [j.id for j in progress_window(store, recent=3, running=1)]
    assert ids == [newest[1], newest[0], old_finished[1]]
    ids = [j.id for j in progress_window(store, recent=1, running=4)]
    assert ids == [newest[1], newest[0], old_running[1], old_running[0]]
    assert [j.id for j in progress_window(store, recent=0, running=0)] == []
    assert len(progress_window(store)) == 6  # the defaults hold all of these
    assert RECENT_JOBS >= 1 and RUNNING_JOBS >= 1


def test_old_finished_jobs_leave_the_scrape(app_client: TestClient, store: Store) -> None:
    first = add_job(store, {"evaluations": 5, "best_value": 1.0}, end=EventType.ERROR)
    for _ in range(RECENT_JOBS):
        add_job(store)
    assert first not in by_job(scrape(app_client)["pipeplan_job_evaluations"])
