"""Jobs: the ``jobs`` and ``events`` tables (the events' primary key is ``(job_id, seq)``,
so a repeated seq is never stored twice, even when two copies race), the store's refusals,
and :class:`JobStore`: create, read, page through and end jobs.

Terminal states never change again: every state change is one conditional ``UPDATE``.
A job whose work was lost may be handed to the backend again (:meth:`JobStore.begin_attempt`:
``retries``, ``attempt``); a database written before these columns existed gets them, NULL
in its rows, which read as no retries and the first attempt (:meth:`Database.create_tables`).
"""

from __future__ import annotations

import base64
import secrets
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    Row,
    String,
    Table,
    Text,
    func,
    insert,
    select,
    update,
)

from pipeplan.service.api.schemas import TERMINAL, EventType, Job, JobKind, JobState
from pipeplan.service.api.store.database import finite, now, utc
from pipeplan.service.api.store.tokens import TokenStore

OPEN_STATES = (JobState.QUEUED.value, JobState.RUNNING.value)


class StoreError(Exception):
    """Base of the store's refusals (the routes turn them into HTTP errors)."""


class JobNotFound(StoreError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r}: no such job")


class JobFinished(StoreError):
    """The job is terminal: it changes no more."""

    def __init__(self, job_id: str, state: JobState) -> None:
        super().__init__(f"job {job_id!r} is {state.value}: it changes no more")
        self.state = state


class BadCursor(StoreError):
    def __init__(self, cursor: str) -> None:
        super().__init__(f"cursor: not a cursor this service issued, got {cursor!r}")


def new_job_id() -> str:
    return f"pp-{secrets.token_hex(8)}"


def job_tables(metadata: MetaData, prefix: str) -> tuple[Table, Table]:
    """The jobs and events tables (module docstring)."""
    jobs = Table(
        f"{prefix}jobs",
        metadata,
        Column("num", Integer, primary_key=True, autoincrement=True),
        Column("id", String(64), unique=True, nullable=False),
        Column("kind", String(16), nullable=False, index=True),
        Column("state", String(16), nullable=False, index=True),
        Column("name", Text),
        Column("spec", JSON, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("started_at", DateTime(timezone=True)),
        Column("finished_at", DateTime(timezone=True)),
        Column("progress", JSON),
        Column("progress_seq", BigInteger),
        Column("result", JSON),
        Column("error", Text),
        Column("ray_job_id", String(128)),
        Column("token_hash", String(64), nullable=False, index=True),
        Column("created_by", String(32), index=True),
        Column("waiting_for", JSON),
        Column("priority", Integer),
        Column("deadline_s", Float),
        Column("retries", Integer),
        Column("attempt", Integer),
        Column("attempted_at", DateTime(timezone=True)),
    )
    events = Table(
        f"{prefix}events",
        metadata,
        Column("job_id", String(64), ForeignKey(jobs.c.id), primary_key=True),
        Column("seq", BigInteger, primary_key=True, autoincrement=False),
        Column("type", String(16), nullable=False),
        Column("data", JSON, nullable=False),
        Column("received_at", DateTime(timezone=True), nullable=False),
    )
    return jobs, events


@dataclass(frozen=True)
class Page:
    jobs: list[Job]
    next: str | None


class JobStore(TokenStore):
    """Jobs in the database at ``url`` (tables named ``{prefix}jobs`` and
    ``{prefix}events``; tests use a prefix of their own), beside the tokens and calibration
    tables of :class:`TokenStore`; the events' methods are :class:`service.api.store.Store`'s."""

    def __init__(self, url: str, prefix: str = "") -> None:
        super().__init__(url, prefix)
        self.jobs, self.events = job_tables(self.metadata, prefix)

    # --- jobs ---------------------------------------------------------------------------------

    def _job(self, row: Row[Any]) -> Job:
        m = row._mapping
        return Job(
            id=m["id"],
            kind=JobKind(m["kind"]),
            state=JobState(m["state"]),
            name=m["name"],
            spec=m["spec"],
            created_at=utc(m["created_at"]) or now(),
            started_at=utc(m["started_at"]),
            finished_at=utc(m["finished_at"]),
            progress=m["progress"],
            result=m["result"],
            error=m["error"],
            ray_job_id=m["ray_job_id"],
            created_by=m["created_by"],
            waiting_for=m["waiting_for"],
            priority=m["priority"] or 0,
            deadline_s=m["deadline_s"],
            retries=m["retries"] or 0,
            attempt=m["attempt"] or 1,
        )

    def create_job(
        self,
        kind: JobKind,
        spec: dict[str, Any],
        name: str | None,
        token_hash: str,
        job_id: str | None = None,
        created_by: str | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
        retries: int = 0,
    ) -> Job:
        """A new ``queued`` job (``job_id``: one drawn with :func:`new_job_id` beforehand,
        for a spec that names the job's own folder; ``created_by``: the submitting token's
        id; ``retries``: how often it may be handed over again, :meth:`begin_attempt`)."""
        job_id = job_id or new_job_id()
        with self.engine.begin() as conn:
            conn.execute(
                insert(self.jobs).values(
                    id=job_id,
                    kind=kind.value,
                    state=JobState.QUEUED.value,
                    name=name,
                    spec=finite(spec),
                    created_at=now(),
                    token_hash=token_hash,
                    created_by=created_by,
                    priority=priority,
                    deadline_s=deadline_s,
                    retries=retries,
                    attempt=1,
                )
            )
        return self.get_job(job_id)

    def get_job(self, job_id: str) -> Job:
        with self.engine.connect() as conn:
            row = conn.execute(select(self.jobs).where(self.jobs.c.id == job_id)).first()
        if row is None:
            raise JobNotFound(job_id)
        return self._job(row)

    def token_hash(self, job_id: str) -> str | None:
        """The hash of the job's token (None: no such job)."""
        with self.engine.connect() as conn:
            value = conn.execute(
                select(self.jobs.c.token_hash).where(self.jobs.c.id == job_id)
            ).scalar()
        return None if value is None else str(value)

    def job_of_token(self, token_hash: str) -> str | None:
        """The id of the job whose token hashes to ``token_hash``, else None."""
        with self.engine.connect() as conn:
            value = conn.execute(
                select(self.jobs.c.id).where(self.jobs.c.token_hash == token_hash).limit(1)
            ).scalar()
        return None if value is None else str(value)

    def list_jobs(
        self,
        state: JobState | None = None,
        kind: JobKind | None = None,
        limit: int = 50,
        cursor: str | None = None,
        created_by: str | None = None,
    ) -> Page:
        """Newest first; ``cursor`` (opaque) continues after the last job of a page;
        ``created_by``: only the jobs that token submitted."""
        query = select(self.jobs).order_by(self.jobs.c.num.desc()).limit(limit + 1)
        if created_by is not None:
            query = query.where(self.jobs.c.created_by == created_by)
        if state is not None:
            query = query.where(self.jobs.c.state == state.value)
        if kind is not None:
            query = query.where(self.jobs.c.kind == kind.value)
        if cursor is not None:
            query = query.where(self.jobs.c.num < _decode_cursor(cursor))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        more = len(rows) > limit
        rows = rows[:limit]
        nxt = _encode_cursor(rows[-1]._mapping["num"]) if more and rows else None
        return Page([self._job(r) for r in rows], nxt)

    def unfinished_jobs(self) -> list[Job]:
        """Every job that is not terminal (to reconcile with the backend), oldest first."""
        query = (
            select(self.jobs).where(self.jobs.c.state.in_(OPEN_STATES)).order_by(self.jobs.c.num)
        )
        with self.engine.connect() as conn:
            return [self._job(r) for r in conn.execute(query).all()]

    def open_jobs_of(self, created_by: str) -> int:
        """How many jobs the token ``created_by`` submitted are queued or running."""
        j = self.jobs
        query = select(func.count()).where(j.c.created_by == created_by, j.c.state.in_(OPEN_STATES))
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar() or 0)

    def queued_jobs(self) -> list[Job]:
        """Every queued job in start order: higher ``priority`` first, then the older."""
        j = self.jobs
        query = (
            select(j)
            .where(j.c.state == JobState.QUEUED.value)
            .order_by(func.coalesce(j.c.priority, 0).desc(), j.c.num)
        )
        with self.engine.connect() as conn:
            return [self._job(r) for r in conn.execute(query).all()]

    def set_waiting_for(self, job_id: str, reason: dict[str, Any] | None) -> None:
        """What a queued job waits for (None: nothing); a job that left ``queued`` keeps
        what its events set."""
        with self.engine.begin() as conn:
            conn.execute(
                update(self.jobs)
                .where(self.jobs.c.id == job_id, self.jobs.c.state == JobState.QUEUED.value)
                .values(waiting_for=reason)
            )

    def counts(self) -> Counter[tuple[str, str]]:
        """How many jobs of each (state, kind)."""
        j = self.jobs
        query = select(j.c.state, j.c.kind, func.count()).group_by(j.c.state, j.c.kind)
        with self.engine.connect() as conn:
            return Counter({(s, k): int(n) for s, k, n in conn.execute(query).all()})

    def claim_start(self, job_id: str, token_hash: str) -> bool:
        """Mark a held job as handed to the backend (``ray_job_id``: its own id, the
        backend's submission id) with the hash of the token its work gets; False when it
        is not held any more (another dispatch took it, or it ended)."""
        j = self.jobs
        with self.engine.begin() as conn:
            done = conn.execute(
                update(j)
                .where(
                    j.c.id == job_id,
                    j.c.state == JobState.QUEUED.value,
                    j.c.ray_job_id.is_(None),
                )
                .values(token_hash=token_hash, ray_job_id=job_id, waiting_for=None)
            )
        return done.rowcount > 0

    def set_ray_job_id(self, job_id: str, ray_job_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(self.jobs).where(self.jobs.c.id == job_id).values(ray_job_id=ray_job_id)
            )

    def begin_attempt(
        self, job: Job, submission_id: str, token_hash: str, seq: int, event: dict[str, Any]
    ) -> bool:
        """Hand ``job`` over again: its next attempt (``job.attempt + 1``) goes under the
        backend's ``submission_id`` with a new job token (its hash: the last attempt's
        token can post no more), the job back to ``queued`` (its first event makes it
        ``running`` again), and the service's ``attempt`` event ``event`` stored at ``seq``
        -- all in one transaction, and only if the job is still open at ``job.attempt``
        (False otherwise: it ended, or another reconcile took it)."""
        j = self.jobs
        with self.engine.begin() as conn:
            done = conn.execute(
                update(j)
                .where(
                    j.c.id == job.id,
                    j.c.state.in_(OPEN_STATES),
                    func.coalesce(j.c.attempt, 1) == job.attempt,
                )
                .values(
                    state=JobState.QUEUED.value,
                    started_at=None,
                    waiting_for=None,
                    attempt=job.attempt + 1,
                    attempted_at=now(),
                    ray_job_id=submission_id,
                    token_hash=token_hash,
                )
            )
            if done.rowcount == 0:
                return False
            conn.execute(
                insert(self.events).values(
                    job_id=job.id,
                    seq=seq,
                    type=EventType.ATTEMPT.value,
                    data=finite(event),
                    received_at=now(),
                )
            )
        return True

    def attempted_at(self, job_id: str) -> datetime | None:
        """When the job's current attempt was handed over (None: it is its first)."""
        with self.engine.connect() as conn:
            value = conn.execute(
                select(self.jobs.c.attempted_at).where(self.jobs.c.id == job_id)
            ).scalar()
        return utc(value)

    def mark_running(self, job_id: str) -> bool:
        """``queued -> running`` (started now); False when it was not queued."""
        with self.engine.begin() as conn:
            done = conn.execute(
                update(self.jobs)
                .where(self.jobs.c.id == job_id, self.jobs.c.state == JobState.QUEUED.value)
                .values(state=JobState.RUNNING.value, started_at=now())
            )
        return done.rowcount > 0

    def finish(
        self, job_id: str, state: JobState, *, result: Any = None, error: str | None = None
    ) -> Job:
        """End the job in terminal ``state``; :class:`JobFinished` when it had ended."""
        if state not in TERMINAL:
            raise ValueError(f"state: {state.value!r} is not terminal")
        with self.engine.begin() as conn:
            done = conn.execute(
                update(self.jobs)
                .where(self.jobs.c.id == job_id, self.jobs.c.state.in_(OPEN_STATES))
                .values(state=state.value, finished_at=now(), result=finite(result), error=error)
            )
        if done.rowcount == 0:
            job = self.get_job(job_id)  # JobNotFound, else it had ended
            raise JobFinished(job_id, job.state)
        return self.get_job(job_id)


def _encode_cursor(num: int) -> str:
    return base64.urlsafe_b64encode(f"j{num}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if not raw.startswith("j") or not raw[1:].isdigit() or len(raw) > 20:
            raise ValueError(raw)
        return int(raw[1:])
    except (ValueError, UnicodeDecodeError):
        raise BadCursor(cursor) from None
