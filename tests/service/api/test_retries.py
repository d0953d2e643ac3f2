"""Retries (API.md, "The queue": ``retries``): the reconcile's decision with a fake backend
that keys submissions by their own ids. A job whose work was lost (its Ray Job failed without
the job's own error, or is gone) is handed over again while it has retries left -- a new
submission id, a new token, an ``attempt`` event naming the checkpoint it resumes from --
and fails saying so when it has none; a cancelled job, a job the backend stopped and a job
that failed by its own error are never retried. The store's part on SQLite and PostgreSQL,
including a database written before the columns existed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import MetaData, Table, insert

from pipeplan.service.api import app as app_module
from pipeplan.service.api.app import create_app, reconcile_context
from pipeplan.service.api.backend import (
    SEQS_PER_ATTEMPT,
    BackendState,
    BackendStatus,
    Submission,
    attempt_id,
    first_seq,
)
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.retries import SEARCH_FOLDER, search_spec
from pipeplan.service.api.schemas import JobKind
from pipeplan.service.api.settings import Settings
from pipeplan.service.api.store import Store, now
from tests.service.api.conftest import AUTH, FakeBackend

SPEC = {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"}
TAPP = {"cluster": "local-hetero", "model": "alexnet", "planner": "tapp", "options": {}}


@dataclass
class AttemptsFake(FakeBackend):
    """The fake backend, keyed as Ray keys jobs: by each attempt's submission id."""

    def submit(self, submission: Submission) -> str:
        if self.fail_submit is not None:
            raise RuntimeError(self.fail_submit)
        sid = submission.submission_id
        if sid not in self.statuses:
            self.submitted.append(submission)
            self.statuses[sid] = BackendStatus(BackendState.PENDING)
        return sid

    def token_of(self, job_id: str) -> str:
        """The job token of the job's latest attempt."""
        return [s.job_token for s in self.submitted if s.job_id == job_id][-1]


@pytest.fixture
def fake() -> AttemptsFake:
    return AttemptsFake()


@pytest.fixture
def retry_app(
    api_settings: Settings, store: Store, fake: AttemptsFake, fit_worker: FitWorker
) -> FastAPI:
    return create_app(api_settings, store=store, backend=fake, fit_worker=fit_worker)


@pytest.fixture
def client(retry_app: FastAPI) -> Iterator[TestClient]:
    with TestClient(retry_app, headers=AUTH) as c:
        yield c


def submit(client: TestClient, spec: dict[str, Any] = SPEC, **extra: Any) -> str:
    r = client.post("/v1/jobs", json={"kind": "plan", "spec": spec, **extra})
    assert r.status_code == 201, r.text
    job_id: str = r.json()["id"]
    return job_id


def post(client: TestClient, job_id: str, token: str, seq: int, type_: str, data: Any) -> Any:
    auth = {"Authorization": f"Bearer {token}"}
    body = {"seq": seq, "type": type_, "data": data}
    return client.post(f"/v1/jobs/{job_id}/events", json=body, headers=auth)


def run_reconcile(app: FastAPI, store: Store) -> list[str]:
    """The service's own reconcile (what its loop runs every ``reconcile_every_s``)."""
    return reconcile_context(app.state.context)


def events(client: TestClient, job_id: str) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = client.get(f"/v1/jobs/{job_id}/events").json()
    return got


# --- the decision -------------------------------------------------------------------------------


def test_a_lost_job_is_retried_while_attempts_remain_then_fails_saying_so(
    client: TestClient, retry_app: FastAPI, store: Store, fake: AttemptsFake
) -> None:
    jid = submit(client, retries=1)
    first_token = fake.token_of(jid)
    assert post(client, jid, first_token, 0, "progress", {"evaluations": 5}).is_success
    fake.statuses[jid] = BackendStatus(BackendState.FAILED, "driver exited with 137")
    fake.log_text[jid] = "Killed\n"

    assert run_reconcile(retry_app, store) == []
    job = client.get(f"/v1/jobs/{jid}").json()
    assert (job["state"], job["attempt"], job["retries"]) == ("queued", 2, 1)
    assert job["ray_job_id"] == f"{jid}-a2" == attempt_id(jid, 2)
    assert [(s.job_id, s.attempt) for s in fake.submitted] == [(jid, 1), (jid, 2)]
    attempt = events(client, jid)[-1]
    assert attempt["seq"] == SEQS_PER_ATTEMPT == first_seq(2) - 1
    assert attempt["type"] == "attempt"
    assert attempt["data"] == {
        "attempt": 2,
        "attempts": 2,
        "submission_id": f"{jid}-a2",
        "reason": "the job's work ended (failed) without a result: driver exited with 137",
        "resumes_from": None,
    }
    # the lost attempt's token posts nothing more; the new attempt posts from its own seqs
    assert post(client, jid, first_token, 1, "progress", {}).status_code in (401, 403)
    new_token = fake.token_of(jid)
    assert post(client, jid, new_token, first_seq(2), "progress", {"evaluations": 6}).is_success
    assert client.get(f"/v1/jobs/{jid}").json()["state"] == "running"

    fake.statuses[f"{jid}-a2"] = BackendStatus(BackendState.FAILED, "node lost")
    assert run_reconcile(retry_app, store) == [jid]
    job = client.get(f"/v1/jobs/{jid}").json()
    assert job["state"] == "failed" and job["attempt"] == 2
    assert job["error"].startswith(
        "the job's work ended (failed) without a result: node lost "
        "(attempt 2 of 2: no retries left)"
    )
    assert len(fake.submitted) == 2


def test_a_job_without_retries_fails_as_before(
    client: TestClient, retry_app: FastAPI, store: Store, fake: AttemptsFake
) -> None:
    jid = submit(client)
    fake.statuses[jid] = BackendStatus(BackendState.FAILED, "driver died")
    assert run_reconcile(retry_app, store) == [jid]
    job = client.get(f"/v1/jobs/{jid}").json()
    assert job["error"] == "the job's work ended (failed) without a result: driver died"
    assert (job["attempt"], job["retries"], len(fake.submitted)) == (1, 0, 1)


def test_a_job_the_backend_no_longer_knows_is_retried(
    client: TestClient,
    retry_app: FastAPI,
    store: Store,
    fake: AttemptsFake,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jid = submit(client, retries=2)
    del fake.statuses[jid]  # Ray lost its job table (a head restarted)
    monkeypatch.setattr(app_module, "UNKNOWN_GRACE", timedelta(0))
    assert run_reconcile(retry_app, store) == []
    job = client.get(f"/v1/jobs/{jid}").json()
    assert job["attempt"] == 2 and job["state"] == "queued"
    # the new attempt is young: not lost while its submission may still be showing
    monkeypatch.setattr(app_module, "UNKNOWN_GRACE", timedelta(hours=1))
    del fake.statuses[f"{jid}-a2"]
    assert run_reconcile(retry_app, store) == []
    assert client.get(f"/v1/jobs/{jid}").json()["attempt"] == 2


def test_never_retried_a_cancelled_job_a_stopped_one_or_one_that_failed_by_its_error(
    client: TestClient, retry_app: FastAPI, store: Store, fake: AttemptsFake
) -> None:
    cancelled, stopped, erred, clean = (submit(client, retries=3) for _ in range(4))
    assert client.post(f"/v1/jobs/{cancelled}/cancel").json()["state"] == "cancelled"
    fake.statuses[stopped] = BackendStatus(BackendState.STOPPED, "stopped by the service")
    token = fake.token_of(erred)
    assert post(client, erred, token, 0, "error", {"message": "planner: bad option"}).is_success
    fake.statuses[erred] = BackendStatus(BackendState.FAILED, "exit code 1")
    fake.statuses[clean] = BackendStatus(BackendState.SUCCEEDED)

    assert sorted(run_reconcile(retry_app, store)) == sorted([stopped, clean])
    assert len(fake.submitted) == 4 and fake.stopped == [cancelled]
    states = {j: client.get(f"/v1/jobs/{j}").json() for j in (cancelled, stopped, erred, clean)}
    assert states[cancelled]["state"] == "cancelled"
    assert states[erred]["error"] == "planner: bad option"
    assert states[stopped]["error"].startswith("the job's work ended (stopped)")
    assert all(s["attempt"] == 1 for s in states.values())


def test_a_retried_search_resumes_from_the_checkpoint_in_its_folder(
    client: TestClient,
    retry_app: FastAPI,
    store: Store,
    fake: AttemptsFake,
    api_settings: Settings,
) -> None:
    jid = submit(client, TAPP, retries=1)
    spec = client.get(f"/v1/jobs/{jid}").json()["spec"]
    folder = api_settings.jobs_root / jid / SEARCH_FOLDER
    assert spec["options"] == {"checkpoint_dir": str(folder)}
    folder.mkdir(parents=True)
    (folder / "search.pt").write_bytes(b"a checkpoint")
    (folder / "policy.pt").write_bytes(b"a policy")
    fake.statuses[jid] = BackendStatus(BackendState.FAILED, "driver exited with 137")
    run_reconcile(retry_app, store)
    attempt = events(client, jid)[-1]["data"]
    assert attempt["resumes_from"] == str(folder / "search.pt")
    assert client.get(f"/v1/jobs/{jid}").json()["spec"] == spec  # the same spec, resumed
    names = [a["name"] for a in client.get(f"/v1/jobs/{jid}/artifacts").json()]
    assert names == ["search/policy.pt", "search/search.pt"]


def test_the_backend_is_asked_for_the_current_attempt(
    client: TestClient, retry_app: FastAPI, store: Store, fake: AttemptsFake
) -> None:
    jid = submit(client, retries=1)
    fake.statuses[jid] = BackendStatus(BackendState.FAILED, "lost")
    run_reconcile(retry_app, store)
    fake.log_text[f"{jid}-a2"] = "second attempt's log"
    assert client.get(f"/v1/jobs/{jid}/logs").text == "second attempt's log"
    assert client.post(f"/v1/jobs/{jid}/cancel").json()["state"] == "cancelled"
    assert fake.stopped == [f"{jid}-a2"]


def test_a_backend_refusing_the_retry_fails_the_job_with_the_reason(
    client: TestClient, retry_app: FastAPI, store: Store, fake: AttemptsFake
) -> None:
    jid = submit(client, retries=1)
    fake.statuses[jid] = BackendStatus(BackendState.FAILED, "lost")
    fake.fail_submit = "the Jobs API is down"
    run_reconcile(retry_app, store)
    job = client.get(f"/v1/jobs/{jid}").json()
    assert job["state"] == "failed"
    assert job["error"] == "retry: attempt 2: submit: RuntimeError: the Jobs API is down"


# --- the field ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "spec", "retries", "message"),
    [
        ("plan", SPEC, 11, r"retries: Input should be less than or equal to 10"),
        ("plan", SPEC, -1, r"retries: Input should be greater than or equal to 0"),
        ("compare", {"cluster": "local-hetero", "model": "alexnet"}, "x", r"retries: Input"),
        ("profile", {"model": "alexnet"}, 1, r"retries: Extra inputs are not permitted"),
    ],
)
def test_a_bad_retries_is_422_naming_it(
    client: TestClient, kind: str, spec: dict[str, Any], retries: Any, message: str
) -> None:
    r = client.post("/v1/jobs", json={"kind": kind, "spec": spec, "retries": retries})
    assert r.status_code == 422, r.text
    assert re.search(message, r.json()["detail"]), r.json()["detail"]


def test_the_document_states_the_bound(retry_app: FastAPI) -> None:
    schemas = retry_app.openapi()["components"]["schemas"]
    for model in ("PlanJob", "CompareJob"):
        prop = schemas[model]["properties"]["retries"]
        assert (prop["minimum"], prop["maximum"], prop["default"]) == (0, 10, 0)
    assert "retries" not in schemas["ProfileJob"]["properties"]
    assert {"attempt", "retries"} <= set(schemas["Job"]["properties"])


def test_search_specs_checkpoint_into_the_jobs_folder(tmp_path: Path) -> None:
    measured = {**TAPP, "planner": "ppo", "reward": "measured"}
    got = search_spec(measured, "pp-1", tmp_path)
    assert got["options"] == {
        "checkpoint_dir": str(tmp_path / "pp-1" / SEARCH_FOLDER),
        "checkpoint_every": 1,
    }
    own = {**TAPP, "options": {"checkpoint_dir": "/elsewhere", "batch_size": 8}}
    assert search_spec(own, "pp-1", tmp_path) == own
    assert search_spec(SPEC, "pp-1", tmp_path) == SPEC


# --- the store, on either database ----------------------------------------------------------------


def test_an_attempt_is_taken_once_with_its_event(db: Store) -> None:
    job = db.create_job(JobKind.PLAN, SPEC, None, "h0", retries=2)
    db.set_ray_job_id(job.id, job.id)
    assert (job.attempt, job.retries) == (1, 2) and db.attempted_at(job.id) is None
    event = {"attempt": 2, "resumes_from": None}
    assert db.begin_attempt(job, f"{job.id}-a2", "h1", first_seq(2) - 1, event)
    assert not db.begin_attempt(job, f"{job.id}-a2", "h2", first_seq(2) - 1, event)  # taken
    again = db.get_job(job.id)
    assert (again.attempt, again.ray_job_id, again.state.value) == (2, f"{job.id}-a2", "queued")
    assert db.token_hash(job.id) == "h1"
    assert abs((now() - (db.attempted_at(job.id) or now())).total_seconds()) < 60
    [stored] = db.events_after(job.id)
    assert (stored.seq, stored.type.value, stored.data) == (SEQS_PER_ATTEMPT, "attempt", event)


def test_a_database_from_before_retries_gets_the_columns(db: Store) -> None:
    old = MetaData()
    table = db.jobs
    kept = [
        c._copy() for c in table.columns if c.name not in ("retries", "attempt", "attempted_at")
    ]
    db.drop_tables()
    legacy = Table(table.name, old, *kept)
    old.create_all(db.engine)
    with db.engine.begin() as conn:
        conn.execute(
            insert(legacy).values(
                id="pp-old", kind="plan", state="running", spec=SPEC, created_at=now(),
                token_hash="h",
            )
        )  # fmt: skip
    db.create_tables()
    job = db.get_job("pp-old")
    assert (job.attempt, job.retries, job.state.value) == (1, 0, "running")
    assert db.begin_attempt(job, "pp-old-a2", "h1", first_seq(2) - 1, {"attempt": 2})
    assert db.get_job("pp-old").attempt == 2
