"""The queue of jobs that need devices (API.md, "The queue").

A job that runs on the cluster's devices (``run``, ``train``, a measured profile or search)
reserves them as one Ray placement group when it starts (:mod:`executor.reservation`); while
others hold them it waits, ``queued``, saying for what. Which job goes first is decided
here, in **start order**: the jobs already handed to the backend, then the held ones by
``priority`` (higher first), then age.

A device job is handed to the backend only when no device job before it in start order is
still queued (held back, or handed over and not running yet) that may want the same
devices; until then it is held, ``queued`` with ``waiting_for: {"behind": [...]}``. Two
jobs may want the same devices unless both plans are known (a ``run``'s, a ``train``'s with
a ``plan``) and share no (node, device type). So jobs that may compete never wait in Ray's
queue together (Ray grants placement groups in no order of ours), and no job starts ahead
of one before it that wants its devices: a big job at the head is never passed by smaller
ones that would fit meanwhile (no starvation), at the price of devices left idle while it
waits (no backfilling among competing jobs). Jobs on other devices start beside it. A job
handed over keeps its place: a higher priority submitted later goes next, not before it.
Jobs that need no devices start at once.

A job that has not started ``deadline_s`` seconds after it was submitted fails
(``deadline: ...``), its Ray job stopped. :func:`dispatch` runs in the service's loop, and
after every submission; a service that restarts finds its held jobs in the store and
starts them in turn, so none is lost.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from pipeplan.core.cluster import parse_device_id
from pipeplan.core.errors import FormatError
from pipeplan.service.api.auth import hash_token, new_job_token
from pipeplan.service.api.backend import JobsBackend, Submission
from pipeplan.service.api.pool.routing import needs_devices
from pipeplan.service.api.schemas import Job, JobState
from pipeplan.service.api.store import JobFinished, Store, now

log = logging.getLogger("pipeplan.service")

_one_at_a_time = threading.Lock()
"""One dispatch at a time in this process (the loop's and a submission's)."""


def start(job: Job, store: Store, backend: JobsBackend, server_url: str) -> Job:
    """Hand held ``job`` to the backend with a token of its own (only its hash is kept);
    a job another dispatch took meanwhile is left to it, and a backend that refuses it ends
    it ``failed`` with the reason."""
    token = new_job_token()
    if not store.claim_start(job.id, hash_token(token)):
        return store.get_job(job.id)
    try:
        ray_job_id = backend.submit(Submission(job.id, server_url, token))
    except Exception as e:  # whatever the backend raises, the job fails with its reason
        return store.finish(job.id, JobState.FAILED, error=f"submit: {type(e).__name__}: {e}")
    if ray_job_id != job.id:
        store.set_ray_job_id(job.id, ray_job_id)
    return store.get_job(job.id)


def held(job: Job) -> bool:
    """Queued and not handed to the backend yet."""
    return job.state is JobState.QUEUED and job.ray_job_id is None


def past_deadline(job: Job) -> bool:
    return job.deadline_s is not None and (now() - job.created_at).total_seconds() > job.deadline_s


def start_order(queued: list[Job]) -> list[Job]:
    """``queued`` (by priority, then age) with the jobs handed to the backend first: once
    started, a job keeps its place before the held ones, whatever their priority."""
    return sorted(queued, key=held)


def dispatch(store: Store, backend: JobsBackend, server_url: str) -> list[str]:
    """Walk the queued jobs in start order: fail those past their deadline, start the held
    ones whose turn it is (module docstring), tell the others whom they are behind; the ids
    of the jobs started."""
    with _one_at_a_time:
        return _dispatch(store, backend, server_url)


Slots = frozenset[tuple[str, str]] | None
"""The (node, device type) pairs a job reserves devices of; None: not known before it runs
(it may take any)."""


def slots(job: Job) -> Slots:
    """What a job's plan reserves, where its spec holds the plan (``run``, and ``train``
    with a ``plan``); None otherwise."""
    plan: Any = job.spec.get("plan")
    try:
        return frozenset(
            parse_device_id(d)[:2] for stage in plan["stages"] for d in stage["devices"]
        )
    except (TypeError, KeyError, FormatError):
        return None


def overlap(a: Slots, b: Slots) -> bool:
    return a is None or b is None or not a.isdisjoint(b)


def _dispatch(store: Store, backend: JobsBackend, server_url: str) -> list[str]:
    started: list[str] = []
    ahead: list[Job] = []
    for job in start_order(store.queued_jobs()):
        if past_deadline(job):
            _expire(job, store, backend)
            continue
        devices = needs_devices(job.kind, job.spec)
        before = [a for a in ahead if held(a) or overlap(slots(a), slots(job))]
        if held(job) and not (devices and before):
            started.append(start(job, store, backend, server_url).id)
        elif held(job):
            reason: dict[str, Any] = {"behind": [a.id for a in before]}
            if job.waiting_for != reason:
                store.set_waiting_for(job.id, reason)
        if devices:
            ahead.append(job)
    return started


def _expire(job: Job, store: Store, backend: JobsBackend) -> None:
    if job.ray_job_id is not None:
        try:
            backend.stop(job.id)
        except Exception:  # the job fails anyway; its Ray job's own end is reconciled
            log.exception("deadline: cannot stop job %s", job.id)
    with contextlib.suppress(JobFinished):  # it ended meanwhile
        store.finish(
            job.id,
            JobState.FAILED,
            error=f"deadline: not started within deadline_s={job.deadline_s:g} s",
        )
