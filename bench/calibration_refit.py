"""The API's request latency while the service refits a cluster's calibration from ``--runs``
measured plans: the fit in a thread of the API process (how the service fitted before) and
in the calibration's fit worker, a child process (:mod:`service.api.calibration_fit`).

The app (a SQLite store in a temporary folder, a backend that runs nothing) is driven
in-process through a ``TestClient``: one client sends ``GET /v1/jobs`` back to back for as
long as the fit runs, and the p50, p99 and worst latency are compared with the same requests
while nothing is fitted. The runs are the synthetic case of the calibration tests
(:mod:`tests.calibration_cases`): the cost model's answers under a known calibration with a
seeded 3% noise, so that the fit has the work of a real one. The worker is started before
the measured fit (its start-up is reported apart: the service pays it once). Writes
``bench/results/calibration_refit/<UTC date-time>.json`` (:mod:`bench.record`: the date,
machine and load are its provenance).

    .venv/bin/python -m bench.calibration_refit [--runs 200] [--baseline-s 3]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient

from bench.record import BenchRun, display
from pipeplan.core.costmodel import simulate
from pipeplan.service.api.app import create_app
from pipeplan.service.api.calibration_fit import FitPayload, FitWorker, RunDoc, fit_record
from pipeplan.service.api.settings import Settings
from pipeplan.service.tasks.observations import document_sha256
from tests.calibration_cases import TRUTH, cluster, plans, profile
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

NOISE = 0.03
"""The relative spread of the synthetic measurements."""


def payload(runs: int, seed: int = 0) -> FitPayload:
    """``runs`` measured plans of the synthetic case (module docstring), oldest first."""
    rng = np.random.default_rng(seed)
    truth, prof = cluster().calibrated(TRUTH), profile()
    prof_doc = prof.to_dict()
    sha = document_sha256(prof_doc)
    estimates = [(p, simulate(p, prof, truth)) for p in plans()]
    docs: list[RunDoc] = []
    for i in range(runs):
        plan, est = estimates[i % len(estimates)]
        noise = 1.0 + NOISE * float(rng.standard_normal())
        docs.append(
            {
                "plan": plan.to_dict(),
                "profile_sha256": sha,
                "batch_time_s": est.batch_time_s * noise,
                "forward_s": [s.forward_s * noise for s in est.stages],
                "backward_s": [s.backward_s * noise for s in est.stages],
                "emulated": False,
                "job_id": f"job-{i // len(estimates)}",
            }
        )
    return {"spec": cluster().to_dict(), "profiles": {sha: prof_doc}, "runs": docs}


def latencies(client: TestClient, until: Callable[[], bool]) -> list[float]:
    """Seconds of each ``GET /v1/jobs``, sent back to back until ``until()``."""
    out = []
    while not until():
        t0 = time.perf_counter()
        client.get("/v1/jobs").raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


def summary(values: list[float]) -> dict[str, float | int]:
    ms = np.array(values) * 1e3
    return {
        "requests": len(values),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
    }


def during(client: TestClient, fit: Callable[[], Any]) -> dict[str, Any]:
    """The latencies while ``fit()`` runs in a thread of this process, and its seconds."""
    t0 = time.perf_counter()
    thread = threading.Thread(target=fit)
    thread.start()
    values = latencies(client, lambda: not thread.is_alive())
    thread.join()
    return {"fit_wall_s": time.perf_counter() - t0, **summary(values)}


def run(runs: int, baseline_s: float, settings: Settings) -> dict[str, Any]:
    doc = payload(runs)
    worker = FitWorker()
    app = create_app(settings, backend=FakeBackend(), fit_worker=worker)
    try:
        with TestClient(app, headers=AUTH) as client:
            for _ in range(20):  # warm the routes up
                client.get("/v1/jobs")
            end = time.perf_counter() + baseline_s
            idle = summary(latencies(client, lambda: time.perf_counter() > end))
            t0 = time.perf_counter()
            worker.fit(payload(4))  # the worker's start (spawn, imports), paid once
            start_s = time.perf_counter() - t0
            in_thread = during(client, lambda: fit_record(doc))
            in_worker = during(client, lambda: worker.fit(doc))
    finally:
        worker.close()
    return {
        "runs": runs,
        "idle": idle,
        "fit_in_api_thread": in_thread,
        "fit_in_worker_process": in_worker,
        "worker_start_s": start_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="measured plans the fit reads")
    parser.add_argument("--baseline-s", type=float, default=3.0, help="seconds of idle requests")
    args = parser.parse_args()
    bench = BenchRun("calibration_refit")
    if args.runs < 4:
        parser.error(f"--runs: at least 4 (a held-out quarter), got {args.runs}")
    if args.baseline_s <= 0:
        parser.error(f"--baseline-s: must be > 0, got {args.baseline_s}")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.runs, args.baseline_s, make_settings(Path(tmp)))
    for label in ("idle", "fit_in_api_thread", "fit_in_worker_process"):
        r = result[label]
        fit = f", fit {r['fit_wall_s']:.1f} s" if "fit_wall_s" in r else ""
        print(
            f"{label:<22} {r['requests']:>6} requests: p50 {r['p50_ms']:.1f} ms, "
            f"p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms{fit}"
        )
    print(f"worker start (once): {result['worker_start_s']:.1f} s")
    print(f"wrote {display(bench.write(result))}")


if __name__ == "__main__":
    main()
