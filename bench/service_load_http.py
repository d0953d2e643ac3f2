"""Parts 1 and 2 of ``bench.service_load``, on the bench service (the real app, a bench
backend): the latency of ``GET /v1/jobs`` from concurrent clients with many jobs stored, and
the events one job's control endpoint ingests per second: one event a request from
concurrent posters (2a), and as a job sends them, through its EventChannel (2b).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from pipeplan.service.api.auth import hash_token, new_job_token
from pipeplan.service.api.schemas import JobKind, JobState
from pipeplan.service.api.store import Store
from pipeplan.service.tasks.events import EventChannel

PROFILE: dict[str, Any] = {
    "name": "tiny",
    "input_shape": [3, 8, 8],
    "layers": [
        {
            "name": "c",
            "op": "conv",
            "params_bytes": 100,
            "flops": 1e6,
            "activation_bytes": 64,
            "successors": [1, 2],
        },
        {
            "name": "r",
            "op": "relu",
            "params_bytes": 0,
            "flops": 16,
            "activation_bytes": 64,
            "successors": [2],
        },
        {"name": "a", "op": "add", "params_bytes": 0, "flops": 16, "activation_bytes": 64},
    ],
}
SPEC: dict[str, Any] = {"profile": PROFILE, "cluster": "local-hetero", "planner": "dp", "batch": 8}
"""A small plan job (the same spec for the stored jobs, the fake backend and Ray)."""
RESULT: dict[str, Any] = {"planner": "dp", "evaluations": 12, "value": 0.0123, "wall_time_s": 0.2}


@dataclass
class Timings:
    """Latencies of one load (seconds), the errors met and the wall time it took."""

    latencies: list[float] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    errors: int = 0
    skipped: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, float | int]:
        lat = np.array(self.latencies or [np.nan]) * 1e3
        n = len(self.latencies)
        return {
            "requests": n,
            "errors": self.errors,
            "skipped_past_time_limit": self.skipped,
            "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)),
            "max_ms": float(np.max(lat)),
            "per_s": n / self.wall_s if self.wall_s > 0 else 0.0,
        }


def seed_jobs(db: str, count: int) -> float:
    """``count`` plan jobs in the store, nine in ten of them finished; the seconds it took."""
    t0 = time.perf_counter()
    store = Store(db)
    store.create_tables()
    try:
        for i in range(count):
            job = store.create_job(JobKind.PLAN, SPEC, f"seed-{i}", hash_token(new_job_token()))
            if i % 10:
                store.finish(job.id, JobState.SUCCEEDED, result=RESULT)
    finally:
        store.close()
    return time.perf_counter() - t0


def run_clients(
    make_client: Callable[[], httpx.Client],
    clients: int,
    work: Callable[[httpx.Client, int], tuple[float, bool]],
    items: list[list[int]],
    until: float,
) -> Timings:
    """``clients`` threads, each with its own client, doing ``work(client, item)`` for each
    item of its list (each call returns (latency, ok)); an item after ``until`` (a
    ``perf_counter`` time) is skipped."""

    def one(mine: list[int]) -> Timings:
        t = Timings()
        with make_client() as c:
            for item in mine:
                if time.perf_counter() > until:
                    t.skipped += 1
                    continue
                latency, ok = work(c, item)
                t.latencies.append(latency)
                t.done.append(item)
                t.errors += not ok
        return t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        parts = list(pool.map(one, items))
    out = Timings(wall_s=time.perf_counter() - t0)
    for p in parts:
        out.latencies += p.latencies
        out.errors += p.errors
        out.skipped += p.skipped
        out.done += p.done
    return out


def list_load(
    make_client: Callable[[], httpx.Client], clients: int, requests: int, page: int, until: float
) -> Timings:
    """``requests`` ``GET /v1/jobs`` (default page) from ``clients`` clients, none after
    ``until``; a wrong page size counts as an error."""

    def get(c: httpx.Client, _: int) -> tuple[float, bool]:
        t0 = time.perf_counter()
        r = c.get("/v1/jobs")
        latency = time.perf_counter() - t0
        return latency, r.status_code == 200 and len(r.json()["items"]) == page

    per = [list(range(i, requests, clients)) for i in range(clients)]
    return run_clients(make_client, clients, get, per, until)


def submit_job(client: httpx.Client, name: str) -> str:
    """Submit the small plan job; its id."""
    r = client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC, "name": name})
    if r.status_code != 201:
        raise RuntimeError(f"submit: {r.status_code} {r.text[:300]}")
    return str(r.json()["id"])


def event_doc(seq: int) -> dict[str, Any]:
    """The ``evaluation`` event of seq ``seq`` (as a search posts them)."""
    data = {"plan": None, "value": 0.01 + seq * 1e-6, "source": "simulated", "search": "bench"}
    return {"seq": seq, "type": "evaluation", "data": data | {"i": seq}}


def ingest(
    url: str, job_id: str, job_token: str, events: int, posters: int, until: float
) -> Timings:
    """Post seqs 0..events-1 to the job's control endpoint from ``posters`` posters (poster
    i posts seqs i, i+posters, ...), none after ``until``; an answer other than ``stored:
    true`` is an error."""
    path = f"/v1/jobs/{job_id}/events"

    def make() -> httpx.Client:
        auth = {"Authorization": f"Bearer {job_token}"}
        return httpx.Client(base_url=url, headers=auth, timeout=30.0)

    def post(c: httpx.Client, seq: int) -> tuple[float, bool]:
        t0 = time.perf_counter()
        r = c.post(path, json=event_doc(seq))
        latency = time.perf_counter() - t0
        return latency, r.status_code == 200 and r.json().get("stored") is True

    per = [list(range(i, events, posters)) for i in range(posters)]
    return run_clients(make, posters, post, per, until)


def stored_check(client: httpx.Client, job_id: str, posted: list[int]) -> dict[str, int | bool]:
    """What the service stored for the job: rows, distinct seqs, and whether they are
    exactly the ``posted`` seqs, in order, with the data that was posted."""
    stored = all_events(client, job_id)
    seqs = [e["seq"] for e in stored]
    same = all(e["data"] == event_doc(e["seq"])["data"] for e in stored)
    exact = seqs == sorted(posted) and same
    return {"stored": len(seqs), "distinct": len(set(seqs)), "exact": exact}


def all_events(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """Every stored event of the job, oldest first (page after page)."""
    out: list[dict[str, Any]] = []
    while True:
        after = out[-1]["seq"] if out else -1
        r = client.get(f"/v1/jobs/{job_id}/events", params={"after": after})
        r.raise_for_status()
        page: list[dict[str, Any]] = r.json()
        if not page:
            return out
        out += page


PLAN_DOC: dict[str, Any] = {
    "global_batch": 32,
    "schedule": "1f1b",
    "stages": [
        {"layers": [0, 2], "devices": ["n0/fast:0"], "microbatch": 8},
        {"layers": [2, 3], "devices": ["n1/mid:0", "n1/mid:1"], "microbatch": 8},
    ],
}
"""The plan an evaluation event of part 2b carries (the size of a real two-stage plan)."""


def sender_doc(seq: int) -> dict[str, Any]:
    """The data of evaluation ``seq`` as a search reports it."""
    return {"plan": PLAN_DOC, "value": 0.01 + seq * 1e-6, "source": "simulated", "i": seq}


def deliver(
    api: httpx.Client,
    url: str,
    job_id: str,
    job_token: str,
    events: int,
    rate: float | None = None,
) -> dict[str, Any]:
    """Parts 2b and 2c: ``events`` evaluation events emitted through the job side's own
    :class:`~service.tasks.events.EventChannel` (one sender thread, in order; what queues
    behind a post goes out as one batch), as fast as they come (2b) or paced at ``rate``
    a second like a steady search (2c); timed from the first emit until every event is
    acknowledged (``lag_s``: from the last emit). Then what the service stored (read with
    ``api``, a client with the API token)."""
    posts: list[int] = []

    def count(request: httpx.Request) -> None:
        posts.append(1)

    with httpx.Client(base_url=url, timeout=30.0, event_hooks={"request": [count]}) as c:
        channel = EventChannel(c, job_id, job_token)
        t0 = time.perf_counter()
        for seq in range(events):
            if rate is not None and (ahead := t0 + seq / rate - time.perf_counter()) > 0:
                time.sleep(ahead)
            channel.emit("evaluation", sender_doc(seq))
        emitted = time.perf_counter()
        channel.close()
        done = time.perf_counter()
        wall = done - t0
    stored = all_events(api, job_id)
    seqs = [e["seq"] for e in stored]
    exact = seqs == list(range(events)) and all(e["data"] == sender_doc(e["seq"]) for e in stored)
    return {
        "events": events,
        "rate_asked": rate,
        "posts": len(posts),
        "wall_s": wall,
        "lag_s": done - emitted,
        "per_s": events / wall if wall > 0 else 0.0,
        "stored": len(seqs),
        "distinct": len(set(seqs)),
        "exact": exact,
    }
