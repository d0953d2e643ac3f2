"""The OpenAPI document is the contract: what it states, the service enforces.

- every bound the document states on a spec field is refused one step beyond it (422 naming
  the field and the value), for every kind that has the field;
- every kind has its model in ``POST /v1/jobs``'s union, and its spec's fields are its
  request model's;
- the cursor's pattern admits every cursor the store issues and only cursors it reads;
- an event's ``data`` is its type's, as the document states it;
- ``GET /v1/jobs/{id}?wait=S`` answers as soon as the job ends, or with the job as it is
  after ``S`` seconds; ``wait`` beyond its bound is 422 naming it; the hand-written client
  (:mod:`service.client`, which parses every answer with the API's own models) waits so.
"""

# ruff: noqa: F811  (the fixtures imported from the API tests are the parameters)
from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.service.api.routes.jobs import CURSOR_PATTERN, MAX_WAIT_S
from pipeplan.service.api.schemas import (
    EVENT_DATA,
    FIELD_BOUNDS,
    REQUEST_SPECS,
    SPEC_MODELS,
    EventIn,
    EventType,
    JobKind,
    JobState,
)
from pipeplan.service.api.store import Store
from pipeplan.service.api.store.jobs import _decode_cursor, _encode_cursor
from pipeplan.service.client import Client
from tests.service.api.conftest import (  # noqa: F401  (the API tests' fixtures)
    API_TOKEN,
    FakeBackend,
    api_settings,
    app,
    app_client,
    fake_backend,
    fit_worker,
    store,
)

VALID: dict[JobKind, dict[str, Any]] = {
    JobKind.PROFILE: {"model": "alexnet"},
    JobKind.PLAN: {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"},
    JobKind.COMPARE: {"cluster": "local-hetero", "model": "alexnet"},
    JobKind.RUN: {
        "plan": {
            "global_batch": 8,
            "stages": [{"layers": [0, 8], "devices": ["n0/fast:0"], "microbatch": 4}],
        },
        "model": "digits_cnn",
        "cluster": "local-hetero",
    },
    JobKind.TRAIN: {"model": "digits_cnn", "cluster": "local-hetero", "planner": "dp"},
}
"""A spec of each kind the service takes."""


def _beyond(kind: JobKind) -> list[tuple[str, Any]]:
    """(field, a value one step outside its bound) for each bounded field of ``kind``."""
    fields = REQUEST_SPECS[kind].model_fields
    cases: list[tuple[str, Any]] = []
    for name, bound in FIELD_BOUNDS.items():
        if name not in fields:
            continue
        if bound.low is not None:
            cases.append((name, bound.low if bound.open_low else bound.low - 1))
        if bound.high is not None:
            cases.append((name, bound.high + 1))
    return cases


OUTSIDE = [(kind, name, value) for kind in JobKind for name, value in _beyond(kind)]


def test_every_kind_has_its_model_and_fields() -> None:
    assert set(REQUEST_SPECS) == set(JobKind) == set(SPEC_MODELS)
    for kind, spec in REQUEST_SPECS.items():
        assert issubclass(spec, SPEC_MODELS[kind])
        assert spec.model_fields.keys() == SPEC_MODELS[kind].model_fields.keys()


def test_the_document_states_every_bound(app: FastAPI) -> None:
    schemas = app.openapi()["components"]["schemas"]
    for kind, spec in REQUEST_SPECS.items():
        props = schemas[spec.__name__]["properties"]
        for name, bound in FIELD_BOUNDS.items():
            if name in props:
                for key, value in bound.json_schema().items():
                    assert props[name][key] == value, (kind, name, key)
    assert schemas["PlanSpec"]["properties"]["planner"]["enum"]


def test_the_valid_specs_are_taken(app_client: TestClient) -> None:
    for kind, spec in VALID.items():
        r = app_client.post("/v1/jobs", json={"kind": kind.value, "spec": spec})
        assert r.status_code == 201, (kind, r.text)


@pytest.mark.parametrize(("kind", "name", "value"), OUTSIDE)
def test_a_value_beyond_a_stated_bound_is_422_naming_it(
    app_client: TestClient, kind: JobKind, name: str, value: Any
) -> None:
    spec = VALID[kind] | ({"budget": {name: value}} if name in ("evaluations", "seconds") else {})
    spec = spec if name in ("evaluations", "seconds") else spec | {name: value}
    r = app_client.post("/v1/jobs", json={"kind": kind.value, "spec": spec})
    assert r.status_code == 422, (kind, name, value, r.text)
    detail = r.json()["detail"]
    assert re.search(rf"\b{name}\b", detail) and str(value) in detail, detail


def test_an_empty_run_spec_is_refused_by_the_schema_and_the_service(
    app: FastAPI, app_client: TestClient
) -> None:
    run = app.openapi()["components"]["schemas"]["RunSpec"]
    assert "plan" in run["required"]
    r = app_client.post("/v1/jobs", json={"kind": "run", "spec": {}})
    assert r.status_code == 422 and r.json()["detail"].startswith("spec.plan: Field required")


@pytest.mark.parametrize("num", [1, 9, 10, 99, 123, 4567, 10**9, 10**18 + 7, 10**19 - 1])
def test_the_cursor_pattern_admits_every_issued_cursor(num: int) -> None:
    assert re.fullmatch(CURSOR_PATTERN, _encode_cursor(num))


@settings(max_examples=60, deadline=None)
@given(st.from_regex(CURSOR_PATTERN, fullmatch=True))
def test_every_cursor_the_pattern_admits_is_read(cursor: str) -> None:
    if cursor:
        assert _decode_cursor(cursor) >= 0


@pytest.mark.parametrize("cursor", ["xyz", "ajE=", "aj", "AAAA", "ajF"])
def test_a_cursor_the_store_never_issued_is_422(app_client: TestClient, cursor: str) -> None:
    r = app_client.get("/v1/jobs", params={"cursor": cursor})
    assert r.status_code == 422 and r.json()["detail"].startswith("cursor:"), r.text


def test_options_names_every_method_of_the_path(app_client: TestClient) -> None:
    for path in ("/v1/jobs", "/v1/jobs/pp-1/events"):
        r = app_client.options(path)
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST", path


# --- GET /v1/jobs/{id}?wait=S --------------------------------------------------------------


def _job(app_client: TestClient) -> str:
    r = app_client.post("/v1/jobs", json={"kind": "plan", "spec": VALID[JobKind.PLAN]})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def test_wait_answers_as_soon_as_the_job_ends(app_client: TestClient, store: Store) -> None:
    job_id = _job(app_client)
    done = EventIn(seq=0, type=EventType.RESULT, data={"plan": {}})
    timer = threading.Timer(0.3, store.add_event, (job_id, done))
    timer.start()
    start = time.monotonic()
    r = app_client.get(f"/v1/jobs/{job_id}", params={"wait": 20})
    took = time.monotonic() - start
    timer.join()
    assert r.status_code == 200 and r.json()["state"] == "succeeded", r.text
    assert 0.25 < took < 5, took


def test_wait_answers_the_open_job_when_its_time_is_up(app_client: TestClient) -> None:
    job_id = _job(app_client)
    start = time.monotonic()
    r = app_client.get(f"/v1/jobs/{job_id}", params={"wait": 0.4})
    took = time.monotonic() - start
    assert r.status_code == 200 and r.json()["state"] == "queued", r.text
    assert 0.35 < took < 5, took
    start = time.monotonic()
    assert app_client.get(f"/v1/jobs/{job_id}").json()["state"] == "queued"
    assert time.monotonic() - start < 0.3


@pytest.mark.parametrize("wait", [-1, MAX_WAIT_S + 1, "soon"])
def test_wait_beyond_its_bound_is_422_naming_it(app_client: TestClient, wait: object) -> None:
    job_id = _job(app_client)
    r = app_client.get(f"/v1/jobs/{job_id}", params={"wait": wait})
    assert r.status_code == 422 and r.json()["detail"].startswith("wait:"), r.text


def test_an_unknown_job_is_404_at_once_with_wait(app_client: TestClient) -> None:
    r = app_client.get("/v1/jobs/pp-nothere", params={"wait": 30})
    assert r.status_code == 404, r.text


def test_the_hand_written_client_waits_with_the_service(
    app_client: TestClient, store: Store
) -> None:
    client = Client("http://testserver", API_TOKEN, http=app_client)
    job = client.submit("plan", VALID[JobKind.PLAN])
    assert client.get(job.id, wait=0.2).state is JobState.QUEUED
    done = EventIn(seq=0, type=EventType.RESULT, data={"plan": {}})
    timer = threading.Timer(0.3, store.add_event, (job.id, done))
    timer.start()
    ended = client.get(job.id, wait=20)
    timer.join()
    assert ended.state is JobState.SUCCEEDED and ended.result == {"plan": {}}


# --- events: the data of each type --------------------------------------------------------


def test_the_document_states_each_event_types_data(app: FastAPI) -> None:
    event = app.openapi()["components"]["schemas"]["EventIn"]
    stated = {c["if"]["properties"]["type"]["const"]: c["then"] for c in event["allOf"]}
    assert set(stated) == {kind.value for kind in EVENT_DATA}
    progress = stated["progress"]["properties"]["data"]["properties"]
    assert {"evaluations", "best_value", "elapsed_s", "step", "loss"} <= set(progress)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"seq": 0, "type": "progress", "data": {"evaluations": "many"}}, "data.evaluations:"),
        ({"seq": 0, "type": "checkpoint", "data": {"step": 1.5}}, "data.step:"),
        ([{"seq": 0, "type": "error", "data": {"message": 3}}], "batch.0.data.message:"),
    ],
)
def test_an_event_whose_data_is_not_its_types_is_422_naming_the_field(
    app_client: TestClient, fake_backend: FakeBackend, body: Any, message: str
) -> None:
    job_id = _job(app_client)
    as_job = {"Authorization": f"Bearer {fake_backend.token_of(job_id)}"}
    r = app_client.post(f"/v1/jobs/{job_id}/events", json=body, headers=as_job)
    assert r.status_code == 422 and r.json()["detail"].startswith(message), r.text
    assert app_client.get(f"/v1/jobs/{job_id}/events").json() == []


def test_an_event_may_carry_more_than_its_types_fields(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    job_id = _job(app_client)
    as_job = {"Authorization": f"Bearer {fake_backend.token_of(job_id)}"}
    data = {"evaluations": 3, "best_value": None, "phase": "warm-up"}
    r = app_client.post(
        f"/v1/jobs/{job_id}/events",
        json={"seq": 0, "type": "progress", "data": data},
        headers=as_job,
    )
    assert r.status_code == 200, r.text
    assert app_client.get(f"/v1/jobs/{job_id}/events").json()[0]["data"] == data


def test_the_documents_examples_are_taken(app: FastAPI, app_client: TestClient) -> None:
    body = app.openapi()["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    examples = body["application/json"]["examples"]
    assert {"plan", "compare", "profile"} <= set(examples)
    for name, example in examples.items():
        r = app_client.post("/v1/jobs", json=example["value"])
        assert r.status_code == 201, (name, r.text)
