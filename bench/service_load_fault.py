"""Part 4 of ``bench.service_load``: the restart scenario, repeated.

Each run submits a job, and its events go out through the job side's own
:class:`~service.tasks.events.EventChannel` (increasing seq, one sender, retried with backoff
while the service is unreachable) while more jobs are being submitted; at a random moment
the service process is killed with SIGKILL and started again on the same database. Then the
job posts its result, and the run counts the events lost (a sent seq not stored, or stored
with other data), the events doubled (a seq stored twice) and the jobs lost (a job whose
submission was acknowledged with 201 that the service no longer lists).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.service_load_http import RESULT, SPEC, all_events, event_doc, submit_job
from bench.service_load_server import ServerProcess, job_tokens
from pipeplan.service.tasks.events import Delivery, EventChannel, EventDeliveryError

DELIVERY = Delivery(first_wait_s=0.05, max_wait_s=0.5, deadline_s=120.0)
"""The job side's backoff in these runs (shorter waits than a job's default, same code)."""
EMIT_EVERY_S = 0.002
KILL_AFTER_S = (0.15, 0.6)
"""The kill comes at a uniform random time in this range after the job starts posting."""
SUBMIT_EVERY_S = 0.05


@dataclass
class FaultRun:
    events_sent: int
    emitted_at_kill: int
    acked_at_kill: int
    retries: int
    down_s: float
    events_stored: int
    events_lost: int
    events_doubled: int
    jobs_acked: int
    jobs_lost: int
    job_state: str
    delivery_error: str | None


def submit_loop(server: ServerProcess, stop: threading.Event, acked: list[str]) -> None:
    """Submit jobs until ``stop``; the ids acknowledged with 201 go to ``acked``."""
    body = {"kind": "plan", "spec": SPEC, "name": "fault-load"}
    with server.client(timeout_s=5.0) as c:
        while not stop.is_set():
            try:
                r = c.post("/v1/jobs", json=body)
                if r.status_code == 201:
                    acked.append(str(r.json()["id"]))
            except httpx.TransportError:
                pass
            time.sleep(SUBMIT_EVERY_S)


def emit_all(channel: EventChannel, events: int) -> None:
    for seq in range(events):
        doc = event_doc(seq)
        channel.emit(doc["type"], doc["data"])
        time.sleep(EMIT_EVERY_S)


def listed_ids(client: httpx.Client) -> set[str]:
    """Every job id the service lists (page after page)."""
    ids: set[str] = set()
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 1000} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/jobs", params=params).json()
        ids |= {j["id"] for j in page["items"]}
        if not (cursor := page["next"]):
            return ids


def count_losses(stored: list[dict[str, Any]], events: int) -> tuple[int, int]:
    """(lost, doubled) of ``events`` evaluations and the result, against what was stored."""
    expected = {seq: event_doc(seq)["data"] for seq in range(events)} | {events: RESULT}
    seqs = [e["seq"] for e in stored]
    same = {e["seq"] for e in stored if expected.get(e["seq"]) == e["data"]}
    doubled = len(seqs) - len(set(seqs)) + len(set(seqs) - expected.keys())
    return len(expected.keys() - same), doubled


class JobSide:
    """The job's side: its EventChannel to the service, counting retries and acks."""

    def __init__(self, server: ServerProcess, job_id: str, token: str) -> None:
        self.retries = self.acked = 0
        hooks = {"response": [self._count_ack]}
        self.http = httpx.Client(base_url=server.url, timeout=10.0, event_hooks=hooks)
        self.channel = EventChannel(self.http, job_id, token, DELIVERY, self._sleep)

    def _sleep(self, s: float) -> None:
        self.retries += 1
        time.sleep(s)

    def _count_ack(self, r: httpx.Response) -> None:
        self.acked += r.status_code == 200

    def finish(self) -> str | None:
        """Post the result, deliver everything; the delivery error if any."""
        try:
            self.channel.emit("result", RESULT)
            self.channel.close()
        except EventDeliveryError as e:
            return str(e)
        finally:
            self.http.close()
        return None


def one_run(server: ServerProcess, tmp: Path, i: int, events: int, kill_after: float) -> FaultRun:
    """One restart scenario (module docstring) against the running ``server``."""
    with server.client() as api:
        job_id = submit_job(api, f"fault-{i}")
    job = JobSide(server, job_id, job_tokens(tmp)[job_id])
    stop, submitted = threading.Event(), [job_id]
    threads = [
        threading.Thread(target=submit_loop, args=(server, stop, submitted)),
        threading.Thread(target=emit_all, args=(job.channel, events)),
    ]
    for t in threads:
        t.start()
    time.sleep(kill_after)
    at_kill, acked_at_kill, t_kill = job.channel.next_seq, job.acked, time.perf_counter()
    server.kill()
    server.start()
    server.wait_healthy(120)
    down_s = time.perf_counter() - t_kill
    threads[1].join()
    error = job.finish()
    stop.set()
    threads[0].join()
    with server.client() as api:
        stored = all_events(api, job_id)
        lost, doubled = count_losses(stored, events)
        state = api.get(f"/v1/jobs/{job_id}").json()["state"]
        jobs_lost = len(set(submitted) - listed_ids(api))
    counts = (events + 1, at_kill, acked_at_kill, job.retries, down_s, len(stored), lost, doubled)
    return FaultRun(*counts, len(submitted), jobs_lost, state, error)


def fault_runs(
    server: ServerProcess, tmp: Path, runs: int, events: int, seed: int
) -> dict[str, Any]:
    """``runs`` restart scenarios on one database; every run and the totals."""
    rng = np.random.default_rng(seed)
    done = [one_run(server, tmp, i, events, float(rng.uniform(*KILL_AFTER_S))) for i in range(runs)]
    down = [r.down_s for r in done]
    totals = {
        "runs": runs,
        "events_lost": sum(r.events_lost for r in done),
        "events_doubled": sum(r.events_doubled for r in done),
        "jobs_lost": sum(r.jobs_lost for r in done),
        "jobs_acked": sum(r.jobs_acked for r in done),
        "runs_not_succeeded": sum(r.job_state != "succeeded" for r in done),
        "delivery_errors": sum(r.delivery_error is not None for r in done),
        "runs_with_retries": sum(r.retries > 0 for r in done),
        "down_s_median": float(np.median(down)) if down else 0.0,
        "down_s_max": max(down, default=0.0),
    }
    return {"totals": totals, "runs": [asdict(r) for r in done]}
