"""A succeeded plan job's Gantt chart (API.md, "Artifacts"): ``gantt.png``, the cost
model's schedule of its plan, is drawn into the job's folder the first time its artifacts
are read and served as a PNG; a job still running, or whose plan the service cannot
simulate, has none."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from pipeplan.service.api.settings import Settings
from tests.core.test_formats import PROFILE
from tests.service.api.conftest import FakeBackend

SPEC = {"cluster": "local-hetero", "profile": PROFILE, "planner": "dp", "batch": 8}
PLAN = {
    "global_batch": 8,
    "stages": [
        {"layers": [0, 2], "devices": ["n0/fast:0"], "microbatch": 4},
        {"layers": [2, 3], "devices": ["n1/mid:0"], "microbatch": 4},
    ],
}


def finish(client: TestClient, fake: FakeBackend, plan: dict[str, Any]) -> str:
    job_id: str = client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC}).json()["id"]
    assert [a["name"] for a in client.get(f"/v1/jobs/{job_id}/artifacts").json()] == []
    auth = {"Authorization": f"Bearer {fake.token_of(job_id)}"}
    event = {"seq": 0, "type": "result", "data": {"plan": plan, "estimate": {}}}
    assert client.post(f"/v1/jobs/{job_id}/events", json=event, headers=auth).is_success
    return job_id


def test_a_succeeded_plan_job_has_its_gantt_chart(
    app_client: TestClient, fake_backend: FakeBackend, api_settings: Settings
) -> None:
    job_id = finish(app_client, fake_backend, PLAN)
    listed = app_client.get(f"/v1/jobs/{job_id}/artifacts").json()
    assert [(a["name"], a["kind"]) for a in listed] == [
        ("plan.json", "result"),
        ("gantt.png", "file"),
    ]
    png = app_client.get(f"/v1/jobs/{job_id}/artifacts/gantt.png")
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
    assert png.headers["content-type"] == "image/png"
    assert listed[1]["size_bytes"] == len(png.content)
    assert [p.name for p in (api_settings.jobs_root / job_id).iterdir()] == ["gantt.png"]


def test_a_plan_the_service_cannot_simulate_has_no_chart(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    wrong = {**PLAN, "stages": [{"layers": [0, 3], "devices": ["n9/none:0"]}]}
    job_id = finish(app_client, fake_backend, wrong)
    names = [a["name"] for a in app_client.get(f"/v1/jobs/{job_id}/artifacts").json()]
    assert names == ["plan.json"]
    assert app_client.get(f"/v1/jobs/{job_id}/artifacts/gantt.png").status_code == 404
