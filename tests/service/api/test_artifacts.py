"""A job's artifacts (API.md, "Artifacts"): ``plan.json`` from its result and the files of
its folder, listed and served; a name outside the folder is 404; a submitter sees only its
own job's."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pipeplan.service.api.settings import Settings
from tests.service.api.conftest import FakeBackend

SPEC = {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"}
PLAN = {"global_batch": 8, "stages": [{"layers": [0, 8], "devices": ["n0/fast:0"]}]}


def test_a_jobs_files_and_its_plan_are_listed_and_served(
    app_client: TestClient, fake_backend: FakeBackend, api_settings: Settings
) -> None:
    job_id = app_client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC}).json()["id"]
    assert app_client.get(f"/v1/jobs/{job_id}/artifacts").json() == []
    folder = api_settings.jobs_root / job_id
    (folder / "checkpoints" / "step-3").mkdir(parents=True)
    (folder / "checkpoints" / "step-3" / "manifest.json").write_text('{"step": 3}')
    (api_settings.jobs_root / "secret.txt").write_text("not the job's")
    auth = {"Authorization": f"Bearer {fake_backend.token_of(job_id)}"}
    event = {"seq": 0, "type": "result", "data": {"plan": PLAN, "estimate": {}}}
    assert app_client.post(f"/v1/jobs/{job_id}/events", json=event, headers=auth).is_success
    listed = app_client.get(f"/v1/jobs/{job_id}/artifacts").json()
    assert [(a["name"], a["kind"]) for a in listed] == [
        ("plan.json", "result"),
        ("checkpoints/step-3/manifest.json", "file"),
    ]
    assert listed[1]["size_bytes"] == len('{"step": 3}')
    assert app_client.get(f"/v1/jobs/{job_id}/artifacts/plan.json").json() == PLAN
    r = app_client.get(f"/v1/jobs/{job_id}/artifacts/checkpoints/step-3/manifest.json")
    assert r.status_code == 200 and r.content == b'{"step": 3}'
    for name in ("../secret.txt", "%2E%2E/secret.txt", "checkpoints/%2e%2e/%2e%2e/secret.txt", "x"):
        r = app_client.get(f"/v1/jobs/{job_id}/artifacts/{name}")
        assert r.status_code == 404, (name, r.text)
    assert app_client.get("/v1/jobs/pp-0000000000000000/artifacts").status_code == 404


def test_a_submitter_reads_only_its_own_jobs_artifacts(
    app_client: TestClient, anon_client: TestClient
) -> None:
    theirs = app_client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC}).json()["id"]
    made = app_client.post("/v1/tokens", json={"name": "sam", "role": "submitter"}).json()
    r = anon_client.get(
        f"/v1/jobs/{theirs}/artifacts", headers={"Authorization": f"Bearer {made['token']}"}
    )
    assert r.status_code == 404
