"""Users' tokens and their roles (API.md, "Users"): made, listed and revoked by an admin,
stored hashed; a viewer reads, a submitter sees and cancels only its own jobs, an admin
everything; unknown, expired and revoked tokens are 401; the open-jobs limit is 429. One test
walks every route of the OpenAPI document with every role."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pipeplan.service.api.app import create_app
from pipeplan.service.api.auth import hash_token
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.schemas import JobKind
from pipeplan.service.api.store import Store
from pipeplan.service.api.store.database import now
from pipeplan.service.api.tokens import Role
from tests.service.api.conftest import API_TOKEN, AUTH, FakeBackend, make_settings
from tests.service.api.test_client import cli_on

SPEC = {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"}


def _make(client: TestClient, name: str, role: str, **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/tokens", json={"name": name, "role": role, **extra})
    assert r.status_code == 201, r.text
    doc: dict[str, Any] = r.json()
    return doc


def _as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _submit(client: TestClient, headers: dict[str, str]) -> str:
    r = client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC}, headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_a_token_is_shown_once_and_stored_hashed(app_client: TestClient, store: Store) -> None:
    made = _make(app_client, "alice", "submitter")
    assert made["id"].startswith("tk-") and made["role"] == "submitter" and made["valid"]
    assert made["created_by"] == "bootstrap"
    listed = app_client.get("/v1/tokens").json()
    assert [t["name"] for t in listed] == ["alice"] and "token" not in listed[0]
    with store.engine.connect() as conn:
        rows = conn.execute(store.tokens.select()).all()
    assert [r._mapping["secret_hash"] for r in rows] == [hash_token(made["token"])]
    assert made["token"] not in str([tuple(r) for r in rows])


def test_bad_token_requests_name_the_field(app_client: TestClient) -> None:
    r = app_client.post("/v1/tokens", json={"name": "bob", "role": "root"})
    assert r.status_code == 422 and "role" in r.text and "root" in r.text
    r = app_client.post("/v1/tokens", json={"name": "a b", "role": "viewer"})
    assert r.status_code == 422 and "name" in r.text
    past = (now() - timedelta(hours=1)).isoformat()
    r = app_client.post("/v1/tokens", json={"name": "c", "role": "viewer", "expires_at": past})
    assert r.status_code == 422 and "expires_at" in r.text and "must be in the future" in r.text
    r = app_client.delete("/v1/tokens/tk-0123456789ab")
    assert r.status_code == 404 and r.json()["detail"] == "token 'tk-0123456789ab': no such token"


def test_a_submitter_sees_and_cancels_its_own_jobs_only(
    app_client: TestClient, anon_client: TestClient, fake_backend: FakeBackend
) -> None:
    alice = _as(_make(app_client, "alice", "submitter")["token"])
    bob = _as(_make(app_client, "bob", "submitter")["token"])
    mine, theirs = _submit(anon_client, alice), _submit(anon_client, bob)
    admins = _submit(app_client, AUTH)
    assert anon_client.get(f"/v1/jobs/{mine}", headers=alice).json()["created_by"].startswith("tk-")
    listed = anon_client.get("/v1/jobs", headers=alice).json()["items"]
    assert [j["id"] for j in listed] == [mine]
    for path in (f"/v1/jobs/{theirs}", f"/v1/jobs/{theirs}/events", f"/v1/jobs/{theirs}/logs"):
        r = anon_client.get(path, headers=alice)
        assert r.status_code == 404 and r.json()["detail"] == f"job {theirs!r}: no such job"
    r = anon_client.post(f"/v1/jobs/{theirs}/cancel", headers=alice)
    assert r.status_code == 404 and fake_backend.stopped == []
    assert anon_client.post(f"/v1/jobs/{mine}/cancel", headers=alice).status_code == 200
    everyone = {j["id"] for j in app_client.get("/v1/jobs").json()["items"]}
    assert everyone == {mine, theirs, admins}
    assert app_client.get(f"/v1/jobs/{admins}").json()["created_by"] == "bootstrap"


def test_a_viewer_reads_everything_and_changes_nothing(
    app_client: TestClient, anon_client: TestClient
) -> None:
    viewer = _as(_make(app_client, "vic", "viewer")["token"])
    job = _submit(app_client, AUTH)
    assert anon_client.get(f"/v1/jobs/{job}", headers=viewer).status_code == 200
    assert [j["id"] for j in anon_client.get("/v1/jobs", headers=viewer).json()["items"]] == [job]
    r = anon_client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC}, headers=viewer)
    assert r.status_code == 403
    assert r.json()["detail"] == (
        "Authorization: role 'viewer' may only read; POST /v1/jobs needs 'submitter' or 'admin'"
    )
    assert anon_client.post(f"/v1/jobs/{job}/cancel", headers=viewer).status_code == 403
    r = anon_client.get("/v1/tokens", headers=viewer)
    assert r.status_code == 403 and "needs 'admin'" in r.json()["detail"]


def test_expired_and_revoked_tokens_are_401_naming_why(
    app_client: TestClient, anon_client: TestClient, store: Store
) -> None:
    made = _make(app_client, "carol", "submitter")
    headers = _as(made["token"])
    assert anon_client.get("/v1/jobs", headers=headers).status_code == 200
    gone = app_client.delete(f"/v1/tokens/{made['id']}").json()
    assert gone["revoked_at"] is not None and not gone["valid"]
    r = anon_client.get("/v1/jobs", headers=headers)
    assert r.status_code == 401
    assert r.json()["detail"] == f"Authorization: token 'carol' ({made['id']}) was revoked"
    old = store.create_token("dave", Role.VIEWER, hash_token("dave-secret"), now())
    r = anon_client.get("/v1/jobs", headers=_as("dave-secret"))
    assert r.status_code == 401 and f"token 'dave' ({old.id}) expired at" in r.json()["detail"]


def test_over_the_open_jobs_limit_is_429(
    tmp_path: Path, fake_backend: FakeBackend, fit_worker: FitWorker
) -> None:
    settings = make_settings(tmp_path, max_open_jobs_per_token=2)
    app = create_app(settings, backend=fake_backend, fit_worker=fit_worker)
    with TestClient(app, headers=AUTH) as client:
        alice = _as(_make(client, "alice", "submitter")["token"])
        first = _submit(client, alice)
        _submit(client, alice)
        r = client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC}, headers=alice)
        assert r.status_code == 429
        assert r.json()["detail"].startswith(
            "max_open_jobs_per_token: token 'alice' has 2 jobs queued or running, the limit is 2"
        )
        _submit(client, AUTH)  # another token's count is its own
        client.post(f"/v1/jobs/{first}/cancel", headers=alice)
        _submit(client, alice)


def test_tokens_and_owners_are_kept_on_either_database(db: Store) -> None:
    alice = db.create_token("alice", Role.SUBMITTER, hash_token("a"), created_by="bootstrap")
    assert db.token_by_hash(hash_token("a")) == alice
    job = db.create_job(JobKind.PLAN, SPEC, None, hash_token("j"), created_by=alice.id)
    assert db.open_jobs_of(alice.id) == 1 and db.open_jobs_of("tk-other") == 0
    assert db.job_of_token(hash_token("j")) == job.id
    assert [j.id for j in db.list_jobs(created_by=alice.id).jobs] == [job.id]
    assert db.list_jobs(created_by="tk-other").jobs == []
    revoked = db.revoke_token(alice.id)
    assert revoked.revoked_at is not None and db.revoke_token(alice.id) == revoked


# --- every route, every role ----------------------------------------------------------------


def _routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path template) of every operation in the OpenAPI document that needs a
    token (all but ``/healthz``)."""
    return [
        (method.upper(), path)
        for path, item in app.openapi()["paths"].items()
        for method, operation in item.items()
        if method in ("get", "post", "put", "patch", "delete") and operation.get("security")
    ]


def _fill(path: str, values: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), "x"), path)


@pytest.mark.parametrize("role", ["viewer", "submitter", "admin", "job"])
def test_every_route_answers_each_role_as_its_rights_say(
    app: FastAPI,
    app_client: TestClient,
    anon_client: TestClient,
    fake_backend: FakeBackend,
    role: str,
) -> None:
    other = _submit(app_client, AUTH)
    if role == "job":
        mine = _submit(app_client, AUTH)
        headers = _as(fake_backend.token_of(mine))
    else:
        headers = _as(_make(app_client, f"u-{role}", role)["token"])
        mine = _submit(anon_client, headers) if role != "viewer" else other
    victim = _make(app_client, "victim", "viewer")["id"]
    values = {"job_id": other, "token_id": victim, "name": "local-hetero"}
    routes = _routes(app)
    assert ("POST", "/v1/tokens") in routes and ("GET", "/v1/jobs") in routes
    assert ("GET", "/healthz") not in routes and len(routes) >= 15
    for method, template in routes:
        path = _fill(template, values)
        status = anon_client.request(method, path, headers=headers, json={}).status_code
        own = anon_client.request(
            method, _fill(template, values | {"job_id": mine}), headers=headers, json={}
        ).status_code
        tokens, job_route = template.startswith("/v1/tokens"), "{job_id}" in template
        write = method != "GET"
        if role == "admin":
            denied = False
        elif role == "viewer":
            denied = write or tokens
        elif role == "submitter":
            denied = tokens
        else:  # a job's token: its own job's read and events only
            ours = template in ("/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events")
            own_ok = ours and (method == "GET" if template.endswith("}") else method == "POST")
            assert (own != 403) == own_ok, (method, template, own)
            denied = True
        assert status != 401, (role, method, path)
        if denied:
            assert status == 403, (role, method, path, status)
        elif role == "submitter" and job_route:
            assert status == 404, (role, method, path, status)  # another's job
            found = own not in (401, 403, 404) or template.endswith("/{name}")  # no such file
            assert own not in (401, 403) and found, (role, method, template, own)
        else:
            assert status not in (401, 403), (role, method, path, status)


# --- pipeplan tokens ------------------------------------------------------------------------


def test_the_tokens_commands_make_list_and_revoke(
    app_client: TestClient, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", API_TOKEN)
    cli = cli_on(app_client, monkeypatch, capsys)
    code, out, err = cli("tokens", "create", "erin", "--role", "viewer", "--expires-in", "2")
    assert code == 0, err
    token_id, secret = err.split()[0], out.strip()
    assert token_id.startswith("tk-") and "erin (viewer)" in err
    assert anon_get(app_client, secret).status_code == 200
    code, out, _ = cli("tokens", "ls", "--json")
    listed = json.loads(out)
    assert code == 0 and [(t["id"], t["role"], t["valid"]) for t in listed] == [
        (token_id, "viewer", True)
    ]
    assert listed[0]["expires_at"] is not None
    assert cli("tokens", "revoke", token_id)[1].strip() == f"{token_id} erin revoked"
    assert anon_get(app_client, secret).status_code == 401
    code, _, err = cli("tokens", "create", "frank", "--role", "owner")
    assert code == 2 and "owner" in err
    code, _, err = cli("tokens", "create", "frank", "--expires-in", "-1")
    assert code == 2 and "--expires-in" in err and "-1" in err
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", secret)
    code, _, err = cli("tokens", "ls")
    assert code == 2 and "revoked" in err


def anon_get(client: TestClient, token: str) -> Any:
    return client.get("/v1/jobs", headers=_as(token))
