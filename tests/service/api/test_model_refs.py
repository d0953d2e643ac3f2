"""Jobs that name their model by reference (``package.module:factory``, ``hf:``): code only
where ``PIPEPLAN_ALLOW_CODE`` is on, never imported by the API; bad fields are 422."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeplan.service.api.app import create_app
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.settings import Settings
from pipeplan.service.api.store import Store
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

FACTORY = "no_such_package.models:make"
PLAN = {"cluster": "local-hetero", "planner": "dp"}
HF = {"model": "hf:GPT2LMHeadModel", "model_options": {"n_layer": 2, "n_embd": 32}}


@pytest.fixture
def code_client(
    tmp_path: Path, store: Store, fake_backend: FakeBackend, fit_worker: FitWorker
) -> Iterator[TestClient]:
    """A client of an app whose settings allow code."""
    settings = make_settings(tmp_path, allow_code=True)
    app = create_app(settings, store=store, backend=fake_backend, fit_worker=fit_worker)
    with TestClient(app, headers=AUTH) as client:
        yield client


CODE_SPECS = [
    ("plan", PLAN | {"model": FACTORY, "input_shape": [8]}, f"model: '{FACTORY}' names code"),
    ("profile", {"model": FACTORY, "input_shape": [8]}, f"model: '{FACTORY}' names code"),
    ("run", {"plan": {}, "model": FACTORY}, f"model: '{FACTORY}' names code"),
    ("profile", HF | {"example": "pkg.mod:example"}, "example: 'pkg.mod:example' names code"),
]


@pytest.mark.parametrize(("kind", "spec", "message"), CODE_SPECS)
def test_code_is_refused_while_the_setting_is_off(
    app_client: TestClient, fake_backend: FakeBackend, kind: str, spec: Any, message: str
) -> None:
    r = app_client.post("/v1/jobs", json={"kind": kind, "spec": spec})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail.startswith(message) and "PIPEPLAN_ALLOW_CODE is off" in detail
    assert fake_backend.submitted == []


def test_with_the_setting_on_code_is_queued_without_being_imported(
    code_client: TestClient, fake_backend: FakeBackend
) -> None:
    spec = PLAN | {"model": FACTORY, "input_shape": [3, 8, 8], "model_options": {"depth": 2}}
    r = code_client.post("/v1/jobs", json={"kind": "plan", "spec": spec})
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["model_options"] == {"depth": 2}
    assert len(fake_backend.submitted) == 1
    assert "no_such_package" not in sys.modules  # the job imports it, not the API


def test_an_hf_model_needs_no_setting(app_client: TestClient, fake_backend: FakeBackend) -> None:
    r = app_client.post("/v1/jobs", json={"kind": "profile", "spec": HF | {"input_size": 16}})
    assert r.status_code == 201, r.text
    assert len(fake_backend.submitted) == 1


FIELD_SPECS = [
    ("profile", {"model": "hf:GPT-2"}, "model: 'hf:GPT-2' is not hf:ClassName"),
    ("profile", {"model": "alexnet", "input_shape": [3, 8, 8]},
     "input_shape: [3, 8, 8] only applies to a package.module:factory model"),
    ("plan", PLAN | {"model": FACTORY}, f"input_shape: model '{FACTORY}' needs its input's"),
    ("plan", PLAN | {"model": FACTORY, "input_shape": [8], "input_size": 8},
     "input_size: 8 does not apply to"),
    ("plan", PLAN | {"model": FACTORY, "input_shape": [8], "input_dtype": "float16"},
     "spec.input_dtype: Input should be 'float32' or 'int64'"),
    ("plan", PLAN | {"model": FACTORY, "input_shape": [0]}, "input_shape: sizes must be >= 1"),
    ("plan", PLAN | {"model": FACTORY, "example": "not a ref"},
     "example: 'not a ref' is not of the form package.module:function"),
    ("plan", PLAN | {"profile": {"name": "m", "layers": []}, "model_options": {"a": 1}},
     "model_options: only applies with model, got {'a': 1}"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "spec", "message"), FIELD_SPECS)
def test_bad_model_fields_are_422_naming_the_field(
    code_client: TestClient, fake_backend: FakeBackend, kind: str, spec: Any, message: str
) -> None:
    r = code_client.post("/v1/jobs", json={"kind": kind, "spec": spec})
    assert r.status_code == 422, r.text
    assert message in r.json()["detail"]
    assert fake_backend.submitted == []


def test_the_setting_is_off_unless_the_environment_turns_it_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PIPEPLAN_ALLOW_CODE", raising=False)
    assert Settings().allow_code is False
    monkeypatch.setenv("PIPEPLAN_ALLOW_CODE", "1")
    assert Settings().allow_code is True
