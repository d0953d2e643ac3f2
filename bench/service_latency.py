"""Submit -> result latency of small cost-model plan jobs: Ray Jobs only, then the planner pool.

Two phases, one after the other, each against ``pipeplan serve`` with its embedded one-node
cluster (a cluster file of one ``fast`` device; ``ray start`` with token auth on free loopback
ports; database, config and cluster record in a temporary folder):

- ``ray-jobs``: ``PIPEPLAN_POOL_SIZE=0``, so every job is a Ray Job (a new driver process
  that imports torch and Ray): the service as it was before the pool;
- ``pool``: ``PIPEPLAN_POOL_SIZE=--pool-size``: the jobs run on warm planner workers.

In each phase, for each preset of ``--presets`` (the plan's cluster) and each burst size
(1 and 8 jobs posted at once, from one thread each), ``--rounds`` / ``--burst-rounds``
rounds of ``dp`` plan jobs for AlexNet (by name: the job profiles it, as a user's would).
A job's latency is from its ``POST /v1/jobs`` until it is seen ended (polled every
:data:`POLL_S`); the service's own ``finished_at - created_at`` is kept beside it. One
warm-up job per phase comes first and is not counted (in the pool phase it waits for the
workers to start). Prints p50 and p99 per phase, preset and burst, and the speed-up;
writes ``bench/results/service_latency/<UTC date-time>.json`` (``--quick``: fewer rounds,
under ``service_latency_quick/``; :mod:`bench.record`). Every service is stopped with
SIGTERM (it stops its cluster); what might still run of a cluster is stopped by its pids.

    .venv/bin/python -m bench.service_latency           # the full run (~10 min, 2 cores)
    .venv/bin/python -m bench.service_latency --quick   # fewer rounds (~6 min)
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from bench.common import OUT_HELP, table
from bench.record import BenchRun, display
from bench.service_load_ray import serve_process, stop_everything
from bench.service_load_server import ServerProcess

PHASES = ("ray-jobs", "pool")
PRESETS = ("local-pipeline", "local-hetero")
BURSTS = (1, 8)
MODEL = "alexnet"
BATCH = 64
POLL_S = 0.05
START_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 600.0
TARGET_P50_S = 1.0
"""The target for one job at a time in the pool, on a quiet machine."""
TERMINAL = ("succeeded", "failed", "cancelled")
console = Console(width=shutil.get_terminal_size((120, 40)).columns)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), help="the plans' clusters")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of one job [6]")
    ap.add_argument("--burst-rounds", type=int, default=2, help="rounds of 8 at once [2]")
    ap.add_argument("--pool-size", type=int, default=2, help="pool workers [2, the default]")
    ap.add_argument("--quick", action="store_true", help="3 rounds of one, 1 of eight")
    ap.add_argument("--out", default=None, help=OUT_HELP)
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.burst_rounds = 3, 1
    for name in ("rounds", "burst_rounds", "pool_size"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(a, name)}")
    return a


def spec(preset: str) -> dict[str, Any]:
    return {"model": MODEL, "cluster": preset, "planner": "dp", "batch": BATCH}


def _server_s(job: dict[str, Any]) -> float | None:
    if job.get("finished_at") is None:
        return None
    done, created = job["finished_at"], job["created_at"]
    return (datetime.fromisoformat(done) - datetime.fromisoformat(created)).total_seconds()


def time_job(server: ServerProcess, preset: str, start: threading.Barrier) -> dict[str, Any]:
    """One job: posted when every job of its burst is ready, polled until it ends."""
    with server.client(timeout_s=60) as c:
        start.wait()
        t0 = time.perf_counter()
        r = c.post("/v1/jobs", json={"kind": "plan", "spec": spec(preset)})
        if r.status_code != 201:
            raise RuntimeError(f"submit: {r.status_code} {r.text[:300]}")
        job = r.json()
        while job["state"] not in TERMINAL and time.perf_counter() - t0 < JOB_TIMEOUT_S:
            time.sleep(POLL_S)
            job = c.get(f"/v1/jobs/{job['id']}").json()
        took = time.perf_counter() - t0
    if job["error"]:  # on the console only: it may name paths of this machine
        print(f"job {job['id']} {job['state']}: {job['error'][-800:]}", file=sys.stderr)
    return {"s": took, "server_s": _server_s(job), "state": job["state"]}


def burst(server: ServerProcess, preset: str, size: int) -> list[dict[str, Any]]:
    start = threading.Barrier(size)
    with ThreadPoolExecutor(size) as ex:
        futures = [ex.submit(time_job, server, preset, start) for _ in range(size)]
        return [f.result() for f in futures]


def stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    a = np.asarray(xs)
    return {
        "p50_s": float(np.percentile(a, 50)),
        "p99_s": float(np.percentile(a, 99)),
        "max_s": float(a.max()),
    }


def cell(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    server = [j["server_s"] for j in jobs if j["server_s"] is not None]
    return {
        "jobs": len(jobs),
        "succeeded": sum(j["state"] == "succeeded" for j in jobs),
        **stats([j["s"] for j in jobs]),
        "server": stats(server),
        "samples_s": [round(j["s"], 4) for j in jobs],
    }


def phase(name: str, a: argparse.Namespace, tmp: Path, token: str) -> dict[str, Any]:
    """One service (module docstring), every preset and burst size, then its stop."""
    server = serve_process(tmp, token)
    server.env["PIPEPLAN_POOL_SIZE"] = "0" if name == "ray-jobs" else str(a.pool_size)
    out: dict[str, Any] = {"pool_size": int(server.env["PIPEPLAN_POOL_SIZE"]), "cells": {}}
    try:
        server.start()
        out["service_start_s"] = server.wait_healthy(START_TIMEOUT_S)
        t0 = time.perf_counter()
        warm = burst(server, a.presets[0], 1)[0]
        out["warm_up_job_s"] = time.perf_counter() - t0
        if warm["state"] != "succeeded":
            raise RuntimeError(f"the warm-up job ended {warm['state']}")
        for preset in a.presets:
            for size in BURSTS:
                rounds = a.rounds if size == 1 else a.burst_rounds
                jobs = [j for _ in range(rounds) for j in burst(server, preset, size)]
                out["cells"][f"{preset} x{size}"] = c = cell(jobs)
                console.print(
                    f"{name:9} {preset:15} x{size}: p50 {c['p50_s']:.2f} s, "
                    f"p99 {c['p99_s']:.2f} s ({c['succeeded']}/{c['jobs']} succeeded)"
                )
    except Exception as e:  # named in the results; the service's log tail on stderr
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"{name}: {e}\n{server.tail()}", file=sys.stderr)
    finally:
        out |= stop_everything(server, tmp / "state")
    return out


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Per cell: p50 and p99 before and after, and how many times faster the p50 is."""
    rows = {}
    before, after = res["ray-jobs"]["cells"], res["pool"]["cells"]
    for key in sorted(set(before) & set(after), key=list(after).index):
        b, p = before[key], after[key]
        ratio = b["p50_s"] / p["p50_s"] if b["p50_s"] and p["p50_s"] else None
        rows[key] = {
            "ray_jobs_p50_s": b["p50_s"],
            "ray_jobs_p99_s": b["p99_s"],
            "pool_p50_s": p["p50_s"],
            "pool_p99_s": p["p99_s"],
            "p50_speedup": ratio,
        }
    one = [r["pool_p50_s"] for k, r in rows.items() if k.endswith(" x1")]
    return {"rows": rows, "pool_p50_one_job_max_s": max(one) if one else None}


def print_table(s: dict[str, Any]) -> None:
    t = table(
        "submit -> result, dp plan of AlexNet (s)",
        ["preset x at once", "Ray Jobs p50", "Ray Jobs p99", "pool p50", "pool p99", "p50 x"],
        left=["preset x at once"],
    )

    def f(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:.2f}{unit}"

    for key, r in s["rows"].items():
        t.add_row(
            key,
            f(r["ray_jobs_p50_s"]),
            f(r["ray_jobs_p99_s"]),
            f(r["pool_p50_s"]),
            f(r["pool_p99_s"]),
            f(r["p50_speedup"], "x"),
        )
    console.print(t)
    worst = s["pool_p50_one_job_max_s"]
    if worst is not None:
        met = "met" if worst < TARGET_P50_S else "NOT met"
        console.print(f"pool, one job: p50 <= {worst:.2f} s (target {TARGET_P50_S:.0f} s: {met})")


def main() -> None:
    a = parse_args()
    bench = BenchRun("service_latency_quick" if a.quick else "service_latency")
    token = secrets.token_urlsafe(24)
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pipeplan-bench-") as tmp:
        for name in PHASES:
            (Path(tmp) / name).mkdir()
            res[name] = phase(name, a, Path(tmp) / name, token)
    s = summary(res)
    print_table(s)
    out = {
        "parameters": {
            "presets": a.presets,
            "bursts": list(BURSTS),
            "rounds": a.rounds,
            "burst_rounds": a.burst_rounds,
            "pool_size": a.pool_size,
            "job": {"kind": "plan", "spec": spec("PRESET")},
            "poll_s": POLL_S,
            "embedded_cluster": "one node, one fast device (ray start, token auth, loopback)",
        },
        "target": {"pool_p50_one_job_s": TARGET_P50_S, "on": "a quiet machine of this kind"},
        "summary": s,
        **res,
    }
    print(f"wrote {display(bench.write(out, out=a.out))}")


if __name__ == "__main__":
    main()
