"""A client generated from the OpenAPI document works: it submits a plan job, follows its
events and reads the ended job, every body built and parsed by the generated models.

The models are generated with ``datamodel-code-generator`` (PyPI) and sent over httpx (the
app's ``TestClient``). ``openapi-python-client``, which writes a whole client, cannot be
installed beside this project: every release pins ``typer`` below the version the CLI uses.
"""

from __future__ import annotations

# ruff: noqa: F811  (the fixtures imported from the API tests are the parameters)
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from datamodel_code_generator import DataModelType, Formatter, InputFileType, generate
from fastapi.testclient import TestClient

from tests.service.api.conftest import (  # noqa: F401  (the API tests' fixtures)
    FakeBackend,
    api_settings,
    app,
    app_client,
    fake_backend,
    fit_worker,
    store,
)

DOCUMENT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
RESULT = {
    "plan": {
        "global_batch": 32,
        "stages": [{"layers": [0, 8], "devices": ["n0/fast:0"], "microbatch": 8}],
    },
    "estimate": {"batch_time_s": 0.25, "throughput": 128.0},
    "planner": "dp",
    "evaluations": 12,
    "wall_time_s": 0.05,
}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The models ``datamodel-code-generator`` writes from the published document
    (``docs/openapi.json``, the app's own: ``tests/test_docs.py``), imported."""
    out = tmp_path_factory.mktemp("generated") / "pipeplan_api.py"
    generate(
        DOCUMENT.read_text(),
        input_file_type=InputFileType.OpenAPI,
        output=out,
        output_model_type=DataModelType.PydanticV2BaseModel,
        formatters=[Formatter.BUILTIN],
    )
    spec = importlib.util.spec_from_file_location("pipeplan_api", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pipeplan_api"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["pipeplan_api"]
    return module


def test_a_generated_client_plans_follows_and_reads_the_result(
    api: ModuleType, app_client: TestClient, fake_backend: FakeBackend
) -> None:
    request = api.PlanJob.model_validate(
        {
            "kind": "plan",
            "spec": {"cluster": "local-hetero", "model": "alexnet", "planner": "dp", "batch": 32},
            "name": "generated",
        }
    )
    assert isinstance(request.spec, api.PlanSpec)
    r = app_client.post("/v1/jobs", json=request.model_dump(mode="json", exclude_unset=True))
    assert r.status_code == 201, r.text
    job = api.Job.model_validate(r.json())
    assert job.kind == api.JobKind.plan and job.state == api.JobState.queued

    as_job = {"Authorization": f"Bearer {fake_backend.token_of(job.id)}"}
    posted = [
        api.EventIn(seq=0, type=api.EventType.progress, data={"evaluations": 3}),
        api.EventIn(seq=1, type=api.EventType.result, data=RESULT),
    ]
    for event in posted:
        r = app_client.post(
            f"/v1/jobs/{job.id}/events", json=event.model_dump(mode="json"), headers=as_job
        )
        assert r.status_code == 200 and api.EventAck.model_validate(r.json()).stored, r.text

    r = app_client.get(f"/v1/jobs/{job.id}/events", params={"after": -1})
    events = [api.Event.model_validate(e) for e in r.json()]
    assert [e.type for e in events] == [api.EventType.progress, api.EventType.result]

    r = app_client.get(f"/v1/jobs/{job.id}", params={"wait": 5})
    done = api.Job.model_validate(r.json())
    assert done.state == api.JobState.succeeded and done.name == "generated"
    assert isinstance(done.result, api.PlanJobResult)  # typed: the document says how
    assert done.result.planner == "dp" and done.result.evaluations == 12
    assert done.result.estimate["batch_time_s"] == 0.25


def test_the_generated_models_refuse_what_the_document_refuses(api: ModuleType) -> None:
    for bad in (
        {"kind": "plan", "spec": {"cluster": "local-hetero", "planner": "dp", "batch": 0}},
        {"kind": "plan", "spec": {"cluster": "local-hetero", "planner": "nope"}},
        {"kind": "run", "spec": {}},
    ):
        kind = bad["kind"]
        model = api.PlanJob if kind == "plan" else api.RunJob
        try:
            model.model_validate(bad)
        except ValueError:
            continue
        raise AssertionError(f"the generated {model.__name__} took {bad}")
