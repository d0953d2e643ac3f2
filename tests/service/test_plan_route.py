"""``POST /v1/plan`` without Ray: a pool of in-process workers that run the named function
itself (the plan use-case, as a Ray worker would) or, for the limit, one that never ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeplan.executor.worker_pool import Outcome, resolve
from pipeplan.service.api.app import create_app
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.pool import PlannerPool
from pipeplan.service.api.routes.plan import MAX_TIMEOUT_S
from pipeplan.service.api.store import Store
from pipeplan.service.tasks.plan import PlanRequest, plan
from tests.service.api.conftest import AUTH, FakeBackend, make_settings
from tests.service.test_pool import PLAN, FakeWorker, FakeWorkers

SLOW_SEED = 99
"""A request with this seed never ends in :func:`run_here`."""


def run_here(w: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
    """Run ``target`` in this process, as the worker's actor would; a spec with
    :data:`SLOW_SEED` blocks until its limit (or kill)."""
    if args[0].get("seed") == SLOW_SEED:
        w.block(threading.Event(), t)
    try:
        return Outcome(value=resolve(target)(*args))
    except Exception as e:
        return Outcome(error=f"{type(e).__name__}: {e}")


@pytest.fixture(scope="module")
def fit_worker() -> Iterator[FitWorker]:
    worker = FitWorker()
    yield worker
    worker.close()


@pytest.fixture
def client(tmp_path: Path, fit_worker: FitWorker) -> Iterator[TestClient]:
    settings = make_settings(tmp_path)
    store = Store(settings.database_url)
    pool = PlannerPool(FakeWorkers(run_here), 1)
    app = create_app(settings, store=store, backend=FakeBackend(), fit_worker=fit_worker, pool=pool)
    with TestClient(app, headers=AUTH) as c:
        assert pool.wait_warm(5)
        yield c
    store.close()


def test_it_answers_the_document_a_plan_job_ends_with(client: TestClient) -> None:
    r = client.post("/v1/plan", json=PLAN | {"timeout_s": 30})
    assert r.status_code == 200, r.text
    expected = plan(PlanRequest.model_validate(PLAN)).to_dict()
    got = r.json()
    assert set(got) == set(expected)
    for key in ("plan", "estimate", "planner", "evaluations"):
        assert got[key] == expected[key], key
    assert client.get("/v1/jobs").json()["items"] == []  # nothing stored


def test_past_its_limit_it_answers_422_naming_timeout_s(client: TestClient) -> None:
    t0 = time.monotonic()
    r = client.post("/v1/plan", json=PLAN | {"seed": SLOW_SEED, "timeout_s": 0.3})
    assert time.monotonic() - t0 < 3
    assert r.status_code == 422
    assert r.json()["detail"].startswith("timeout_s: the plan was not found within the limit")
    assert client.post("/v1/plan", json=PLAN).status_code == 200  # a new worker took over


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (PLAN | {"timeout_s": MAX_TIMEOUT_S + 1}, "timeout_s"),
        (PLAN | {"timeout_s": 0}, "timeout_s"),
        (PLAN | {"planner": "nope"}, "planner: unknown planner 'nope'"),
        (PLAN | {"batch": 0}, "batch"),
        (PLAN | {"planner": "genetic", "reward": "parallel", "workers": 2}, "reward: "),
        (PLAN | {"planner": "ppo"}, "planner: this plan needs a Ray cluster"),
        (PLAN | {"surprise": 1}, "surprise"),
    ],
)
def test_a_body_the_pool_cannot_answer_is_refused_naming_the_field(
    client: TestClient, body: dict[str, Any], named: str
) -> None:
    r = client.post("/v1/plan", json=body)
    assert r.status_code == 422, r.text
    assert named in r.json()["detail"]


def test_it_needs_the_api_token(client: TestClient) -> None:
    r = client.post("/v1/plan", json=PLAN, headers={"Authorization": "Bearer wrong"})
    assert r.status_code in (401, 403)
