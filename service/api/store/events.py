"""Events: :class:`Store`, the service's store, is :class:`JobStore` with the methods that
store a job's events and apply them to it (its state, progress and result), the observations
they carry stored in the same transaction.

Every write transaction begins with its write, so SQLite takes its lock at once and
concurrent writers wait (``busy_timeout``) instead of failing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError

from pipeplan.service.api.schemas import ERROR_KEY, TERMINAL, Event, EventIn, EventType, JobState
from pipeplan.service.api.store.calibrations import ObservationRow
from pipeplan.service.api.store.database import finite, now, utc
from pipeplan.service.api.store.jobs import JobFinished, JobNotFound, JobStore

ENDS = frozenset({EventType.RESULT, EventType.ERROR})
"""The events that end a job."""


def check_batch(posted: Sequence[EventIn]) -> None:
    """A batch of events is one job's, each seq once, and a ``result`` or ``error`` (which
    ends the job) has the highest seq of its batch; else ``ValueError`` naming the seq."""
    if not posted:
        raise ValueError("events: an empty batch")
    seen: set[int] = set()
    for i, p in enumerate(posted):
        if p.seq in seen:
            raise ValueError(f"events[{i}].seq: {p.seq} appears twice in the batch")
        seen.add(p.seq)
    top = max(seen)
    for i, p in enumerate(posted):
        if p.type in ENDS and p.seq != top:
            raise ValueError(
                f"events[{i}].type: {p.type.value!r} at seq {p.seq} ends the job, but the "
                f"batch goes on to seq {top}"
            )


class Store(JobStore):
    """Jobs, their events and the clusters' calibrations in the database at ``url``
    (module docstring; tables named ``{prefix}...``, tests use a prefix of their own)."""

    def add_event(self, job_id: str, posted: EventIn) -> bool:
        """Store one event (:meth:`add_events`); False when its seq was stored before."""
        return self.add_events(job_id, [posted])[0]

    def add_events(
        self,
        job_id: str,
        posted: Sequence[EventIn],
        observations: Mapping[int, ObservationRow] | None = None,
    ) -> list[bool]:
        """Store the events that are new and apply them to their job, in one transaction;
        for each event, whether it was new (False: its seq was stored before, nothing done).
        ``observations`` (by seq) are stored with their new events, in the same transaction.

        A first event makes a queued job ``running``; ``progress`` updates the job's progress
        (the highest seq wins), ``result`` ends it ``succeeded``, ``error`` ends it
        ``failed``; ``waiting`` naming devices (the batch's last) puts it back to ``queued``
        with the event's data as ``waiting_for``, which any later event clears (a
        ``waiting`` with no devices says the wait is over). :class:`JobFinished` when there
        is a new event for a terminal job (nothing stored). The first statement is a write,
        so that on SQLite the transaction holds the write lock before it reads the job's
        state (no stale read, no busy upgrade); on PostgreSQL the state is read ``FOR
        UPDATE``, so two batches of one job take its row in turn before either stores an
        event (overlapping batches would otherwise each wait for the other's seqs)."""
        check_batch(posted)
        seqs = [p.seq for p in posted]
        j, e = self.jobs, self.events
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    update(j)
                    .where(j.c.id == job_id, j.c.state == JobState.QUEUED.value)
                    .values(state=JobState.RUNNING.value, started_at=now())
                )
                state = conn.execute(
                    select(j.c.state).where(j.c.id == job_id).with_for_update()
                ).scalar()
                if state is None:
                    raise JobNotFound(job_id)
                old = set(
                    conn.execute(
                        select(e.c.seq).where(e.c.job_id == job_id, e.c.seq.in_(seqs))
                    ).scalars()
                )
                new = sorted((p for p in posted if p.seq not in old), key=lambda p: p.seq)
                if not new:
                    conn.rollback()  # a repeat changes nothing (not even queued -> running)
                    return [False] * len(posted)
                if JobState(state) in TERMINAL:
                    raise JobFinished(job_id, JobState(state))
                received = now()
                rows = [
                    {
                        "job_id": job_id,
                        "seq": p.seq,
                        "type": p.type.value,
                        "data": finite(p.data),
                        "received_at": received,
                    }
                    for p in new
                ]
                conn.execute(insert(e), rows)
                self._apply(conn, job_id, new, rows)
                for p in new:
                    if observations and p.seq in observations:
                        self.observe(conn, job_id, p.seq, observations[p.seq], received)
        except IntegrityError:  # a concurrent post stored one of these seqs meanwhile
            if len(posted) > 1:
                return [self.add_event(job_id, p) for p in posted]
            if self._has_event(job_id, posted[0].seq):
                return [False]
            raise JobNotFound(job_id) from None
        return [p.seq not in old for p in posted]

    def _apply(
        self, conn: Any, job_id: str, new: list[EventIn], rows: list[dict[str, Any]]
    ) -> None:
        """The job's progress from the last new ``progress``; its end from a new ``result``
        or ``error`` (:func:`check_batch`: the last of the batch, if any)."""
        j = self.jobs
        progress = [
            (p.seq, r["data"])
            for p, r in zip(new, rows, strict=True)
            if p.type is EventType.PROGRESS
        ]
        if progress:
            seq, data = progress[-1]
            conn.execute(
                update(j)
                .where(j.c.id == job_id, (j.c.progress_seq.is_(None)) | (j.c.progress_seq < seq))
                .values(progress=data, progress_seq=seq)
            )
        last, data = new[-1], rows[-1]["data"]
        if last.type is EventType.WAITING and isinstance(data, dict) and data.get("devices"):
            conn.execute(
                update(j)
                .where(j.c.id == job_id)
                .values(state=JobState.QUEUED.value, started_at=None, waiting_for=data)
            )
        else:
            conn.execute(update(j).where(j.c.id == job_id).values(waiting_for=None))
        if last.type is EventType.RESULT:
            conn.execute(
                update(j)
                .where(j.c.id == job_id)
                .values(state=JobState.SUCCEEDED.value, finished_at=now(), result=data)
            )
        elif last.type is EventType.ERROR:
            message = data.get(ERROR_KEY) if isinstance(data, dict) else None
            conn.execute(
                update(j)
                .where(j.c.id == job_id)
                .values(state=JobState.FAILED.value, finished_at=now(), error=str(message or data))
            )

    def _has_event(self, job_id: str, seq: int) -> bool:
        e = self.events
        with self.engine.connect() as conn:
            found = conn.execute(select(e.c.seq).where(e.c.job_id == job_id, e.c.seq == seq))
            return found.first() is not None

    def has_result(self, job_id: str) -> bool:
        e = self.events
        query = select(e.c.seq).where(e.c.job_id == job_id, e.c.type == EventType.RESULT.value)
        with self.engine.connect() as conn:
            return conn.execute(query.limit(1)).first() is not None

    def events_after(self, job_id: str, after: int = -1, limit: int | None = None) -> list[Event]:
        """The job's events with seq > ``after``, oldest first."""
        e = self.events
        query = select(e).where(e.c.job_id == job_id, e.c.seq > after).order_by(e.c.seq)
        if limit is not None:
            query = query.limit(limit)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            Event(
                seq=r.seq,
                type=EventType(r.type),
                data=r.data,
                received_at=utc(r.received_at) or now(),
            )
            for r in rows
        ]
