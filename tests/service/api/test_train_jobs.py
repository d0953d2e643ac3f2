"""A ``train`` job from submission to result: the job entrypoint (``pipeplan job run``) runs
in process against the app, with the use-case replaced by one that reports three steps and
two checkpoints (the real one, on a live cluster, is the ``ray`` test at the end). Its
events are stored, its progress is its latest step, its result is ``Trained.to_dict()``;
``jobs show``, ``/metrics`` and the job's page show its steps, loss and samples/s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.plan import Plan
from pipeplan.executor.elastic import Replanned
from pipeplan.executor.train import TrainResult, TrainStep
from pipeplan.service.api.app import create_app
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.schemas import TrainJobResult
from pipeplan.service.api.settings import Settings
from pipeplan.service.api.store import Store
from pipeplan.service.cli import job as job_entry
from pipeplan.service.cli import jobs as jobs_cli
from pipeplan.service.client import Client
from pipeplan.service.tasks.events import EventReporter
from pipeplan.service.tasks.requests import TrainRequest
from pipeplan.service.tasks.train import Trained
from tests.service.api.conftest import API_TOKEN, AUTH, FakeBackend, make_settings
from tests.service.runner import run_cli

PLAN = {
    "global_batch": 8,
    "stages": [{"layers": [0, 8], "devices": ["n0/fast:0"], "microbatch": 4}],
}
"""digits_cnn's 8 layers on one device."""
SPEC: dict[str, Any] = {
    "model": "digits_cnn",
    "input_size": 8,
    "cluster": "local-hetero",
    "plan": PLAN,
    "steps": 3,
    "data": "digits",
    "checkpoint_every": 2,
}
LOSSES = (2.5, 1.75, 1.25)
RATES = (800.0, 1000.0, 1200.0)


def fake_train(request: TrainRequest, reporter: EventReporter) -> Trained:
    """The use-case's reports and answer for three steps, a checkpoint after 2 and 3."""
    assert request.checkpoint_dir is not None
    folder = Path(request.checkpoint_dir)
    steps = []
    for t, (loss, rate) in enumerate(zip(LOSSES, RATES, strict=True)):
        step = TrainStep(t, loss, 0.5, 8 / rate, rate)
        steps.append(step)
        reporter.trained(step)
        if t + 1 >= 2:
            reporter.checkpointed(t + 1, folder / f"step-{t + 1}")
    result = TrainResult(tuple(steps), 0, folder / "step-3")
    return Trained(Plan.from_dict(request.plan or {}), result, predicted_step_s=0.007)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path, jobs_dir=tmp_path / "jobs")


@pytest.fixture
def client(
    settings: Settings, store: Store, fake_backend: FakeBackend, fit_worker: FitWorker
) -> Iterator[TestClient]:
    app = create_app(settings, store=store, backend=fake_backend, fit_worker=fit_worker)
    with TestClient(app, headers=AUTH) as c:
        yield c


def forward(client: TestClient) -> httpx.MockTransport:
    """A transport that hands each request of the job side to the app."""

    def send(request: httpx.Request) -> httpx.Response:
        r = client.request(
            request.method,
            request.url.raw_path.decode(),
            content=request.content,
            headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
        )
        return httpx.Response(r.status_code, content=r.content, headers=r.headers)

    return httpx.MockTransport(send)


def run_train_job(client: TestClient, backend: FakeBackend, spec: dict[str, Any]) -> str:
    """Submit a train job and run its entrypoint against the app; the job's id."""
    r = client.post("/v1/jobs", json={"kind": "train", "spec": spec, "name": "digits"})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    token = backend.token_of(job_id)
    assert job_entry.run_job(job_id, "http://testserver", token, transport=forward(client)) == 0
    return job_id


@pytest.fixture
def done(
    client: TestClient, fake_backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """The finished fake train job as the API returns it."""
    monkeypatch.setattr(job_entry, "train", fake_train)
    job_id = run_train_job(client, fake_backend, SPEC)
    job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
    return job


def test_a_train_job_posts_a_progress_per_step_a_checkpoint_each_and_its_result(
    client: TestClient, done: dict[str, Any], settings: Settings
) -> None:
    assert done["state"] == "succeeded", done["error"]
    folder = settings.jobs_root / done["id"] / "checkpoints"
    events = client.get(f"/v1/jobs/{done['id']}/events").json()
    kinds = [(e["type"], e["data"].get("step")) for e in events]
    assert kinds == [
        ("progress", None),  # running: no step yet
        ("progress", 1),
        ("progress", 2),
        ("checkpoint", 2),
        ("progress", 3),
        ("checkpoint", 3),
        ("result", None),
    ]
    steps = [e["data"] for e in events if e["type"] == "progress"][1:]
    assert [s["loss"] for s in steps] == list(LOSSES)
    assert [s["samples_per_s"] for s in steps] == list(RATES)
    checkpoints = [e["data"] for e in events if e["type"] == "checkpoint"]
    assert checkpoints == [
        {"step": 2, "path": str(folder / "step-2")},
        {"step": 3, "path": str(folder / "step-3")},
    ]
    assert done["progress"]["step"] == 3 and done["progress"]["loss"] == LOSSES[-1]


def test_a_train_jobs_result_is_the_use_cases_document(done: dict[str, Any]) -> None:
    result = done["result"]
    assert set(result) == {
        "plan",
        "first_step",
        "steps",
        "checkpoint",
        "resumed_from",
        "loss_curve",
        "measured_step_s",
        "predicted_step_s",
        "replans",
    }
    assert result["plan"] == Plan.from_dict(PLAN).to_dict()
    assert result["loss_curve"] == list(LOSSES)
    assert TrainJobResult.model_validate(result).model_extra == {}
    assert result["checkpoint"].endswith("step-3")
    assert result["measured_step_s"] == pytest.approx((8 / 1000 + 8 / 1200) / 2)  # steps 2, 3
    assert result["predicted_step_s"] == 0.007


def test_a_replan_is_a_replan_event_and_listed_in_the_result(
    client: TestClient, fake_backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elastic training's re-plan (a lost node here) posts a ``replan`` event with its
    reason, nodes, new plan, prediction and steps redone; the result lists it too."""
    old = Plan.from_dict(PLAN)
    new = Plan.from_dict(
        PLAN | {"stages": [{"layers": [0, 8], "devices": ["n2/slow:0"], "microbatch": 4}]}
    )
    lost = Replanned(
        reason="node_lost",
        step=2,
        nodes=("n0",),
        plan=new,
        predicted_step_s=0.02,
        previous_plan=old,
        previous_predicted_step_s=0.007,
        switched=True,
        steps_redone=1,
        cause="step 3: the actor and its node died",
    )

    def elastic_fake(request: TrainRequest, reporter: EventReporter) -> Trained:
        reporter.replanned(lost)
        done = fake_train(request, reporter)
        return Trained(new, done.result, done.predicted_step_s, (lost,))

    monkeypatch.setattr(job_entry, "train", elastic_fake)
    job_id = run_train_job(client, fake_backend, SPEC)
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    (replan,) = [e["data"] for e in events if e["type"] == "replan"]
    assert replan == lost.to_dict()
    assert replan["reason"] == "node_lost" and replan["nodes"] == ["n0"]
    assert replan["plan"] == new.to_dict() and replan["steps_redone"] == 1
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "succeeded", job["error"]
    assert job["result"]["replans"] == [lost.to_dict()]
    assert job["result"]["plan"] == new.to_dict()


def test_jobs_show_prints_a_train_jobs_step_loss_samples_and_result(
    client: TestClient,
    done: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(jobs_cli, "Client", lambda server, token: Client(server, token, client))
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", API_TOKEN)
    code, out, err = run_cli(monkeypatch, capsys, "jobs", "show", done["id"])
    assert code == 0, err
    assert "progress        step 3, loss 1.2500, 1,200.0 samples/s" in out
    assert "trained steps 1..3: loss 2.5000 -> 1.2500; median step 0.007 s " in out
    assert "(cost model 0.007 s)" in out
    assert f"last checkpoint: {done['result']['checkpoint']}" in out
    code, out, _ = run_cli(monkeypatch, capsys, "jobs", "events", done["id"])
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split(None, 2)[2] == "step 1, loss 2.5000, 800.0 samples/s"
    assert lines[3].split(None, 2)[1:] == [
        "checkpoint",
        f"after step 2: {done['result']['checkpoint'][:-1]}2",
    ]


def test_metrics_expose_a_train_jobs_steps_loss_and_samples_per_second(
    client: TestClient, done: dict[str, Any]
) -> None:
    text = client.get("/metrics").text
    labels = f'{{job="{done["id"]}",kind="train"}}'
    assert f"pipeplan_job_steps{labels} 3.0" in text
    assert f"pipeplan_job_loss{labels} 1.25" in text
    assert f"pipeplan_job_samples_per_second{labels} 1200.0" in text
    assert f"pipeplan_job_evaluations{labels}" not in text  # not a search
    assert 'pipeplan_events_ingested_total{type="checkpoint"} 2.0' in text


def test_the_job_page_carries_the_loss_curve_and_samples_per_second(
    client: TestClient, done: dict[str, Any]
) -> None:
    page = client.get(f"/jobs/{done['id']}")
    assert page.status_code == 200
    html = page.text
    assert 'id="training"' in html and 'id="loss-chart"' in html
    found = re.search(r'<script type="application/json" id="train-data">(.*?)</script>', html)
    assert found is not None
    data = json.loads(found.group(1))
    assert data["steps"] == [1, 2, 3]
    assert data["loss"] == list(LOSSES)
    assert data["samples_per_s"] == list(RATES)
    assert data["checkpoints"] == [2, 3]
    assert data["after"] == 6  # the seq of the last event read: the page reads on from it


def test_submit_train_sends_the_local_commands_request(
    client: TestClient,
    fake_backend: FakeBackend,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setattr(jobs_cli, "Client", lambda server, token: Client(server, token, client))
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", API_TOKEN)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    args = ("submit", "train", "--cluster", "local-hetero", "--model", "digits_cnn",
            "--input-size", "8", "--plan", str(plan), "--steps", "2", "--data", "digits",
            "--optimizer", "adam", "--lr", "0.01", "--checkpoint-every", "1")  # fmt: skip
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    job = client.get(f"/v1/jobs/{out.strip()}").json()
    assert job["kind"] == "train" and job["state"] == "queued"
    spec = job["spec"]
    assert spec["plan"] == PLAN and spec["steps"] == 2 and spec["optimizer"] == "adam"
    assert spec["checkpoint_every"] == 1 and spec["checkpoint_dir"].endswith("checkpoints")
    code, out, err = run_cli(monkeypatch, capsys, *args[:-4], "--optimizer", "lion")
    assert (code, out) == (2, "")
    assert err.startswith("error: optimizer: one of ['sgd', 'adam', 'adamw'], got 'lion'")
    assert err.count("\n") == 1
    assert len(fake_backend.submitted) == 1


# --- on a live cluster ------------------------------------------------------------------------

SMALL = ClusterSpec.load(Path(__file__).parents[3] / "examples/clusters/local-hetero.yaml")
ONE_NODE = ClusterSpec(
    "one-fast", {"fast": SMALL.device_types["fast"]}, (Node("n0", {"fast": 1}),), SMALL.network
)


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    from pipeplan.executor.local_cluster import LocalCluster

    with LocalCluster(ONE_NODE, object_store_mb=100, connect=False) as cluster:
        yield cluster.address


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_train_job_trains_on_the_cluster_and_resumes_from_its_job_id(
    client: TestClient, fake_backend: FakeBackend, address: str
) -> None:
    spec = SPEC | {"cluster": ONE_NODE.to_dict(), "address": address, "steps": 2}
    first = run_train_job(client, fake_backend, spec)
    job = client.get(f"/v1/jobs/{first}").json()
    assert job["state"] == "succeeded", job["error"]
    assert len(job["result"]["loss_curve"]) == 2 and job["result"]["checkpoint"] is not None
    assert TrainJobResult.model_validate(job["result"]).model_extra == {}  # as documented
    events = client.get(f"/v1/jobs/{first}/events").json()
    assert [e["data"]["step"] for e in events if e["type"] == "checkpoint"] == [2]

    again = run_train_job(client, fake_backend, spec | {"steps": 3, "resume_from": first})
    job = client.get(f"/v1/jobs/{again}").json()
    assert job["state"] == "succeeded", job["error"]
    assert job["result"]["first_step"] == 2 and len(job["result"]["loss_curve"]) == 1
