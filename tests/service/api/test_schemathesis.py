"""schemathesis over the whole OpenAPI document, in-process with the API token, with every
check it has: no server error; statuses, content types, headers and bodies as documented;
what the schema admits accepted and what it refuses refused; ``Allow`` on a method the path
does not take; auth that is not ignored. Then its state machine follows the document's
links: a created job's id feeds ``GET /v1/jobs/{job_id}``, its cancel, log and events.

Bodies that carry checks a schema cannot state (a document's own consistency, fields that
go together, a batch's seqs each once) may be refused with 422 although the schema admits
them; :func:`refused_by_the_domain_only` holds that refusal to the domain's: the body's
own pydantic model must accept it, so the schema and the types never disagree.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from pydantic import TypeAdapter, ValidationError
from schemathesis.checks import CheckContext

from pipeplan.service.api.app import create_app
from pipeplan.service.api.routes.jobs import JOB_LINKS, MAX_WAIT_S
from pipeplan.service.api.schemas import EventPost, JobRequest
from pipeplan.service.api.store import Store
from pipeplan.service.api.tokens import TokenCreate
from pipeplan.service.tasks.simulate import SimulateRequest
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

DOMAIN_CHECKED: dict[str, TypeAdapter[Any]] = {
    "POST /v1/jobs": TypeAdapter(JobRequest),
    "POST /v1/jobs/{job_id}/events": TypeAdapter(EventPost),
    "POST /v1/simulate": TypeAdapter(SimulateRequest),
    "POST /v1/tokens": TypeAdapter(TokenCreate),
}
"""The operations whose bodies the service checks beyond their schema, and their models."""

NOT_HERE = ("/v1/plan",)
"""Paths this app cannot serve: it has no planner pool (its own tests start one)."""

BEYOND_SCHEMA = frozenset({"value_error", "assertion_error"})
"""Errors of a model's own validators (a token's expiry in the future): checks a schema
cannot state, unlike a type, a missing field or a pattern."""

POSITIVE_STATUSES = frozenset({401, 403, 404, 409, 429})
"""What schema-valid data may get besides 2xx (schemathesis' own default list)."""

_TMP = tempfile.TemporaryDirectory(prefix="pipeplan-schemathesis-")


def _app() -> FastAPI:
    config = make_settings(Path(_TMP.name))
    store = Store(config.database_url)
    store.create_tables()
    return create_app(config, store=store, backend=FakeBackend())


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())
for path in NOT_HERE:
    schema = schema.exclude(path=path)

LONG_POLL_S = 0.1
"""The longest ``wait`` a generated ``GET /v1/jobs/{id}`` asks for: a job here never ends,
so each long poll lasts its whole wait (up to a minute as the document allows)."""


@schema.hook("map_query")
def _short_long_polls(context: Any, query: dict[str, Any] | None) -> dict[str, Any] | None:
    """A valid ``wait`` shortened to :data:`LONG_POLL_S`; an invalid one left as it is."""
    wait = (query or {}).get("wait")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and 0 <= wait <= MAX_WAIT_S:
        return {**(query or {}), "wait": min(wait, LONG_POLL_S)}
    return query


@pytest.fixture(scope="module", autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    _TMP.cleanup()


def refused_by_the_domain_only(
    ctx: CheckContext, response: Any, case: schemathesis.Case
) -> bool | None:
    """On :data:`DOMAIN_CHECKED`, schema-valid data is accepted, or refused with 422 by a
    check the schema cannot state: its body's own model accepts it, or refuses it by a
    validator of its own only."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    status = response.status_code
    if status < 400 or status in POSITIVE_STATUSES or status >= 500:
        return None
    assert status == 422, f"schema-valid data got {status}: {response.text}"
    try:
        DOMAIN_CHECKED[case.operation.label].validate_python(case.body)
    except ValidationError as e:
        typed = [err for err in e.errors() if err["type"] not in BEYOND_SCHEMA]
        assert not typed, f"the schema admits a body its model refuses: {response.text}\n{e}"
    return True


def _checks(case: schemathesis.Case) -> dict[str, Any]:
    """Every check; on :data:`DOMAIN_CHECKED`, the domain's refusal instead of schemathesis'
    own acceptance of positive data."""
    if case.operation.label not in DOMAIN_CHECKED:
        return {}
    return {
        "excluded_checks": [schemathesis.checks.positive_data_acceptance],
        "additional_checks": [refused_by_the_domain_only],
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
@schema.parametrize()
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_every_operation_keeps_to_its_schema(case: schemathesis.Case) -> None:
    case.call_and_validate(headers=AUTH, **_checks(case))


class APIWorkflows(schema.as_state_machine()):  # type: ignore[misc]
    """Sequences of calls along the document's links, each answer checked."""

    def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
        return {"headers": AUTH}

    def validate_response(
        self,
        response: Any,
        case: schemathesis.Case,
        additional_checks: Any = None,
        **kwargs: Any,
    ) -> None:
        checks = _checks(case)
        extra = [*(additional_checks or []), *checks.get("additional_checks", [])]
        case.validate_response(
            response,
            additional_checks=extra,
            excluded_checks=checks.get("excluded_checks"),
            transport_kwargs=kwargs or None,
        )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_links_from_a_created_job_keep_to_the_schema() -> None:
    APIWorkflows.run(
        settings=settings(
            max_examples=15,
            stateful_step_count=4,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
    )


PLAN_JOB = {
    "kind": "plan",
    "spec": {"cluster": "local-hetero", "model": "alexnet", "planner": "dp"},
}


def _linked(job_id: str) -> list[tuple[str, schemathesis.Case]]:
    """A call to each operation the create route's links name, with ``job_id`` put where
    its link says (``$response.body#/id``)."""
    create = schema.find_operation_by_label("POST /v1/jobs")
    assert create is not None
    links = create.definition.raw["responses"]["201"]["links"]
    cases = []
    for name in JOB_LINKS:  # the document's own (schemathesis adds links it infers)
        link = links[name]
        assert link["parameters"] == {"job_id": "$response.body#/id"}, name
        target = schema.find_operation_by_id(link["operationId"])
        cases.append((name, target.Case(path_parameters={"job_id": job_id})))
    return cases


@pytest.mark.timeout(120)
def test_a_created_jobs_id_feeds_the_linked_operations() -> None:
    create = schema.find_operation_by_label("POST /v1/jobs")
    assert create is not None
    response = create.Case(body=PLAN_JOB).call_and_validate(headers=AUTH, **_checks(create.Case()))
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    linked = dict(_linked(job_id))
    assert {"GetJob", "CancelJob", "JobLogs", "JobEvents"} <= set(linked)
    for name in ("GetJob", "JobEvents", "JobLogs", "CancelJob"):
        answer = linked[name].call_and_validate(headers=AUTH)
        assert answer.status_code == 200, (name, answer.text)
    assert linked["GetJob"].call(headers=AUTH).json()["state"] == "cancelled"
    again = linked["CancelJob"].call_and_validate(headers=AUTH)
    assert again.status_code == 409, again.text
