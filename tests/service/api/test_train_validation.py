"""``POST /v1/jobs`` of kind ``train``: every bad spec is 422 with one line naming the field
and the value, before anything is queued; a good one gets its checkpoint folder (the job's
own, or the one it names) and ``resume_from`` a job id resolved to that job's checkpoints."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeplan.service.api.app import create_app
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.settings import Settings
from pipeplan.service.api.store import Store
from pipeplan.service.api.training import checkpoint_folder
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

PLAN = {
    "global_batch": 8,
    "stages": [
        {"layers": [0, 4], "devices": ["n0/fast:0"], "microbatch": 4},
        {"layers": [4, 8], "devices": ["n1/mid:0"], "microbatch": 4},
    ],
}
"""digits_cnn's 8 layers in two stages of the local-hetero preset."""
SPEC: dict[str, Any] = {
    "model": "digits_cnn",
    "cluster": "local-hetero",
    "plan": PLAN,
    "steps": 2,
    "data": "digits",
}
PLANNED: dict[str, Any] = {"model": "digits_cnn", "cluster": "local-hetero", "planner": "dp"}


def _without(spec: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in names}


BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    (SPEC | {"optimizer": "lbfgs"}, "optimizer: one of ['sgd', 'adam', 'adamw'], got 'lbfgs'"),
    (SPEC | {"planner": "dp"}, "plan, planner: give exactly one"),
    (_without(SPEC, "plan"), "plan, planner: give exactly one"),
    (SPEC | {"epochs": 1}, "steps, epochs: give at most one"),
    (SPEC | {"steps": 0}, "steps: must be >= 1, got 0"),
    (SPEC | {"checkpoint_every": -1}, "checkpoint_every: must be >= 0, got -1"),
    (SPEC | {"steps": 10**12}, "spec.steps: 1000000000000 is over the limit of 10000000"),
    (SPEC | {"lr": 0}, "spec.lr: must be > 0, got 0"),
    (SPEC | {"replan_threshold": 1.5}, "spec.replan_threshold: 1.5 is over the limit of 1"),
    (SPEC | {"replan_threshold": -0.1}, "spec.replan_threshold: must be >= 0, got -0.1"),
    (SPEC | {"elastic": "maybe"}, "spec.elastic: Input should be a valid boolean"),
    (SPEC | {"timeout_s": 0}, "timeout_s: must be > 0, got 0"),
    (SPEC | {"data": "parquet:/x"}, "data: 'parquet:/x' is none of"),
    (SPEC | {"data": "imagefolder:images"}, "data: the service needs an absolute path"),
    (SPEC | {"loss": "mse"}, "loss: 'mse' is neither 'cross-entropy' nor"),
    (SPEC | {"checkpoint_dir": "ckpt"}, "checkpoint_dir: the service needs an absolute path"),
    (SPEC | {"resume_from": "ckpt/step-2"}, "resume_from: the service needs an absolute path"),
    (SPEC | {"options": {"x": 1}}, "options: only apply with planner"),
    (SPEC | {"unknown": 1}, "spec.unknown: Extra inputs are not permitted"),
    (SPEC | {"steps": "many"}, "spec.steps: Input should be a valid integer"),
    (SPEC | {"plan": {"global_batch": 8}}, "stages"),
    (
        SPEC | {"plan": PLAN | {"stages": [PLAN["stages"][0] | {"devices": ["n9/x:0"]}]}},
        "n9/x:0",
    ),
    (PLANNED | {"planner": "zz"}, "planner: unknown planner 'zz'"),
    (PLANNED | {"options": {"no_such_option": 1}}, "no_such_option"),
    (_without(SPEC, "model"), "model, profile: give exactly one"),
    (SPEC | {"model": "no_such_model"}, "model: unknown model 'no_such_model'"),
    (SPEC | {"resume_from": "pp-0123456789abcdef"}, "resume_from: no job 'pp-0123456789abcdef'"),
]


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS)
def test_a_bad_train_spec_is_422_naming_the_field_and_nothing_is_queued(
    app_client: TestClient, fake_backend: FakeBackend, spec: dict[str, Any], message: str
) -> None:
    start = time.perf_counter()
    r = app_client.post("/v1/jobs", json={"kind": "train", "spec": spec})
    assert time.perf_counter() - start < 5.0
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert message in detail
    assert "\n" not in detail
    assert fake_backend.submitted == []
    assert app_client.get("/v1/jobs").json()["items"] == []


CODE = [
    ({"data": "my_pkg.data:batches"}, "data: 'my_pkg.data:batches' names code"),
    ({"loss": "my_pkg.losses:focal"}, "loss: 'my_pkg.losses:focal' names code"),
    ({"model": "my_pkg.models:make", "input_shape": [8]}, "model: 'my_pkg.models:make' names"),
]


@pytest.mark.parametrize(("fields", "message"), CODE)
def test_code_in_a_train_spec_is_refused_while_the_setting_is_off(
    app_client: TestClient, fake_backend: FakeBackend, fields: dict[str, Any], message: str
) -> None:
    r = app_client.post("/v1/jobs", json={"kind": "train", "spec": SPEC | fields})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail.startswith(message) and "PIPEPLAN_ALLOW_CODE is off" in detail
    assert fake_backend.submitted == []


def _client(settings: Settings, store: Store, backend: FakeBackend, worker: FitWorker) -> Any:
    return TestClient(
        create_app(settings, store=store, backend=backend, fit_worker=worker), headers=AUTH
    )


@pytest.fixture
def code_client(
    tmp_path: Path, store: Store, fake_backend: FakeBackend, fit_worker: FitWorker
) -> Iterator[TestClient]:
    """A client of an app whose settings allow code."""
    settings = make_settings(tmp_path, allow_code=True, jobs_dir=tmp_path / "jobs")
    with _client(settings, store, fake_backend, fit_worker) as client:
        yield client


@pytest.fixture
def jobs_settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path, jobs_dir=tmp_path / "jobs")


@pytest.fixture
def train_client(
    jobs_settings: Settings, store: Store, fake_backend: FakeBackend, fit_worker: FitWorker
) -> Iterator[TestClient]:
    """A client of an app whose jobs' folders are under ``tmp_path/jobs``."""
    with _client(jobs_settings, store, fake_backend, fit_worker) as client:
        yield client


def test_with_the_setting_on_a_data_and_loss_of_code_are_queued_unimported(
    code_client: TestClient, fake_backend: FakeBackend
) -> None:
    spec = SPEC | {"data": "no_such_pkg.data:batches", "loss": "no_such_pkg.losses:focal"}
    r = code_client.post("/v1/jobs", json={"kind": "train", "spec": spec})
    assert r.status_code == 201, r.text
    assert len(fake_backend.submitted) == 1


def test_code_that_the_setting_allows_is_still_checked(
    code_client: TestClient, fake_backend: FakeBackend
) -> None:
    spec = SPEC | {"engine": "torch-pipelining", "loss": "no_such_pkg.losses:mine"}
    r = code_client.post("/v1/jobs", json={"kind": "train", "spec": spec})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith(
        "loss: engine torch-pipelining trains with cross-entropy only"
    )
    assert fake_backend.submitted == []


def test_a_path_of_data_is_not_taken_for_code(train_client: TestClient, tmp_path: Path) -> None:
    spec = SPEC | {"data": f"tokens:{tmp_path / 'tokens.bin'}"}
    r = train_client.post("/v1/jobs", json={"kind": "train", "spec": spec})
    assert r.status_code == 201, r.text


def test_a_train_job_without_a_folder_gets_its_own_and_keeps_one_it_names(
    train_client: TestClient, tmp_path: Path
) -> None:
    spec = SPEC | {"checkpoint_every": 1}  # every step, into the job's own folder
    r = train_client.post("/v1/jobs", json={"kind": "train", "spec": spec})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["kind"] == "train" and job["state"] == "queued"
    expected = checkpoint_folder(tmp_path / "jobs", job["id"])
    assert (
        job["spec"]["checkpoint_dir"]
        == str(expected)
        == str(tmp_path / "jobs" / job["id"] / "checkpoints")
    )

    named = str(tmp_path / "mine")
    r = train_client.post(
        "/v1/jobs", json={"kind": "train", "spec": SPEC | {"checkpoint_dir": named}}
    )
    assert r.json()["spec"]["checkpoint_dir"] == named


def test_resume_from_a_job_id_resumes_from_that_jobs_checkpoints(
    train_client: TestClient, tmp_path: Path
) -> None:
    first = train_client.post("/v1/jobs", json={"kind": "train", "spec": SPEC}).json()
    again = SPEC | {"steps": 4, "resume_from": first["id"]}
    r = train_client.post("/v1/jobs", json={"kind": "train", "spec": again})
    assert r.status_code == 422  # it has written nothing yet
    assert r.json()["detail"] == (
        f"resume_from: job {first['id']!r} (queued) has no checkpoint yet "
        f"(none in {first['spec']['checkpoint_dir']!r})"
    )
    Path(first["spec"]["checkpoint_dir"]).mkdir(parents=True)
    r = train_client.post("/v1/jobs", json={"kind": "train", "spec": again})
    assert r.status_code == 201, r.text
    second = r.json()
    assert second["spec"]["resume_from"] == first["spec"]["checkpoint_dir"]
    assert second["spec"]["checkpoint_dir"] != first["spec"]["checkpoint_dir"]

    path = str(tmp_path / "elsewhere" / "step-2")
    r = train_client.post("/v1/jobs", json={"kind": "train", "spec": SPEC | {"resume_from": path}})
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["resume_from"] == path


def test_resume_from_a_job_of_another_kind_is_422(train_client: TestClient) -> None:
    plan_job = train_client.post("/v1/jobs", json={"kind": "plan", "spec": PLANNED}).json()
    r = train_client.post(
        "/v1/jobs", json={"kind": "train", "spec": SPEC | {"resume_from": plan_job["id"]}}
    )
    assert r.status_code == 422
    assert r.json()["detail"] == (
        f"resume_from: job {plan_job['id']!r} is a plan job, not a train job"
    )


def test_a_planned_train_job_is_queued(train_client: TestClient, fake_backend: FakeBackend) -> None:
    r = train_client.post("/v1/jobs", json={"kind": "train", "spec": PLANNED | {"epochs": 1}})
    assert r.status_code == 201, r.text
    assert [s.job_id for s in fake_backend.submitted] == [r.json()["id"]]
