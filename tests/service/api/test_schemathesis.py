"""schemathesis over the whole OpenAPI, in-process with the API token: no server error, no
response that breaks the schema (status, content type, body), on every operation."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings

from pipeplan.service.api.app import create_app
from pipeplan.service.api.store import Store
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]


_TMP = tempfile.TemporaryDirectory(prefix="pipeplan-schemathesis-")


def _app() -> FastAPI:
    config = make_settings(Path(_TMP.name))
    store = Store(config.database_url)
    store.create_tables()
    return create_app(config, store=store, backend=FakeBackend())


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@pytest.fixture(scope="module", autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    _TMP.cleanup()


@pytest.mark.timeout(300)
@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_every_operation_keeps_to_its_schema(case: schemathesis.Case) -> None:
    case.call_and_validate(headers=AUTH, checks=CHECKS)
