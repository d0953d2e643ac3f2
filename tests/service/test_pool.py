"""The planner pool and the routing backend without Ray: workers are threads of this process
(:class:`FakeWorkers`) whose calls do what each test scripts (answer, block, crash), so the
queue, the bound on jobs at once, retries, cancel, limits and routing are checked exactly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeplan.executor.worker_pool import Outcome, WorkerLost, WorkerTimeout, resolve
from pipeplan.service.api.app import create_app
from pipeplan.service.api.backend import (
    BackendState,
    BackendStatus,
    ClusterState,
    NodeState,
    Submission,
)
from pipeplan.service.api.calibration_fit import FitWorker
from pipeplan.service.api.pool import (
    JOB_TARGET,
    LOST_MESSAGE,
    POOL_JOB_ID,
    PlannerPool,
    PoolTimeout,
    runs_in_pool,
)
from pipeplan.service.api.schemas import JobKind, JobState
from pipeplan.service.api.store import Store
from pipeplan.service.cli.job import run_in_process
from pipeplan.service.cli.serve import default_pool_size
from tests.core.test_formats import PROFILE
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

Script = Callable[["FakeWorker", str, tuple[Any, ...], float | None], Outcome]
PLAN: dict[str, Any] = {"profile": PROFILE, "cluster": "local-hetero", "planner": "dp", "batch": 8}


class FakeWorker:
    """A worker whose calls run ``script`` in the calling thread; ``kill`` wakes a call
    that waits in :meth:`block`, which then raises :class:`WorkerLost` as Ray would."""

    def __init__(self, name: str, script: Script) -> None:
        self.name, self.script = name, script
        self.killed = threading.Event()

    def call(self, target: str, args: tuple[Any, ...], timeout_s: float | None = None) -> Outcome:
        if self.killed.is_set():
            raise WorkerLost(f"worker {self.name} died: killed")
        return self.script(self, target, args, timeout_s)

    def block(self, gate: threading.Event, timeout_s: float | None) -> None:
        """Wait for ``gate``; killed meanwhile -> WorkerLost; past ``timeout_s`` ->
        WorkerTimeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not gate.is_set():
            if self.killed.wait(0.01):
                raise WorkerLost(f"worker {self.name} died: killed")
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerTimeout(f"worker {self.name}: ran past {timeout_s} s")

    def kill(self) -> None:
        self.killed.set()


@dataclass
class FakeWorkers:
    script: Script
    started: list[FakeWorker] = field(default_factory=list)
    fail_start: str | None = None
    closed: bool = False

    def start(self) -> FakeWorker:
        if self.fail_start is not None:
            raise RuntimeError(self.fail_start)
        worker = FakeWorker(f"w{len(self.started)}", self.script)
        self.started.append(worker)
        return worker

    def close(self) -> None:
        self.closed = True
        for w in self.started:
            w.kill()


def succeed(worker: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
    return Outcome(value=0, log=f"{worker.name} ran {args[0]}\n")


def submission(job_id: str) -> Submission:
    return Submission(job_id, "http://127.0.0.1:1", f"token-{job_id}")


def wait_state(pool: PlannerPool, job_id: str, state: BackendState, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = pool.status(job_id)
        if found is not None and found.state is state:
            return
        time.sleep(0.005)
    raise AssertionError(f"{job_id}: {pool.status(job_id)}, not {state.value}")


@pytest.fixture
def make_pool() -> Iterator[Callable[..., tuple[PlannerPool, FakeWorkers]]]:
    pools: list[PlannerPool] = []

    def make(script: Script = succeed, size: int = 1, retries: int = 1) -> Any:
        workers = FakeWorkers(script)
        pool = PlannerPool(workers, size, retries)
        pool.start()
        assert pool.wait_warm(5)
        pools.append(pool)
        return pool, workers

    yield make
    for p in pools:
        p.close()


def test_a_job_runs_on_a_warm_worker_and_its_log_is_kept(make_pool: Any) -> None:
    pool, workers = make_pool()
    pool.submit(submission("a"))
    wait_state(pool, "a", BackendState.SUCCEEDED)
    assert pool.logs("a") == "w0 ran a\n"
    pool.submit(submission("b"))
    wait_state(pool, "b", BackendState.SUCCEEDED)
    assert [w.name for w in workers.started] == ["w0"]  # started once, used twice
    assert pool.status("unknown") is None and pool.logs("unknown") is None


def test_the_job_target_is_the_ray_jobs_entrypoint_function() -> None:
    assert resolve(JOB_TARGET) is run_in_process


def test_no_more_jobs_run_at_once_than_the_pool_has_workers(make_pool: Any) -> None:
    gate = threading.Event()
    running: list[str] = []
    most = [0]
    lock = threading.Lock()

    def hold(worker: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        with lock:
            running.append(args[0])
            most[0] = max(most[0], len(running))
        worker.block(gate, t)
        with lock:
            running.remove(args[0])
        return Outcome(value=0)

    pool, _ = make_pool(hold, size=2)
    for n in range(5):
        pool.submit(submission(f"j{n}"))
    wait_state(pool, "j1", BackendState.RUNNING)
    time.sleep(0.05)
    states = [pool.status(f"j{n}").state for n in range(5)]  # type: ignore[union-attr]
    assert states == [BackendState.RUNNING] * 2 + [BackendState.PENDING] * 3
    gate.set()
    for n in range(5):
        wait_state(pool, f"j{n}", BackendState.SUCCEEDED)
    assert most[0] == 2


def test_a_submitted_id_is_not_run_twice(make_pool: Any) -> None:
    calls: list[str] = []

    def count(worker: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        calls.append(args[0])
        return Outcome(value=0)

    pool, _ = make_pool(count)
    pool.submit(submission("a"))
    wait_state(pool, "a", BackendState.SUCCEEDED)
    pool.submit(submission("a"))
    time.sleep(0.05)
    assert calls == ["a"]


def test_a_crashed_worker_is_replaced_and_its_job_retried_once(make_pool: Any) -> None:
    def crash_first(w: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        if w.name == "w0":
            raise WorkerLost("worker w0 (pid 1) died: exit code 137")
        return Outcome(value=0, log="second try\n")

    pool, workers = make_pool(crash_first)
    pool.submit(submission("a"))
    wait_state(pool, "a", BackendState.SUCCEEDED)
    assert [w.name for w in workers.started] == ["w0", "w1"]
    log = pool.logs("a")
    assert log is not None and "w0 (pid 1) died" in log and "runs again" in log
    assert log.endswith("second try\n")


def test_a_job_whose_worker_crashes_twice_fails_naming_the_cause(make_pool: Any) -> None:
    def crash(w: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        raise WorkerLost(f"worker {w.name} died: out of memory")

    pool, workers = make_pool(crash)
    pool.submit(submission("a"))
    wait_state(pool, "a", BackendState.FAILED)
    status = pool.status("a")
    assert status is not None
    assert "w1 died: out of memory" in status.message and "2 attempts" in status.message
    assert len(workers.started) == 3  # the slot is warm again for the next job


def test_a_failing_job_fails_with_its_entrypoints_answer(make_pool: Any) -> None:
    def fail(w: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        if args[0] == "exit":
            return Outcome(value=1, log="error: planner: unknown\n")
        return Outcome(error="RuntimeError: boom", traceback="Traceback ...\n", log="x\n")

    pool, workers = make_pool(fail)
    pool.submit(submission("exit"))
    pool.submit(submission("raise"))
    wait_state(pool, "exit", BackendState.FAILED)
    wait_state(pool, "raise", BackendState.FAILED)
    assert pool.status("exit").message == "the job exited with 1"  # type: ignore[union-attr]
    raised = pool.status("raise")
    assert raised is not None and "RuntimeError: boom" in raised.message
    assert "Traceback" in (pool.logs("raise") or "")
    assert len(workers.started) == 1  # a failed job does not cost its worker


def test_cancel_takes_a_waiting_job_out_and_kills_a_running_ones_worker(make_pool: Any) -> None:
    gate = threading.Event()
    ran: list[str] = []

    def hold(w: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        ran.append(args[0])
        w.block(gate, t)
        return Outcome(value=0)

    pool, workers = make_pool(hold)
    pool.submit(submission("running"))
    pool.submit(submission("waiting"))
    wait_state(pool, "running", BackendState.RUNNING)
    pool.stop("waiting")
    wait_state(pool, "waiting", BackendState.STOPPED)
    pool.stop("running")
    wait_state(pool, "running", BackendState.STOPPED)
    assert workers.started[0].killed.is_set()
    gate.set()
    pool.submit(submission("next"))
    wait_state(pool, "next", BackendState.SUCCEEDED)
    assert ran == ["running", "next"] and len(workers.started) == 2
    pool.stop("next")  # ended: nothing happens
    assert pool.status("next").state is BackendState.SUCCEEDED  # type: ignore[union-attr]


def test_a_call_answers_within_its_limit_and_is_cut_off_past_it(make_pool: Any) -> None:
    never = threading.Event()

    def answer(w: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        if args[0] == "slow":
            w.block(never, t)
        return Outcome(value={"plan": args[0]})

    pool, workers = make_pool(answer)
    assert pool.call("m:f", ("fast",), 5).result(5).value == {"plan": "fast"}
    t0 = time.monotonic()
    with pytest.raises(PoolTimeout):
        pool.call("m:f", ("slow",), 0.2).result(5)
    assert time.monotonic() - t0 < 2
    assert pool.wait_warm(5) and len(workers.started) == 2  # the busy worker was replaced
    assert pool.call("m:f", ("again",), 5).result(5).value == {"plan": "again"}


def test_a_call_waiting_past_its_limit_never_runs(make_pool: Any) -> None:
    gate = threading.Event()
    ran: list[str] = []

    def hold(w: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        ran.append(args[0])
        w.block(gate, None if args[0] == "job" else t)
        return Outcome(value=0)

    pool, _ = make_pool(hold)
    pool.submit(submission("job"))
    wait_state(pool, "job", BackendState.RUNNING)
    future = pool.call("m:f", ("call",), 0.1)
    time.sleep(0.2)
    gate.set()
    with pytest.raises(PoolTimeout):
        future.result(5)
    assert ran == ["job"]


def test_a_worker_that_cannot_start_is_named_by_ready() -> None:
    workers = FakeWorkers(succeed, fail_start="cannot reach 127.0.0.1:1: refused")
    pool = PlannerPool(workers, 1)
    pool.start()
    try:
        deadline = time.monotonic() + 5
        while pool.ready() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (
            pool.ready() == "planner pool: no worker could start: cannot reach 127.0.0.1:1: refused"
        )
    finally:
        pool.close()
    assert workers.closed


def test_closing_fails_what_waits_and_refuses_more(make_pool: Any) -> None:
    gate = threading.Event()

    def hold(w: FakeWorker, target: str, args: tuple[Any, ...], t: float | None) -> Outcome:
        w.block(gate, t)
        return Outcome(value=0)

    pool, workers = make_pool(hold)
    pool.submit(submission("running"))
    pool.submit(submission("waiting"))
    wait_state(pool, "running", BackendState.RUNNING)
    pool.close()
    assert pool.status("waiting").state is BackendState.FAILED  # type: ignore[union-attr]
    assert pool.status("running").state is BackendState.FAILED  # type: ignore[union-attr]
    assert workers.closed and pool.ready() == "planner pool: closed"
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(submission("late"))


def test_the_pool_size_is_checked() -> None:
    with pytest.raises(ValueError, match="size: a pool needs >= 1 worker, got 0"):
        PlannerPool(FakeWorkers(succeed), 0)


def test_the_default_pool_size_is_the_clusters_cpus_minus_one() -> None:
    def cluster(*cpus: float, dead: float = 0.0) -> ClusterState:
        nodes = [NodeState(f"n{i}", str(i), True, cpus=c) for i, c in enumerate(cpus)]
        return ClusterState((*nodes, NodeState("gone", "x", False, cpus=dead)))

    assert default_pool_size(cluster(1, 1, 1)) == 2  # the embedded presets' three nodes
    assert default_pool_size(cluster(16, 16, dead=16)) == 31  # a dead node's CPUs not counted
    assert default_pool_size(cluster(1)) == 1  # never below one worker
    assert default_pool_size(ClusterState(error="dashboard down")) == 1
    assert default_pool_size(cluster(*[32.0] * 8)) == 64  # the setting's bound


# --- routing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "spec", "pooled"),
    [
        (JobKind.PLAN, PLAN, True),
        (JobKind.PLAN, PLAN | {"planner": "genetic", "budget": {"evaluations": 50}}, True),
        (JobKind.PLAN, PLAN | {"planner": "genetic", "reward": "parallel", "workers": 2}, False),
        (JobKind.PLAN, PLAN | {"planner": "tapp", "reward": "measured"}, False),
        (JobKind.PLAN, PLAN | {"planner": "ppo"}, False),
        (JobKind.COMPARE, {k: v for k, v in PLAN.items() if k != "planner"}, True),
        (JobKind.PROFILE, {"model": "alexnet"}, True),
        (JobKind.PROFILE, {"model": "alexnet", "measure": True}, False),
        (JobKind.PROFILE, {"model": "my.models:build"}, False),
        (JobKind.RUN, {"plan": {}, "model": "alexnet"}, False),
        (JobKind.PLAN, {"planner": "dp"}, False),  # not a plan spec: the Ray Job says why
    ],
)
def test_only_jobs_that_need_no_device_run_in_the_pool(
    kind: JobKind, spec: dict[str, Any], pooled: bool
) -> None:
    assert runs_in_pool(kind, spec) is pooled


@pytest.fixture(scope="module")
def fit_worker() -> Iterator[FitWorker]:
    worker = FitWorker()
    yield worker
    worker.close()


@pytest.fixture
def routed(tmp_path: Path, fit_worker: FitWorker) -> Iterator[tuple[TestClient, Any, Any, Store]]:
    """An app whose Ray Jobs backend is a fake, with a pool of fake workers that answer at once."""
    settings = make_settings(tmp_path)
    store = Store(settings.database_url)
    ray_jobs = FakeBackend()
    workers = FakeWorkers(succeed)
    pool = PlannerPool(workers, 1)
    app = create_app(settings, store=store, backend=ray_jobs, fit_worker=fit_worker, pool=pool)
    with TestClient(app, headers=AUTH) as client:
        yield client, ray_jobs, pool, store
    store.close()


def test_cost_model_jobs_go_to_the_pool_and_device_jobs_to_ray_jobs(routed: Any) -> None:
    client, ray_jobs, pool, _ = routed
    planned = client.post("/v1/jobs", json={"kind": "plan", "spec": PLAN})
    assert planned.status_code == 201, planned.text
    job = planned.json()
    assert job["ray_job_id"] == POOL_JOB_ID and pool.knows(job["id"])
    wait_state(pool, job["id"], BackendState.SUCCEEDED)
    assert client.get(f"/v1/jobs/{job['id']}/logs").text == f"w0 ran {job['id']}\n"
    measured = PLAN | {"planner": "genetic", "reward": "parallel", "workers": 2}
    other = client.post("/v1/jobs", json={"kind": "plan", "spec": measured}).json()
    assert other["ray_job_id"] == other["id"] and not pool.knows(other["id"])
    assert [s.job_id for s in ray_jobs.submitted] == [other["id"]]


def test_cancel_of_a_pool_job_stops_it_in_the_pool(routed: Any, tmp_path: Path) -> None:
    client, ray_jobs, pool, store = routed
    job_id = "pp-waiting"
    store.create_job(JobKind.PLAN, PLAN, None, "hash", job_id)
    store.set_ray_job_id(job_id, POOL_JOB_ID)
    pool.submit(submission(job_id))
    r = client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert pool.status(job_id).state in (BackendState.STOPPED, BackendState.SUCCEEDED)
    assert ray_jobs.stopped == []


def test_without_a_pool_every_job_is_a_ray_job(tmp_path: Path, fit_worker: FitWorker) -> None:
    settings = make_settings(tmp_path, pool_size=0)
    ray_jobs = FakeBackend()
    app = create_app(settings, backend=ray_jobs, fit_worker=fit_worker)
    with TestClient(app, headers=AUTH) as client:
        job = client.post("/v1/jobs", json={"kind": "plan", "spec": PLAN}).json()
        assert job["ray_job_id"] == job["id"]
        assert [s.job_id for s in ray_jobs.submitted] == [job["id"]]
        r = client.post("/v1/plan", json=PLAN)
        assert r.status_code == 503 and "PIPEPLAN_POOL_SIZE" in r.json()["detail"]


def test_a_pool_job_of_an_earlier_service_fails_at_start_as_lost(
    tmp_path: Path, fit_worker: FitWorker
) -> None:
    settings = make_settings(tmp_path)
    store = Store(settings.database_url)
    store.create_tables()
    store.create_job(JobKind.PLAN, PLAN, None, "hash", "pp-lost")
    store.set_ray_job_id("pp-lost", POOL_JOB_ID)
    store.create_job(JobKind.RUN, {"plan": {}}, None, "hash", "pp-ray")
    store.set_ray_job_id("pp-ray", "pp-ray")
    ray_jobs = FakeBackend()
    ray_jobs.statuses["pp-ray"] = BackendStatus(BackendState.RUNNING)
    pool = PlannerPool(FakeWorkers(succeed), 1)
    app = create_app(settings, store=store, backend=ray_jobs, fit_worker=fit_worker, pool=pool)
    with TestClient(app, headers=AUTH) as client:
        lost = client.get("/v1/jobs/pp-lost").json()
        assert lost["state"] == JobState.FAILED.value
        assert LOST_MESSAGE in lost["error"]
        assert client.get("/v1/jobs/pp-ray").json()["state"] == JobState.QUEUED.value
    store.close()
