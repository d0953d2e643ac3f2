"""End to end on a real Ray: ``pipeplan serve`` (uvicorn on a free loopback port) with its
embedded ``ray start`` cluster (one node, token auth, the Jobs API on free ports); a ``plan``
job runs as a Ray Job whose entrypoint (``pipeplan job run``) fetches its spec and posts its
events over HTTP. One service and one cluster for the module; a clean shutdown leaves no Ray
process of it behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor.local.persistent_cluster import (
    PersistentCluster,
    is_running,
    read_state,
    stop_persistent,
)
from pipeplan.executor.ray_jobs import RayJobs, ray_token
from pipeplan.service.api.backend import BackendState, Submission
from pipeplan.service.api.ray_jobs import JOB_TOKEN_ENV, RayJobsBackend
from pipeplan.service.tasks.common import cluster_spec, zoo_profile
from pipeplan.service.tasks.plan import PlanRequest, plan
from pipeplan.service.tasks.progress import QUIET
from tests.core.test_formats import PROFILE

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

TOKEN = "e2e-api-token"
SPEC: dict[str, Any] = {"profile": PROFILE, "cluster": "local-hetero", "planner": "dp", "batch": 8}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    url: str
    client: httpx.Client
    process: subprocess.Popen[bytes]
    cluster: PersistentCluster
    log: Path
    tmp: Path
    port: int


def _wait_healthy(client: httpx.Client, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"serve did not answer in 150 s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def start_serve(tmp: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``pipeplan serve`` on ``port`` with its database, cluster and state under ``tmp``."""
    env = {
        **os.environ,
        "PIPEPLAN_API_TOKEN": TOKEN,
        "PIPEPLAN_POOL_SIZE": "0",  # every job a Ray Job (the pool has test_pool_ray.py)
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "XDG_DATA_HOME": str(tmp / "data"),
    }
    args = ["--port", str(port), "--db", f"sqlite:///{tmp / 'jobs.db'}"]
    args += ["--cluster", str(tmp / "solo.yaml"), "--state-dir", str(tmp / "state")]
    exe = str(Path(sys.executable).with_name("pipeplan"))
    with open(log, "ab") as out:
        return subprocess.Popen([exe, "serve", *args], env=env, stdout=out, stderr=out)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("serve")
    hetero = cluster_spec("local-hetero")
    ClusterSpec("solo", hetero.device_types, (Node("n0", {"fast": 1}),)).save(tmp / "solo.yaml")
    port, log = free_port(), tmp / "serve.log"
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    proc = start_serve(tmp, port, log)
    svc: Service | None = None
    try:
        _wait_healthy(client, proc, log)
        svc = Service(url, client, proc, read_state(tmp / "state"), log, tmp, port)
        yield svc
    finally:
        code = _stop(svc.process if svc is not None else proc)
        client.close()
        if svc is not None and is_running(svc.cluster):  # a test failed half-way
            stop_persistent(tmp / "state")
    assert code == 0, log.read_text()[-3000:]


def live_placement_groups(service: Service) -> list[dict[str, Any]]:
    """The cluster's placement groups not yet removed, from Ray's state API."""
    token = ray_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{service.cluster.dashboard_url}/api/v0/placement_groups?limit=1000"
    r = httpx.get(url, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = r.json()["data"]["result"]["result"]
    return [g for g in rows if g.get("state") != "REMOVED"]


def wait_done(client: httpx.Client, job_id: str, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not done in {timeout_s} s: {job}")


def job_token(service: Service, job_id: str) -> str:
    """The job's token, as Ray holds it in the job's environment (tests only)."""
    info = RayJobs(service.cluster.dashboard_url).client().get_job_info(job_id)
    return str(info.runtime_env["env_vars"][JOB_TOKEN_ENV])


@pytest.fixture(scope="module")
def done_job(service: Service) -> dict[str, Any]:
    r = service.client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC, "name": "e2e"})
    assert r.status_code == 201, r.text
    job = wait_done(service.client, r.json()["id"])
    assert job["state"] == "succeeded", (job, service.client.get(f"/v1/jobs/{job['id']}/logs"))
    return job


def test_a_plan_job_runs_as_a_ray_job_and_gets_the_local_result(
    service: Service, done_job: dict[str, Any]
) -> None:
    expected = plan(PlanRequest.model_validate(SPEC)).to_dict()
    result = done_job["result"]
    for key in ("plan", "estimate", "planner", "evaluations"):
        assert result[key] == expected[key], key
    assert done_job["ray_job_id"] == done_job["id"]
    logs = service.client.get(f"/v1/jobs/{done_job['id']}/logs")
    assert logs.status_code == 200 and "search dp" in logs.text


def test_its_events_have_every_seq_once_and_end_with_the_result(
    service: Service, done_job: dict[str, Any]
) -> None:
    events = service.client.get(f"/v1/jobs/{done_job['id']}/events").json()
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "result" and events[-1]["data"] == done_job["result"]
    evaluations = [e for e in events if e["type"] == "evaluation"]
    assert len(evaluations) == done_job["result"]["evaluations"]
    assert any(e["type"] == "progress" for e in events)


def test_a_job_token_cannot_post_the_events_of_another_job(
    service: Service, done_job: dict[str, Any]
) -> None:
    r = service.client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC})
    other = wait_done(service.client, r.json()["id"])
    token = job_token(service, done_job["id"])
    event = {"seq": 10_000, "type": "progress", "data": {}}
    forged = httpx.post(
        f"{service.url}/v1/jobs/{other['id']}/events",
        json=event,
        headers={"Authorization": f"Bearer {token}"},
    )
    assert forged.status_code == 403
    guessed = httpx.post(
        f"{service.url}/v1/jobs/{other['id']}/events",
        json=event,
        headers={"Authorization": "Bearer not-a-job-token"},
    )
    assert guessed.status_code == 401


def test_a_repeated_submission_starts_nothing(service: Service, done_job: dict[str, Any]) -> None:
    backend = RayJobsBackend(service.cluster.dashboard_url)
    assert backend.ready() is None
    again = Submission(done_job["id"], service.url, "whatever")
    assert backend.submit(again) == done_job["id"]
    assert backend.status(done_job["id"]).state is BackendState.SUCCEEDED
    assert backend.status("no-such-job").state is BackendState.UNKNOWN
    assert backend.logs("no-such-job") == ""


def submit_and_wait(service: Service, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    r = service.client.post("/v1/jobs", json={"kind": kind, "spec": spec})
    assert r.status_code == 201, r.text
    job = wait_done(service.client, r.json()["id"], timeout_s=180)
    assert job["state"] == "succeeded", (job, service.client.get(f"/v1/jobs/{job['id']}/logs"))
    return job


def test_a_parallel_reward_job_costs_its_plans_on_the_jobs_cluster(service: Service) -> None:
    base = SPEC | {"planner": "genetic", "budget": {"evaluations": 200}, "seed": 3}
    job = submit_and_wait(service, "plan", base | {"reward": "parallel", "workers": 2})
    local = plan(PlanRequest.model_validate(base)).to_dict()
    for key in ("plan", "estimate", "evaluations"):
        assert job["result"][key] == local[key], key
    logs = service.client.get(f"/v1/jobs/{job['id']}/logs").text
    assert "joined" in logs or "connected" in logs or "search genetic" in logs


def test_a_measured_profile_job_times_the_layers_on_the_jobs_cluster(service: Service) -> None:
    job = submit_and_wait(service, "profile", {"model": "digits_cnn", "measure": True})
    doc = job["result"]
    assert doc["name"] == "digits_cnn" and len(doc["layers"]) > 3
    events = service.client.get(f"/v1/jobs/{job['id']}/events").json()
    assert events[-1]["type"] == "result" and events[-1]["data"] == doc


def solo_run() -> dict[str, Any]:
    """A ``run`` job of digits_cnn in one stage on the module's one device."""
    solo = ClusterSpec(
        "solo", cluster_spec("local-hetero").device_types, (Node("n0", {"fast": 1}),)
    )
    plan_doc = Plan(16, (Stage((0, 8), ("n0/fast:0",), 8),)).to_dict()
    profile = zoo_profile("digits_cnn", None, QUIET).to_dict()
    return {"plan": plan_doc, "profile": profile, "cluster": solo.to_dict(), "steps": 6}


def test_two_runs_on_one_device_take_turns_and_leave_no_placement_group(
    service: Service,
) -> None:
    """The second job waits, queued, saying the first holds its device, then succeeds: held
    back by the queue at first; if it reaches Ray while the first still holds the device
    (timing), its ``waiting`` events name the device and the first job. The executor's test
    of the reservation itself is in ``tests/executor/test_failures.py``."""
    spec = solo_run()
    first, second = (
        service.client.post("/v1/jobs", json={"kind": "run", "spec": spec}).json() for _ in range(2)
    )
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        job = service.client.get(f"/v1/jobs/{second['id']}").json()
        if job["waiting_for"] and job["waiting_for"] not in seen:
            seen.append(job["waiting_for"])
        if job["state"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.2)
    done = [wait_done(service.client, j["id"]) for j in (first, second)]
    assert [j["state"] for j in done] == ["succeeded", "succeeded"], [j["error"] for j in done]
    assert {"behind": [first["id"]]} in seen or any(
        w.get("held_by") == [first["id"]] for w in seen
    ), seen
    events = service.client.get(f"/v1/jobs/{second['id']}/events").json()
    waits = [e["data"] for e in events if e["type"] == "waiting"]
    if waits:  # it reached Ray while the first held the device: it said so, then got it
        assert waits[0] == {"devices": ["n0/fast:0"], "held_by": [first["id"]]}
        assert waits[-1]["devices"] == [] and waits[-1]["waited_s"] > 0
    assert done[1]["started_at"] >= done[0]["started_at"]
    assert live_placement_groups(service) == []


def test_a_killed_service_loses_no_queued_job_and_starts_them_after_restart(
    service: Service,
) -> None:
    """kill -9 of the service with one job running on the device and two queued behind it:
    after a restart the running one finishes, the queued ones start in turn, all three
    succeed, and no placement group is left."""
    spec = solo_run()
    long_run = {**spec, "steps": 40}
    ids = [
        service.client.post("/v1/jobs", json={"kind": "run", "spec": s}).json()["id"]
        for s in (long_run, spec, spec)
    ]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        jobs = [service.client.get(f"/v1/jobs/{i}").json() for i in ids]
        if jobs[0]["state"] == "running" and all(j["state"] == "queued" for j in jobs[1:]):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"never one running and two queued: {jobs}")
    service.process.kill()  # kill -9 while the first job runs
    service.process.wait()
    service.process = start_serve(service.tmp, service.port, service.log)
    _wait_healthy(service.client, service.process, service.log)
    done = [wait_done(service.client, i, timeout_s=240) for i in ids]
    assert [j["state"] for j in done] == ["succeeded"] * 3, [j["error"] for j in done]
    assert (
        done[0]["started_at"] <= done[1]["started_at"]
        and done[0]["started_at"] <= done[2]["started_at"]
    )
    assert live_placement_groups(service) == []


def test_a_wrong_ray_token_is_named_by_ready(service: Service) -> None:
    backend = RayJobsBackend(service.cluster.dashboard_url, token="wrong")
    reason = backend.ready()
    assert reason is not None and "Invalid authentication token" in reason


def test_a_taken_port_is_refused_before_any_cluster_starts(service: Service) -> None:
    """The API's socket is bound first: a second service on the first one's port ends at
    once with the address named, and starts no cluster of its own."""
    other = service.tmp / "other"
    other.mkdir()
    (other / "solo.yaml").write_bytes((service.tmp / "solo.yaml").read_bytes())
    log = other / "serve.log"
    proc = start_serve(other, service.port, log)
    assert proc.wait(timeout=60) == 2, log.read_text()
    said = log.read_text()
    assert f"error: port: cannot listen on 127.0.0.1:{service.port} (" in said, said
    assert "starting the embedded Ray cluster" not in said
    assert not (other / "state").exists()


def test_the_cluster_outlives_a_crash_and_a_restart_reattaches(
    service: Service, done_job: dict[str, Any]
) -> None:
    service.process.kill()  # kill -9: no shutdown of anything
    service.process.wait()
    assert is_running(service.cluster)
    service.process = start_serve(service.tmp, service.port, service.log)
    _wait_healthy(service.client, service.process, service.log)
    assert "reattached to the embedded Ray cluster" in service.log.read_text()
    assert read_state(service.tmp / "state") == service.cluster
    job = service.client.get(f"/v1/jobs/{done_job['id']}").json()
    assert job["state"] == "succeeded" and job["result"] == done_job["result"]


def test_zz_a_clean_shutdown_stops_the_embedded_cluster(service: Service) -> None:
    assert is_running(service.cluster)
    assert _stop(service.process) == 0, service.log.read_text()[-3000:]
    assert not is_running(service.cluster)
    assert "stopping the embedded Ray cluster" in service.log.read_text()
