"""Reliability of the service on a real Ray (issue 13, item 8): ``pipeplan serve`` with its
embedded two-node ``ray start`` cluster (``n0``: the head, ``n1``: a worker node), one
service and one cluster for the module, in this order:

- the service killed (``kill -9``) in the middle of a measured search and started again on
  the same database: the cluster outlived it, the service reattaches, the job completes and
  its stored events are seq 0..n, each once, as the job sent them;
- a job whose driver dies without a result (its entrypoint killed by pid) ends ``failed``
  with Ray's message and the tail of its log;
- a job cancelled in the middle of a measured search leaves no Ray job running and no actor;
- a ``run`` job whose stage node is lost (node ``n1``'s processes stopped by pid) ends
  ``failed`` within 30 s naming the stage, device and node, and leaves no actor;
- a clean shutdown (SIGTERM) stops the cluster and leaves no Ray process of ours.

Actors are listed through :mod:`executor.runtime` (this process joins the cluster for that
and leaves it before the shutdown)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray  # noqa: F401  (importing Ray puts its bundled psutil on the path)

# isort: split
import psutil

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import runtime
from pipeplan.executor.live_cluster import live_nodes
from pipeplan.executor.local.persistent_cluster import (
    PersistentCluster,
    is_running,
    read_state,
    stop_persistent,
)
from pipeplan.executor.model import ModelSource
from pipeplan.executor.pipeline import Pipeline
from pipeplan.executor.ray_jobs import RayJobs
from pipeplan.service.tasks.common import cluster_spec, zoo_profile
from pipeplan.service.tasks.progress import QUIET
from tests.core.test_formats import PROFILE
from tests.service.api.test_ray_jobs import (
    TOKEN,
    Service,
    _stop,
    _wait_healthy,
    free_port,
    wait_done,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

HETERO = cluster_spec("local-hetero")
DUO = ClusterSpec(
    "duo",
    {t: HETERO.device_types[t] for t in ("fast", "slow")},
    (Node("n0", {"fast": 1}), Node("n1", {"slow": 1})),
    HETERO.network,
    HETERO.emulation_headroom,
)
MEASURED: dict[str, Any] = {
    "model": "digits_cnn",
    "cluster": DUO.to_dict(),
    "planner": "tapp",
    "batch": 16,
    "reward": "measured",
    "repeats": 1,
    "warmup": 0,
    "seed": 0,
}
"""A measured TAPP search of the tiny digits CNN on the module's cluster (each plan a real
run on the stage actors: about a second or two each here)."""
RUN_PLAN = Plan(16, (Stage((0, 3), ("n0/fast:0",), 8), Stage((3, 8), ("n1/slow:0",), 4)))
"""Stage 0 on the head node, stage 1 on the worker node ``n1``."""
TERMINAL = ("succeeded", "failed", "cancelled")


def start_serve(tmp: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``pipeplan serve`` on ``port`` with its database, cluster (:data:`DUO`) and state
    under ``tmp``; the periodic reconcile every second."""
    env = {
        **os.environ,
        "PIPEPLAN_API_TOKEN": TOKEN,
        "PIPEPLAN_RECONCILE_EVERY_S": "1",
        "PIPEPLAN_POOL_SIZE": "0",  # every job a Ray Job: this module kills their drivers
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "XDG_DATA_HOME": str(tmp / "data"),
    }
    args = ["--port", str(port), "--db", f"sqlite:///{tmp / 'jobs.db'}"]
    args += ["--cluster", str(tmp / "duo.yaml"), "--state-dir", str(tmp / "state")]
    exe = str(Path(sys.executable).with_name("pipeplan"))
    with open(log, "ab") as out:
        return subprocess.Popen([exe, "serve", *args], env=env, stdout=out, stderr=out)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("reliability")
    DUO.save(tmp / "duo.yaml")
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
        runtime.shutdown()
        code = _stop(svc.process if svc is not None else proc)
        client.close()
        if (tmp / "state" / "cluster.json").exists():  # a test failed half-way
            stop_persistent(tmp / "state")
    assert code == 0, log.read_text()[-3000:]


@contextlib.contextmanager
def joined(cluster: PersistentCluster) -> Iterator[None]:
    """This process connected to the service's cluster for the ``with`` body."""
    runtime.connect(cluster.address)
    try:
        yield
    finally:
        runtime.shutdown()


def live_actors() -> list[str]:
    """The class names of the connected cluster's actors that are not dead."""
    return sorted(str(a["ActorClassName"]) for a in runtime.actors() if a["State"] != "DEAD")


def wait_no_actors(timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (alive := live_actors()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def submit(service: Service, kind: str, spec: dict[str, Any]) -> str:
    r = service.client.post("/v1/jobs", json={"kind": kind, "spec": spec})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def events(service: Service, job_id: str) -> list[dict[str, Any]]:
    r = service.client.get(f"/v1/jobs/{job_id}/events")
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()
    return found


def wait_events(service: Service, job_id: str, kind: str, timeout_s: float = 90) -> int:
    """Until the job has posted an event of ``kind``; its state must still be open. The
    highest seq stored then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = events(service, job_id)
        if any(e["type"] == kind for e in found):
            job = service.client.get(f"/v1/jobs/{job_id}").json()
            assert job["state"] not in TERMINAL, job
            return max(e["seq"] for e in found)
        time.sleep(0.3)
    logs = service.client.get(f"/v1/jobs/{job_id}/logs").text
    raise AssertionError(f"no {kind} event of job {job_id} in {timeout_s} s; log:\n{logs}")


def entrypoints(job_id: str) -> list[psutil.Process]:
    """The processes of the job's Ray Job entrypoint (``pipeplan job run --job ID``)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "job" in cmd and "run" in cmd and job_id in cmd:
            found.append(p)
    return found


def node_processes(cluster: PersistentCluster, node: str) -> list[psutil.Process]:
    """The ``ray start`` process of ``node`` (recorded by the cluster) and its children."""
    for record in cluster.processes:
        try:
            p = psutil.Process(record.pid)
            if abs(p.create_time() - record.create_time) > 0.01:
                continue
            if f'"pipeplan_node:{node}": 1.0' in " ".join(p.cmdline()) and "--head" not in (
                p.cmdline()
            ):
                return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no running process of node {node!r} in the cluster's record")


def stop_node(cluster: PersistentCluster, node: str) -> None:
    """Lose ``node``: SIGTERM its ``ray start`` (which stops its raylet and workers), then
    SIGKILL whatever is left of it."""
    procs = node_processes(cluster, node)
    with contextlib.suppress(psutil.NoSuchProcess):
        procs[0].send_signal(signal.SIGTERM)
    _, left = psutil.wait_procs(procs, timeout=10)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=5)


def ray_processes(cluster: PersistentCluster) -> list[str]:
    """Processes that name the cluster's GCS address (its nodes' and workers' processes)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cluster.address in cmd:
            found.append(f"{p.pid}: {cmd[:200]}")
    return found


def test_a_crash_in_the_middle_of_a_measured_search_loses_no_event(service: Service) -> None:
    job_id = submit(service, "plan", {**MEASURED, "budget": {"evaluations": 6}})
    before = wait_events(service, job_id, "evaluation", timeout_s=120)
    service.process.kill()  # kill -9: the job goes on, its events wait for the service
    service.process.wait()
    assert is_running(service.cluster)
    time.sleep(1.0)
    service.process = start_serve(service.tmp, service.port, service.log)
    _wait_healthy(service.client, service.process, service.log)
    assert "reattached to the embedded Ray cluster" in service.log.read_text()
    assert read_state(service.tmp / "state") == service.cluster

    job = wait_done(service.client, job_id, timeout_s=120)
    assert job["state"] == "succeeded", (job, service.client.get(f"/v1/jobs/{job_id}/logs").text)
    stored = events(service, job_id)
    assert [e["seq"] for e in stored] == list(range(len(stored)))  # no gap, no duplicate
    assert stored[-1]["seq"] > before  # the job sent events across the restart
    assert stored[-1]["type"] == "result" and stored[-1]["data"] == job["result"]
    result = job["result"]
    evaluated = [e for e in stored if e["type"] == "evaluation"]
    assert len(evaluated) == result["evaluations"]
    assert all(e["data"]["source"] == "measured" for e in evaluated)
    ran = [e["data"] for e in evaluated if e["data"]["batch_time_s"] is not None]
    assert ran and all(d["predicted_batch_time_s"] > 0 for d in ran)  # prediction beside it
    measured = [e["data"] for e in stored if e["type"] == "measurement"]
    assert measured == result["measured"]["evaluated"]


def test_a_job_whose_driver_dies_without_a_result_ends_failed(service: Service) -> None:
    spec = {"profile": PROFILE, "cluster": DUO.to_dict(), "planner": "tapp", "batch": 8}
    spec |= {"options": {"patience": None}, "budget": {"evaluations": 10**7, "seconds": 120}}
    job_id = submit(service, "plan", spec)
    wait_events(service, job_id, "evaluation", timeout_s=120)  # the search is under way
    procs = entrypoints(job_id)
    assert procs, f"no entrypoint process of job {job_id}"
    for p in procs:
        p.kill()
    job = wait_done(service.client, job_id, timeout_s=30)
    assert job["state"] == "failed", job
    error = job["error"]
    message = RayJobs(service.cluster.dashboard_url).info(job_id).message
    assert "without a result" in error and message and message.strip() in error
    assert "--- log tail ---" in error and "search tapp" in error


def test_a_job_cancelled_mid_search_leaves_no_ray_job_and_no_actor(service: Service) -> None:
    job_id = submit(service, "plan", {**MEASURED, "budget": {"evaluations": 12}})
    wait_events(service, job_id, "evaluation", timeout_s=120)
    with joined(service.cluster):
        deadline = time.monotonic() + 60
        while "StageWorker" not in live_actors() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "StageWorker" in live_actors()  # a plan is being measured
        r = service.client.post(f"/v1/jobs/{job_id}/cancel")
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        ray_jobs = RayJobs(service.cluster.dashboard_url)
        deadline = time.monotonic() + 30
        while not ray_jobs.info(job_id).terminal and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray_jobs.info(job_id).status == "STOPPED"
        assert wait_no_actors() == []
    assert service.client.get(f"/v1/jobs/{job_id}").json()["state"] == "cancelled"


def test_a_stage_node_lost_during_a_run_job_fails_it_naming_stage_device_node(
    service: Service,
) -> None:
    profile = zoo_profile("digits_cnn", None, QUIET).to_dict()
    spec = {"plan": RUN_PLAN.to_dict(), "profile": profile, "cluster": DUO.to_dict()}
    job_id = submit(service, "run", {**spec, "steps": 100_000, "timeout_s": 60})
    with joined(service.cluster):
        deadline = time.monotonic() + 120
        while live_actors().count("StageWorker") < 2 and time.monotonic() < deadline:
            job = service.client.get(f"/v1/jobs/{job_id}").json()
            assert job["state"] not in TERMINAL, (job, live_nodes())
            time.sleep(0.5)
        assert live_actors().count("StageWorker") == 2
        time.sleep(2.0)  # steps under way
        # the entrypoint's first event marks the job running before any work
        assert service.client.get(f"/v1/jobs/{job_id}").json()["state"] == "running"
        lost = time.monotonic()
        stop_node(service.cluster, "n1")
        job = wait_done(service.client, job_id, timeout_s=30)
        took = time.monotonic() - lost
        assert job["state"] == "failed", job
        assert took <= 30, took
        error = job["error"]
        assert "stage 1" in error and "n1/slow:0" in error and "node n1" in error, error
        assert wait_no_actors() == []


def test_zz_a_clean_shutdown_stops_the_cluster_and_leaves_no_ray_process(
    service: Service,
) -> None:
    runtime.shutdown()
    assert is_running(service.cluster)
    assert _stop(service.process) == 0, service.log.read_text()[-3000:]
    assert not is_running(service.cluster)
    assert "stopping the embedded Ray cluster" in service.log.read_text()
    deadline = time.monotonic() + 10
    while (ours := ray_processes(service.cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ours == []


def test_a_plan_with_fewer_samples_than_replicas_is_refused_before_any_actor() -> None:
    shared = Plan(16, (Stage((0, 8), ("n0/fast:0", "n1/slow:0"), 1),))
    with pytest.raises(PlanError, match=r"stages\[0\].microbatch: 1 samples cannot be shared"):
        Pipeline(shared, ModelSource("digits_cnn", 8), DUO)
