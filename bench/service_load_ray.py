"""Part 3 of ``bench.service_load``: submit to running on the real Ray Jobs backend.

``pipeplan serve`` with its embedded one-node cluster (a cluster file of one ``fast``
device; ``ray start`` with token auth on free loopback ports, recorded in a state folder of
its own), a database and config folders in a temporary folder. Small ``plan`` jobs are
submitted one after the other; for each, the time from ``POST /v1/jobs`` until the job is
seen ``running`` (its entrypoint, a Ray Job driver, has fetched its spec and posted its
first event), the same from the service's own timestamps (``started_at - created_at``), and
until it ends. The service is then stopped with SIGTERM, which stops its cluster; what may
still run of it is stopped from its state record (by pid), never with ``ray stop``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.service_load_http import SPEC
from bench.service_load_server import TOKEN_ENV, ServerProcess, free_port
from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.executor.local.persistent_cluster import (
    STATE_FILE,
    is_running,
    read_state,
    stop_persistent,
)
from pipeplan.service.tasks.common import cluster_spec

TERMINAL = ("succeeded", "failed", "cancelled")
POLL_S = 0.02
START_TIMEOUT_S = 240.0
JOB_TIMEOUT_S = 180.0


def serve_process(tmp: Path, token: str) -> ServerProcess:
    """``pipeplan serve`` (not started) on a free port, everything of it under ``tmp``."""
    hetero = cluster_spec("local-hetero")
    ClusterSpec("solo", hetero.device_types, (Node("n0", {"fast": 1}),)).save(tmp / "solo.yaml")
    port = free_port()
    env = {
        **os.environ,
        TOKEN_ENV: token,
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "XDG_DATA_HOME": str(tmp / "data"),
    }
    args = ["serve", "--port", str(port), "--db", f"sqlite:///{tmp / 'jobs.db'}"]
    args += ["--cluster", str(tmp / "solo.yaml"), "--state-dir", str(tmp / "state")]
    exe = str(Path(sys.executable).with_name("pipeplan"))
    return ServerProcess([exe, *args], env, tmp / "serve.log", port, token)


def _seconds(later: str | None, earlier: str | None) -> float | None:
    if later is None or earlier is None:
        return None
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


def time_one_job(client: httpx.Client, name: str) -> dict[str, Any]:
    """Submit the small plan job; when it was seen running and done (seconds after the
    POST was sent), and the service's own times."""
    t0 = time.perf_counter()
    r = client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC, "name": name})
    if r.status_code != 201:
        raise RuntimeError(f"submit: {r.status_code} {r.text[:300]}")
    job, job_id = r.json(), r.json()["id"]
    submit_s, running_s = time.perf_counter() - t0, None
    while time.perf_counter() - t0 < JOB_TIMEOUT_S and job["state"] not in TERMINAL:
        time.sleep(POLL_S)
        job = client.get(f"/v1/jobs/{job_id}").json()
        if running_s is None and job["state"] != "queued":
            running_s = time.perf_counter() - t0
    if job["error"]:  # on the console only: it may name paths of this machine
        print(f"job {job_id} {job['state']}: {job['error'][-1500:]}", file=sys.stderr)
    return {
        "submit_s": submit_s,
        "to_running_s": running_s,
        "to_running_server_s": _seconds(job["started_at"], job["created_at"]),
        "to_done_s": time.perf_counter() - t0,
        "state": job["state"],
        "error": job["error"] is not None,
    }


def stop_everything(server: ServerProcess, state_dir: Path) -> dict[str, Any]:
    """SIGTERM the service (it stops its cluster); stop what still runs of the cluster."""
    code = server.stop(timeout_s=90)
    leftover = False
    if (state_dir / STATE_FILE).exists():
        leftover = is_running(read_state(state_dir))
        stop_persistent(state_dir)
    return {"serve_exit_code": code, "cluster_left_running": leftover}


def submit_to_running(tmp: Path, token: str, jobs: int) -> dict[str, Any]:
    """Part 3 (module docstring): the service, ``jobs`` jobs one after the other, the stop."""
    server = serve_process(tmp, token)
    out: dict[str, Any] = {}
    try:
        server.start()
        out["service_start_s"] = server.wait_healthy(START_TIMEOUT_S)
        with server.client() as c:
            out["jobs"] = [time_one_job(c, f"ray-{i}") for i in range(jobs)]
    except Exception as e:  # named in the results, with the service's log tail on stdout
        out["error"] = type(e).__name__  # the message names paths: on the console only
        print(f"ray part: {e}\n{server.tail()}", file=sys.stderr)
    finally:
        out |= stop_everything(server, tmp / "state")
    return out | summarise(out.get("jobs", []))


def summarise(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float | None]:
        xs = [j[key] for j in jobs if j[key] is not None]
        if not xs:
            return {"median": None, "max": None}
        return {"median": float(np.median(xs)), "max": float(np.max(xs))}

    return {
        "to_running_s": stats("to_running_s"),
        "to_running_server_s": stats("to_running_server_s"),
        "to_done_s": stats("to_done_s"),
        "succeeded": sum(j["state"] == "succeeded" for j in jobs),
    }
