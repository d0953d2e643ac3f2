"""Fixtures of the API's tests: a :class:`FakeBackend` (the jobs backend protocol, in
memory), settings with a known token and a SQLite store in ``tmp_path``, the app, and
``app_client``: a ``TestClient`` (lifespan run) whose requests carry the API token. The apps
share one calibration fit worker (its child process spawned once per session)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pipeplan.service.api.app import create_app
from pipeplan.service.api.backend import BackendState, BackendStatus, ClusterState, Submission
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.settings import Settings
from pipeplan.service.api.store import Store

API_TOKEN = "test-api-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


@dataclass
class FakeBackend:
    """The jobs backend protocol in memory: what was submitted and stopped, the status and
    log each job has; ``fail_submit`` / ``not_ready`` make it refuse."""

    submitted: list[Submission] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    statuses: dict[str, BackendStatus] = field(default_factory=dict)
    log_text: dict[str, str] = field(default_factory=dict)
    fail_submit: str | None = None
    not_ready: str | None = None
    cluster: ClusterState = field(default_factory=ClusterState)
    """What the dashboard's cluster page is told (default: no live node)."""
    ray_dashboard: str | None = None

    def submit(self, submission: Submission) -> str:
        if self.fail_submit is not None:
            raise RuntimeError(self.fail_submit)
        if submission.job_id not in self.statuses:
            self.submitted.append(submission)
            self.statuses[submission.job_id] = BackendStatus(BackendState.PENDING)
        return submission.job_id

    def stop(self, job_id: str) -> None:
        self.stopped.append(job_id)
        self.statuses[job_id] = BackendStatus(BackendState.STOPPED, "stopped by the user")

    def status(self, job_id: str) -> BackendStatus:
        return self.statuses.get(job_id, BackendStatus(BackendState.UNKNOWN))

    def logs(self, job_id: str) -> str:
        return self.log_text.get(job_id, "")

    def ready(self) -> str | None:
        return self.not_ready

    def cluster_state(self) -> ClusterState:
        return self.cluster

    def dashboard_url(self) -> str | None:
        return self.ray_dashboard

    def token_of(self, job_id: str) -> str:
        """The job token the service handed over for ``job_id``."""
        return next(s.job_token for s in self.submitted if s.job_id == job_id)


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "db": f"sqlite:///{tmp_path / 'jobs.db'}",
        "api_token": API_TOKEN,
        "port": 18321,
        "reconcile_every_s": 0,
        "sse_poll_s": 0.05,
    }
    return Settings(**(values | overrides))


@pytest.fixture
def fake_backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def api_settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
def store(api_settings: Settings) -> Iterator[Store]:
    s = Store(api_settings.database_url)
    s.create_tables()
    yield s
    s.close()


@pytest.fixture(scope="session")
def fit_worker() -> Iterator[FitWorker]:
    """The calibration fit worker of every app of the session (a spawned child process
    imports the executor once, not once per test)."""
    worker = FitWorker()
    yield worker
    worker.close()


@pytest.fixture
def app(
    api_settings: Settings, store: Store, fake_backend: FakeBackend, fit_worker: FitWorker
) -> FastAPI:
    return create_app(api_settings, store=store, backend=fake_backend, fit_worker=fit_worker)


@pytest.fixture
def app_client(app: FastAPI) -> Iterator[TestClient]:
    """A client of the app (its lifespan run) sending the API token."""
    with TestClient(app, headers=AUTH) as client:
        yield client


@pytest.fixture
def anon_client(app: FastAPI) -> Iterator[TestClient]:
    """A client of the app with no token."""
    with TestClient(app) as client:
        yield client


# --- the job store on either database -------------------------------------------------------

PG_USERS = ("postgres", "root")


def _postgres_url() -> str:
    """The URL of the test database, or skip saying why there is none."""
    reasons = []
    for user in PG_USERS:
        try:
            with psycopg.connect(
                host="127.0.0.1", port=5432, dbname="test", user=user, connect_timeout=3
            ):
                return f"postgresql+psycopg://{user}@127.0.0.1:5432/test"
        except psycopg.Error as e:
            reasons.append(f"{user}: {str(e).strip().splitlines()[0]}")
    pytest.skip(
        "PostgreSQL at 127.0.0.1:5432 (database test) does not answer: " + "; ".join(reasons)
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    else:
        store = Store(_postgres_url(), prefix=f"t{secrets.token_hex(4)}_")
    store.create_tables()
    yield store
    if request.param == "postgresql":
        store.drop_tables()
    store.close()
