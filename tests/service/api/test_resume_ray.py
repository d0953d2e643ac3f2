"""A search outlives its Ray Job (API.md, "Retries and resumed searches"), on a real Ray:
``pipeplan serve`` with its embedded two-node cluster (the fixture of
``test_reliability.py``), a TAPP plan job with ``retries: 1`` whose driver is killed by pid
once it has checkpointed. The reconcile hands it to Ray again as ``JOBID-a2``; the new
attempt resumes from the checkpoint in the job's folder (its evaluations go on from the
checkpoint's count) and succeeds, with ``attempt`` 2 and the ``attempt`` event naming the
checkpoint; the job's artifacts list the checkpoint, the trained policy and the Gantt
chart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.executor.ray_jobs import RayJobs
from pipeplan.service.api.backend import first_seq
from tests.service.api.test_ray_jobs import Service, wait_done
from tests.service.api.test_reliability import (
    DUO,
    entrypoints,
    events,
    service,  # noqa: F401  (the module's service and cluster)
)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[3]
ALEXNET = load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")
SEARCH: dict[str, Any] = {
    "profile": ALEXNET.to_dict(),
    "cluster": DUO.to_dict(),
    "planner": "tapp",
    "batch": 16,
    "seed": 0,
    "options": {"patience": None, "checkpoint_every": 2},
    "budget": {"evaluations": 10**7, "seconds": 30},
}
"""A TAPP search on the cost model that runs 30 s in all (the budget counts both attempts'
time), checkpointing every other iteration into its job's folder."""


def wait_for(what: str, ready: Any, timeout_s: float, svc: Service, job_id: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := ready()) is not None:
            return got
        time.sleep(0.3)
    logs = svc.client.get(f"/v1/jobs/{job_id}/logs").text
    raise AssertionError(f"job {job_id}: no {what} in {timeout_s} s; log:\n{logs[-3000:]}")


def test_a_search_whose_driver_is_killed_resumes_and_succeeds(
    service: Service,  # noqa: F811
) -> None:
    r = service.client.post("/v1/jobs", json={"kind": "plan", "spec": SEARCH, "retries": 1})
    assert r.status_code == 201, r.text
    job = r.json()
    job_id, folder = job["id"], Path(job["spec"]["options"]["checkpoint_dir"])
    assert folder.parts[-2:] == (job_id, "search")
    checkpoint = folder / "search.pt"
    wait_for(
        "checkpoint", lambda: checkpoint if checkpoint.is_file() else None, 120, service, job_id
    )

    procs = entrypoints(job_id)
    assert procs, f"no entrypoint process of job {job_id}"
    for p in procs:
        p.kill()
    attempt = wait_for(
        "attempt event",
        lambda: next((e for e in events(service, job_id) if e["type"] == "attempt"), None),
        60,
        service,
        job_id,
    )
    saved = torch.load(attempt["data"]["resumes_from"], weights_only=True)  # before it moves on
    at_cut = saved["tasks"][0]["search"]["evaluations"]
    assert attempt["data"]["resumes_from"] == str(checkpoint) and at_cut > 0
    assert attempt["data"]["attempt"] == 2 and attempt["data"]["submission_id"] == f"{job_id}-a2"
    assert "without a result" in attempt["data"]["reason"]

    done = wait_done(service.client, job_id, timeout_s=180)
    logs = service.client.get(f"/v1/jobs/{job_id}/logs").text
    assert done["state"] == "succeeded", (done, logs[-3000:])
    assert (done["attempt"], done["ray_job_id"]) == (2, f"{job_id}-a2")
    assert RayJobs(service.cluster.dashboard_url).info(job_id).status == "FAILED"
    stored = events(service, job_id)
    second = [e for e in stored if e["seq"] >= first_seq(2)]
    counts = [e["data"]["evaluations"] for e in second if e["type"] == "progress"]
    assert [c for c in counts if c] and min(c for c in counts if c) > at_cut  # went on
    assert second[-1]["type"] == "result" and second[-1]["data"]["evaluations"] > at_cut
    final = torch.load(checkpoint, weights_only=True)
    assert final["loop"]["iteration"] > saved["loop"]["iteration"]

    names = [a["name"] for a in service.client.get(f"/v1/jobs/{job_id}/artifacts").json()]
    assert {"plan.json", "gantt.png", "search/search.pt", "search/policy.pt"} <= set(names)
    png = service.client.get(f"/v1/jobs/{job_id}/artifacts/gantt.png")
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
