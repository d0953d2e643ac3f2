"""The client (service.client) and the CLI's submit / jobs commands, against a stub of the
HTTP contract (an httpx MockTransport) and against the app on a fake jobs backend: requests
built from the local command's flags, the job id printed, --wait ending with the local
command's table, events streamed or polled, and every refusal one line with exit code 2."""

from __future__ import annotations

import io
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from rich.console import Console

from pipeplan.service import client as client_module
from pipeplan.service.api.schemas import Event, EventType, JobState
from pipeplan.service.cli import jobs as jobs_cli
from pipeplan.service.cli.job_view import comparison_table, render_result
from pipeplan.service.cli.plan import _render_plan
from pipeplan.service.client import (
    Client,
    ServiceError,
    ServiceUnreachable,
    TokenError,
    default_token_file,
    parse_sse,
    token_from_env,
)
from pipeplan.service.render import comparison_table as local_comparison_table
from pipeplan.service.tasks.compare import CompareRequest, compare
from pipeplan.service.tasks.plan import PlanRequest, plan
from tests.core.test_formats import CLUSTER, PROFILE
from tests.service.api.conftest import API_TOKEN, FakeBackend
from tests.service.runner import run_cli

TOKEN = "api-token"
SERVER = "http://127.0.0.1:8321"
JOB_PATH = re.compile(r"^/v1/jobs/(?P<id>[^/]+)(?P<rest>/[a-z]+)?$")
Doc = dict[str, Any]


def _now() -> str:
    return datetime.now(UTC).isoformat()


class ContractStub:
    """The routes of API.md the client needs to follow a job, in memory (the app on a fake
    backend is tested below). ``script[id]`` are events a job
    posts one per poll of its events (a job that runs while the client follows it);
    ``sse`` answers ``Accept: text/event-stream`` with a stream."""

    def __init__(self, sse: bool = False) -> None:
        self.sse = sse
        self.jobs: dict[str, Doc] = {}
        self.events: dict[str, list[Doc]] = {}
        self.script: dict[str, list[tuple[EventType, Doc]]] = {}
        self.next_script: list[tuple[EventType, Doc]] = []
        self.streams = 0
        self.bodies: list[Doc] = []  # every POST /v1/jobs, as sent

    def add_job(self, kind: str, spec: Doc, name: str | None = None) -> Doc:
        job_id = f"job-{len(self.jobs) + 1:04d}"
        job = {"id": job_id, "kind": kind, "state": "queued", "name": name, "spec": spec,
               "created_at": _now()}  # fmt: skip
        self.jobs[job_id], self.events[job_id] = job, []
        self.script[job_id], self.next_script = self.next_script, []
        return job

    def post(self, job_id: str, kind: EventType, data: Doc) -> None:
        """What the control endpoint does with a job's event."""
        job, events = self.jobs[job_id], self.events[job_id]
        events.append({"seq": len(events), "type": kind.value, "data": data,
                       "received_at": _now()})  # fmt: skip
        if job["state"] == "queued":
            job["state"] = "running"
        if kind is EventType.PROGRESS:
            job["progress"] = data
        elif kind is EventType.RESULT:
            job["state"], job["result"] = "succeeded", data
        elif kind is EventType.ERROR:
            job["state"], job["error"] = "failed", data["message"]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return httpx.Response(403, json={"detail": "token: not valid for this service"})
        if request.url.path == "/v1/jobs":
            return self._jobs(request)
        m = JOB_PATH.match(request.url.path)
        if m is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        if m["id"] == "boom":
            return httpx.Response(500, text="Internal Server Error")
        if m["id"] not in self.jobs:
            return httpx.Response(404, json={"detail": f"job: no job {m['id']!r}"})
        if m["rest"] == "/events":
            return self._events(request, m["id"])
        return httpx.Response(200, json=self.jobs[m["id"]])

    def _jobs(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            body = json.loads(request.content)
            self.bodies.append(body)
            if body["kind"] not in ("profile", "plan", "compare", "run"):
                return httpx.Response(422, json={"detail": [
                    {"loc": ["body", "kind"], "msg": "Input should be 'profile', 'plan', "
                     "'compare' or 'run'", "input": body["kind"]}]})  # fmt: skip
            job = self.add_job(body["kind"], body["spec"], body["name"])
            return httpx.Response(201, json=job)
        q = request.url.params
        items = [
            j
            for j in reversed(self.jobs.values())
            if q.get("state", j["state"]) == j["state"] and q.get("kind", j["kind"]) == j["kind"]
        ]
        limit = int(q.get("limit", 100))
        more = items[limit:]
        return httpx.Response(200, json={"items": items[:limit], "next": "c1" if more else None})

    def _events(self, request: httpx.Request, job_id: str) -> httpx.Response:
        script = self.script.get(job_id)
        if script:
            self.post(job_id, *script.pop(0))
        after = int(request.url.params.get("after", -1))
        new = [e for e in self.events[job_id] if e["seq"] > after]
        if not (self.sse and "text/event-stream" in request.headers.get("accept", "")):
            return httpx.Response(200, json=new)
        self.streams += 1
        text = "".join(f"id: {e['seq']}\nevent: {e['type']}\ndata: {json.dumps(e)}\n\n"
                       for e in new)  # fmt: skip
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


@pytest.fixture
def stub() -> ContractStub:
    return ContractStub()


def cli_on(
    http: httpx.Client, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Any:
    """``pipeplan ARGS`` with the service commands sending through ``http``."""
    monkeypatch.setattr(jobs_cli, "Client", lambda server, token: Client(server, token, http=http))

    def run(*args: str) -> tuple[int, str, str]:
        return run_cli(monkeypatch, capsys, *args)

    return run


@pytest.fixture
def cli(
    stub: ContractStub, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Any]:
    """``pipeplan ARGS`` talking to the stub."""
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", TOKEN)
    with httpx.Client(transport=httpx.MockTransport(stub)) as http:
        yield cli_on(http, monkeypatch, capsys)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    cluster, profile = tmp_path / "cluster.json", tmp_path / "profile.json"
    cluster.write_text(json.dumps(CLUSTER))
    profile.write_text(json.dumps(PROFILE))
    return cluster, profile


def plan_args(files: tuple[Path, Path]) -> tuple[str, ...]:
    """``submit plan`` with the flags that build :func:`plan_request`."""
    cluster, profile = files
    return ("submit", "plan", "--cluster", str(cluster), "--profile", str(profile),
            "--planner", "brute", "--batch", "8")  # fmt: skip


def plan_request() -> PlanRequest:
    return PlanRequest(profile=PROFILE, cluster=CLUSTER, planner="brute", batch=8)


# --- submit -----------------------------------------------------------------------------------


def test_submit_sends_the_request_the_local_flags_build(
    cli: Any, stub: ContractStub, files: tuple[Path, Path]
) -> None:
    code, out, err = cli(*plan_args(files), "--name", "first")
    assert (code, err) == (0, "")
    job = stub.jobs[out.strip()]
    assert job["kind"] == "plan" and job["name"] == "first"
    assert job["spec"] == plan_request().model_dump(mode="json", exclude_defaults=True)
    assert job["spec"]["cluster"] == CLUSTER  # the file's document, not its path


def test_submit_takes_the_whole_request_with_spec(
    cli: Any, stub: ContractStub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = {"cluster": "local-hetero", "model": "alexnet", "planners": ["dp", "greedy"]}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(spec)))
    code, out, _ = cli("submit", "compare", "--spec", "-", "--json")
    assert code == 0
    assert json.loads(out)["spec"] == spec
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    code, out, _ = cli("submit", "compare", "--spec", str(tmp_path / "spec.json"))
    assert code == 0 and stub.jobs[out.strip()]["spec"] == spec


def test_submit_sends_the_queue_fields_beside_the_spec(
    cli: Any, stub: ContractStub, files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = ("--priority", "3", "--deadline-s", "60", "--retries", "2")
    code, _, err = cli(*plan_args(files), *flags)
    assert (code, err) == (0, "")
    sent = stub.bodies[-1]
    assert (sent["priority"], sent["deadline_s"], sent["retries"]) == (3, 60.0, 2)
    assert sent["spec"] == plan_request().model_dump(mode="json", exclude_defaults=True)
    code, _, _ = cli(*plan_args(files))
    assert code == 0 and not {"priority", "deadline_s", "retries"} & set(stub.bodies[-1])
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"model": "alexnet"})))
    code, _, err = cli("submit", "profile", "--spec", "-", "--priority", "-1")  # with --spec
    assert (code, err) == (0, "") and stub.bodies[-1]["priority"] == -1
    code, _, err = cli("submit", "profile", "alexnet", "--retries", "1")  # a search's field
    assert code == 2 and "--retries" in err


def test_submit_refuses_spec_with_flags_and_missing_flags(cli: Any) -> None:
    code, _, err = cli("submit", "plan", "--spec", "x.json", "--batch", "8", "--planner", "dp")
    assert code == 2
    assert err == "error: --spec: not with --planner, --batch (the spec is the whole request)\n"
    code, _, err = cli("submit", "plan", "--cluster", "local-hetero", "--model", "alexnet")
    assert (code, err) == (
        2,
        "error: --planner: required (or give the whole request with --spec)\n",
    )


def plan_events() -> tuple[list[tuple[EventType, Doc]], Any]:
    """What a job running :func:`plan_request` posts, and the use-case's answer."""
    done = plan(plan_request())
    return [
        (EventType.PROGRESS, {"evaluations": 1, "best_value": 0.5, "elapsed_s": 0.1}),
        (
            EventType.EVALUATION,
            {"plan": {}, "value": 0.4, "batch_time_s": 0.4, "source": "simulated"},
        ),
        (EventType.PROGRESS, {"evaluations": 2, "best_value": None, "elapsed_s": 0.2}),
        (EventType.RESULT, json.loads(json.dumps(done.to_dict()))),
    ], done


@pytest.mark.parametrize("sse", [False, True])
def test_wait_follows_the_job_and_ends_with_the_local_table(
    sse: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    stub = ContractStub(sse=sse)
    stub.next_script, done = plan_events()
    job_id = stub.add_job("plan", plan_request().model_dump(mode="json"))["id"]
    client = Client(SERVER, TOKEN, http=httpx.Client(transport=httpx.MockTransport(stub)))
    seen: list[Event] = []
    job = client.wait(job_id, seen.append)
    assert job.state is JobState.SUCCEEDED
    assert [e.seq for e in seen] == [0, 1, 2, 3] and seen[-1].type is EventType.RESULT
    assert stub.streams == (4 if sse else 0)  # one stream per event the stub releases
    _render_plan(done)
    local = capsys.readouterr().out
    render_result(job)
    assert capsys.readouterr().out == local  # the same table and lines as `pipeplan plan`


def test_submit_wait_json_prints_the_result_document(
    cli: Any, stub: ContractStub, files: tuple[Path, Path]
) -> None:
    stub.next_script, done = plan_events()
    code, out, err = cli(*plan_args(files), "--wait", "--json")
    assert code == 0 and err.startswith("submitted plan job job-0001")
    assert json.loads(out)["estimate"] == done.to_dict()["estimate"]


def test_submit_wait_on_a_failed_job_exits_1(cli: Any, stub: ContractStub) -> None:
    stub.next_script = [(EventType.ERROR, {"message": "stage 1: node lost"})]
    code, out, err = cli("submit", "profile", "alexnet", "--wait")
    assert (code, out) == (1, "")
    assert err.splitlines()[-1] == "error: job job-0001 failed: stage 1: node lost"


def test_compare_table_is_the_local_one(capsys: pytest.CaptureFixture[str]) -> None:
    request = CompareRequest(
        profile=PROFILE, cluster=CLUSTER, planners=["brute", "greedy"], batch=8
    )
    done = compare(request)
    doc = json.loads(json.dumps(done.to_dict()))
    console_local, console_doc = io.StringIO(), io.StringIO()
    Console(file=console_local, width=200).print(local_comparison_table(done.problem, done.rows))
    Console(file=console_doc, width=200).print(comparison_table(doc))
    assert console_doc.getvalue() == console_local.getvalue()


# --- the client's plumbing --------------------------------------------------------------------


def test_parse_sse_reads_documents_and_id_event_data() -> None:
    doc = {"seq": 4, "type": "progress", "data": {"evaluations": 3}, "received_at": _now()}
    lines = [f"data: {json.dumps(doc)}", "", ": keep-alive", "", "id: 5", "event: result",
             'data: {"plan": 1}', "", "event: end", 'data: {"state": "succeeded"}', "",
             "id: 6", "event: result", "data: {}", ""]  # fmt: skip
    events = list(parse_sse(iter(lines)))
    assert [(e.seq, e.type, e.data) for e in events] == [
        (4, EventType.PROGRESS, {"evaluations": 3}),
        (5, EventType.RESULT, {"plan": 1}),
    ]


def test_token_from_flags_env_file_and_the_generated_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", " t1 ")
    assert token_from_env() == "t1"
    monkeypatch.delenv("PIPEPLAN_API_TOKEN")
    (tmp_path / "tok").write_text("t2\n")
    monkeypatch.setenv("PIPEPLAN_API_TOKEN_FILE", str(tmp_path / "tok"))
    assert token_from_env() == "t2"
    monkeypatch.delenv("PIPEPLAN_API_TOKEN_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert default_token_file() == tmp_path / "pipeplan" / "api_token"
    with pytest.raises(TokenError, match="api_token"):
        token_from_env()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- jobs ---------------------------------------------------------------------------------------


def test_jobs_ls_filters_and_pages(cli: Any, stub: ContractStub) -> None:
    first = stub.add_job("plan", {"cluster": "local-hetero"}, name="mine")["id"]
    second = stub.add_job("profile", {"model": "alexnet"})["id"]
    code, out, _ = cli("jobs", "ls")
    assert code == 0 and out.index(second) < out.index(first) and "mine" in out
    code, out, _ = cli("jobs", "ls", "--kind", "plan", "--json")
    assert [j["id"] for j in json.loads(out)["items"]] == [first]
    code, out, err = cli("jobs", "ls", "--limit", "1")
    assert first not in out and err == "more: pipeplan jobs ls --cursor c1\n"


def test_jobs_say_whether_their_predictions_are_calibrated(cli: Any, stub: ContractStub) -> None:
    fit = {"source": "service", "runs": 11, "fitted_at": "2026-11-25T04:10:00+00:00"}
    ids = {
        "service": stub.add_job("plan", {"cluster": {**CLUSTER, "calibration": {"fit": fit}}}),
        "own": stub.add_job("run", {"cluster": {**CLUSTER, "calibration": {"fit": {}}}}),
        "none": stub.add_job("compare", {"cluster": "local-hetero"}),
        "profile": stub.add_job("profile", {"model": "alexnet"}),
    }
    code, out, _ = cli("jobs", "ls")
    assert code == 0 and "calibrated" in out
    last_cell = {
        how: next(line for line in out.splitlines() if job["id"] in line).split("│")[-2].strip()
        for how, job in ids.items()
    }
    assert last_cell == {"service": "11 runs", "own": "own", "none": "no",
                         "profile": "-"}  # fmt: skip
    shown = {how: cli("jobs", "show", job["id"])[1] for how, job in ids.items()}
    assert (
        "predictions     calibrated from 11 runs (fitted 2026-11-25T04:10:00+00:00)\n"
        in (shown["service"])
    )
    assert "predictions     calibrated (the request's own)\n" in shown["own"]
    assert "predictions     uncalibrated spec\n" in shown["none"]
    assert "predictions" not in shown["profile"]


def test_a_token_file_that_cannot_be_read_is_one_line(
    cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PIPEPLAN_API_TOKEN")
    monkeypatch.setenv("PIPEPLAN_API_TOKEN_FILE", "missing-token-file")
    code, out, err = cli("jobs", "ls")
    assert (code, out) == (2, "")
    assert err.startswith("error: token: cannot read missing-token-file (PIPEPLAN_API_TOKEN_FILE)")


def test_a_validation_error_list_is_one_line(stub: ContractStub) -> None:
    client = Client(SERVER, TOKEN, http=httpx.Client(transport=httpx.MockTransport(stub)))
    with pytest.raises(ServiceError) as e:
        client.submit("bogus", {})
    assert e.value.status == 422
    assert e.value.detail == (
        "body.kind: Input should be 'profile', 'plan', 'compare' or 'run', got 'bogus'"
    )


def test_a_service_error_exits_3(cli: Any) -> None:
    assert cli("jobs", "show", "boom") == (
        3, "", "error: the service failed (500): Internal Server Error\n"
    )  # fmt: skip


def test_an_unreachable_server_is_one_line_from_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("PIPEPLAN_SERVER", url)
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", TOKEN)
    code, out, err = run_cli(monkeypatch, capsys, "jobs", "ls")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: server: no pipeplan service answers at {url} (ConnectError")
    assert len(err.splitlines()) == 1


# --- against the service (the app on a fake jobs backend) ---------------------------------------


@pytest.fixture
def served_cli(
    app_client: TestClient, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Any:
    """``pipeplan ARGS`` talking to the app."""
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", API_TOKEN)
    return cli_on(app_client, monkeypatch, capsys)


def run_job(http: httpx.Client, backend: FakeBackend, events: list[tuple[EventType, Doc]]) -> None:
    """The job side: wait for the submission, then post ``events`` with the job's token."""
    deadline = time.monotonic() + 10
    while not backend.submitted and time.monotonic() < deadline:
        time.sleep(0.02)
    job_id = backend.submitted[0].job_id
    auth = {"Authorization": f"Bearer {backend.token_of(job_id)}"}
    for seq, (kind, data) in enumerate(events):
        time.sleep(0.05)
        body = {"seq": seq, "type": kind.value, "data": data}
        http.post(f"/v1/jobs/{job_id}/events", json=body, headers=auth).raise_for_status()


def test_the_service_takes_a_submitted_plan_and_lists_it(
    served_cli: Any, fake_backend: FakeBackend, files: tuple[Path, Path]
) -> None:
    code, out, err = served_cli(*plan_args(files))
    assert (code, err) == (0, "")
    job_id = out.strip()
    assert [s.job_id for s in fake_backend.submitted] == [job_id]
    code, out, _ = served_cli("jobs", "ls", "--json")
    assert [j["id"] for j in json.loads(out)["items"]] == [job_id]
    code, out, _ = served_cli("jobs", "show", job_id)
    assert code == 0 and "state           queued" in out
    fake_backend.log_text[job_id] = "hello from ray\n"
    assert served_cli("jobs", "logs", job_id)[:2] == (0, "hello from ray\n")
    assert served_cli("jobs", "cancel", job_id)[:2] == (0, f"{job_id} cancelled\n")
    code, _, err = served_cli("jobs", "cancel", job_id)
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1


def test_the_service_refuses_bad_input_and_a_wrong_token_in_one_line(served_cli: Any) -> None:
    code, out, err = served_cli("submit", "plan", "--cluster", "local-hetero", "--model",
                                "alexnet", "--planner", "nope")  # fmt: skip
    assert (code, out) == (2, "")
    assert err.startswith("error: planner: unknown planner 'nope'") and err.count("\n") == 1
    code, out, err = served_cli("submit", "plan", "--spec", "-", "--token", "wrong")
    assert (code, out) == (2, "") and err.startswith("error: ") and err.count("\n") == 1
    code, out, err = served_cli("jobs", "ls", "--token", "wrong")
    assert (code, out) == (2, "") and err.startswith("error: ") and err.count("\n") == 1
    code, _, err = served_cli("jobs", "show", "no-such-job")
    assert code == 2 and "no-such-job" in err and err.count("\n") == 1


def test_submit_wait_follows_a_running_job_to_the_local_table(
    served_cli: Any,
    app_client: TestClient,
    fake_backend: FakeBackend,
    files: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    events, done = plan_events()
    job_side = threading.Thread(target=run_job, args=(app_client, fake_backend, events))
    job_side.start()
    code, out, err = served_cli(*plan_args(files), "--wait")
    job_side.join()
    assert code == 0, err
    _render_plan(done)
    assert out == capsys.readouterr().out  # the same table and lines as `pipeplan plan`
    job_id = fake_backend.submitted[0].job_id
    code, out, _ = served_cli("jobs", "events", job_id, "--follow")
    assert [line.split()[:2] for line in out.splitlines()] == [
        ["0", "progress"], ["1", "evaluation"], ["2", "progress"], ["3", "result"]
    ]  # fmt: skip
    assert served_cli("jobs", "events", job_id, "--after", "2")[1].split()[:2] == ["3", "result"]


def test_follow_waits_for_a_service_that_restarts(
    stub: ContractStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "POLL_S", 0.01)
    stub.next_script, _ = plan_events()
    job_id = stub.add_job("plan", {})["id"]
    down = iter([False, True, True, True])  # the second to fourth requests find no service

    def flaky(request: httpx.Request) -> httpx.Response:
        if next(down, False):
            raise httpx.ConnectError("connection refused", request=request)
        return stub(request)

    client = Client(SERVER, TOKEN, http=httpx.Client(transport=httpx.MockTransport(flaky)))
    assert [e.seq for e in client.follow(job_id)] == [0, 1, 2, 3]
    down = iter([True])
    with pytest.raises(ServiceUnreachable, match="no pipeplan service answers"):
        list(client.follow(job_id, after=-1, reconnect_s=0))


@pytest.mark.timeout(60)
def test_follow_streams_from_a_real_server(app: FastAPI, fake_backend: FakeBackend) -> None:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    serving = threading.Thread(target=server.run)
    serving.start()
    try:
        while not server.started:
            time.sleep(0.02)
        with Client(f"http://127.0.0.1:{port}", API_TOKEN) as client:
            job = client.submit("plan", plan_request().model_dump(mode="json"))
            events, _ = plan_events()
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
                job_side = threading.Thread(target=run_job, args=(http, fake_backend, events))
                job_side.start()
                seen: list[Event] = []
                done = client.wait(job.id, seen.append)
                job_side.join()
        assert done.state is JobState.SUCCEEDED and [e.seq for e in seen] == [0, 1, 2, 3]
    finally:
        server.should_exit = True
        serving.join()
