"""Auth as API.md says: no header or an unknown token 401, the API (bootstrap) token
everything, a job token its own job only (403 elsewhere); the token file (mode 0600) and the
bind check. Users' tokens and roles: ``test_users.py``."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pipeplan.service.api.settings import Settings, SettingsError, check_bind, resolve_token
from tests.service.api.conftest import FakeBackend

SPEC = {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"}


def _submit(client: TestClient) -> str:
    r = client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_no_token_or_an_unknown_one_is_401(anon_client: TestClient) -> None:
    r = anon_client.get("/v1/jobs")
    assert r.status_code == 401 and "Authorization" in r.json()["detail"]
    assert r.headers["www-authenticate"] == "Bearer"
    r = anon_client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json() == {"detail": "Authorization: unknown token"}
    assert r.headers["www-authenticate"] == "Bearer"
    assert anon_client.get("/v1/jobs", headers={"Authorization": "Basic x"}).status_code == 401
    assert anon_client.get("/healthz").status_code == 200
    assert anon_client.get("/metrics").status_code == 401


def test_a_job_token_reads_and_reports_its_own_job_only(
    app_client: TestClient, anon_client: TestClient, fake_backend: FakeBackend
) -> None:
    mine, other = _submit(app_client), _submit(app_client)
    token = fake_backend.token_of(mine)
    assert fake_backend.submitted[0].server_url == "http://127.0.0.1:18321"
    as_job = {"Authorization": f"Bearer {token}"}
    assert anon_client.get(f"/v1/jobs/{mine}", headers=as_job).json()["spec"] == SPEC
    event = {"seq": 0, "type": "progress", "data": {"evaluations": 1}}
    r = anon_client.post(f"/v1/jobs/{mine}/events", json=event, headers=as_job)
    assert r.status_code == 200 and r.json() == {"seq": 0, "stored": True}
    for method, path in [
        ("GET", f"/v1/jobs/{other}"),
        ("POST", f"/v1/jobs/{other}/events"),
        ("GET", "/v1/jobs"),
        ("POST", f"/v1/jobs/{mine}/cancel"),
        ("GET", f"/v1/jobs/{mine}/events"),
        ("GET", f"/v1/jobs/{mine}/logs"),
        ("GET", "/v1/planners"),
    ]:
        r = anon_client.request(method, path, headers=as_job, json=event)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["detail"] == f"Authorization: a job's token may not {method} {path}"
    assert app_client.get(f"/v1/jobs/{mine}").json()["state"] == "running"


def test_the_token_comes_from_the_variable_the_file_or_is_generated_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PIPEPLAN_API_TOKEN", "PIPEPLAN_API_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_token(Settings(api_token="abc")).value == "abc"
    given = tmp_path / "given"
    given.write_text("from-file\n")
    assert resolve_token(Settings(api_token_file=given)).value == "from-file"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    first = resolve_token(Settings())
    assert first.generated and first.path == tmp_path / "config" / "pipeplan" / "api_token"
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o600
    again = resolve_token(Settings())
    assert again.value == first.value and not again.generated
    with pytest.raises(SettingsError, match="api_token_file: cannot read"):
        resolve_token(Settings(api_token_file=tmp_path / "missing"))


def test_a_non_loopback_host_needs_an_explicit_token(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PIPEPLAN_API_TOKEN", "PIPEPLAN_API_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    check_bind(Settings(host="127.0.0.1"))
    check_bind(Settings(host="::1"))
    check_bind(Settings(host="localhost"))
    check_bind(Settings(host="0.0.0.0", api_token="t"))
    with pytest.raises(SettingsError, match="host: '0.0.0.0' is not a loopback address"):
        check_bind(Settings(host="0.0.0.0"))
