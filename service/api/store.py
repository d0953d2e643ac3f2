"""The job store: jobs and their events in a SQL database (SQLAlchemy 2 Core).

SQLite (WAL) is the embedded default; PostgreSQL is supported. Two tables: ``jobs`` and
``events`` (primary key ``(job_id, seq)``, so a repeated seq is never stored twice, even
when two copies race); and three for the calibration from use
(:mod:`service.api.calibration`): ``cal_clusters`` (a cluster by name and the hash of its
uncalibrated spec, with its current fit), ``cal_observations`` (each measured plan, stored
with the event that carried it, once per job and plan) and ``cal_profiles`` (each profile
document once, by its hash). Every write transaction begins with its write, so SQLite takes
its lock at once and concurrent writers wait (``busy_timeout``) instead of failing. Terminal
states never change again: every state change is one conditional ``UPDATE``.
"""

from __future__ import annotations

import base64
import math
import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Engine,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    Row,
    String,
    Table,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from service.api.schemas import (
    ERROR_KEY,
    TERMINAL,
    Event,
    EventIn,
    EventType,
    Job,
    JobKind,
    JobState,
)

OPEN_STATES = (JobState.QUEUED.value, JobState.RUNNING.value)
ENDS = frozenset({EventType.RESULT, EventType.ERROR})
"""The events that end a job."""


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


def finite(doc: Any) -> Any:
    """``doc`` with every non-finite float as ``None`` (JSON has no inf or NaN)."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [finite(v) for v in doc]
    return doc


def now() -> datetime:
    return datetime.now(UTC)


def _utc(t: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


def new_job_id() -> str:
    return f"pp-{secrets.token_hex(8)}"


def _tables(metadata: MetaData, prefix: str) -> tuple[Table, Table]:
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
        Column("token_hash", String(64), nullable=False),
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


def _calibration_tables(metadata: MetaData, prefix: str) -> tuple[Table, Table, Table]:
    clusters = Table(
        f"{prefix}cal_clusters",
        metadata,
        Column("name", String(200), primary_key=True),
        Column("spec_sha256", String(64), primary_key=True),
        Column("spec", JSON, nullable=False),
        Column("observations", Integer, nullable=False),
        Column("last_observed_at", DateTime(timezone=True), nullable=False),
        Column("last_observation", BigInteger, nullable=False),
        Column("fit", JSON),
        Column("fitted_through", BigInteger),
        Column("fitted_at", DateTime(timezone=True)),
        Column("fit_error", Text),
    )
    profiles = Table(
        f"{prefix}cal_profiles",
        metadata,
        Column("sha256", String(64), primary_key=True),
        Column("doc", JSON, nullable=False),
    )
    observations = Table(
        f"{prefix}cal_observations",
        metadata,
        Column("num", Integer, primary_key=True, autoincrement=True),
        Column("cluster_name", String(200), nullable=False),
        Column("spec_sha256", String(64), nullable=False),
        Column("job_id", String(64), nullable=False),
        Column("seq", BigInteger, nullable=False),
        Column("plan_sha256", String(64), nullable=False),
        Column("plan", JSON, nullable=False),
        Column("profile_sha256", String(64), ForeignKey(profiles.c.sha256), nullable=False),
        Column("batch_time_s", Float, nullable=False),
        Column("forward_s", JSON, nullable=False),
        Column("backward_s", JSON, nullable=False),
        Column("emulated", Boolean, nullable=False),
        Column("received_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint("job_id", "plan_sha256"),
    )
    return clusters, profiles, observations


@dataclass(frozen=True)
class ObservationRow:
    """One measured plan for a cluster's calibration, as an event carried it and the
    service checked it (:func:`service.api.calibration.parse_observations`)."""

    cluster_name: str
    spec_sha256: str
    spec: dict[str, Any]
    """The uncalibrated spec's document."""
    profile_sha256: str
    profile: dict[str, Any] | None
    """The profile's document; None when an earlier observation stored it."""
    plan_sha256: str
    plan: dict[str, Any]
    batch_time_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    emulated: bool

    @property
    def key(self) -> tuple[str, str]:
        return self.cluster_name, self.spec_sha256


@dataclass(frozen=True)
class StoredObservation:
    """An observation read back, with its profile's document."""

    num: int
    plan: dict[str, Any]
    profile: dict[str, Any]
    batch_time_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    emulated: bool
    job_id: str


@dataclass(frozen=True)
class CalibrationRecord:
    """A cluster (name, uncalibrated spec) the service has observations of, and its fit."""

    name: str
    spec_sha256: str
    spec: dict[str, Any]
    observations: int
    last_observed_at: datetime
    last_observation: int
    fit: dict[str, Any] | None
    fitted_through: int | None
    fitted_at: datetime | None
    fit_error: str | None

    @property
    def stale(self) -> bool:
        """Observations arrived since the last fit (or there is none)."""
        return self.fitted_through is None or self.fitted_through < self.last_observation


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite: WAL, a busy timeout, foreign keys, its folder made."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if (
        parsed.database
        and parsed.database != ":memory:"
        and not parsed.database.startswith("file:")
    ):
        _make_parent(parsed.database)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _make_parent(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)


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


@dataclass(frozen=True)
class Page:
    jobs: list[Job]
    next: str | None


class Store:
    """Jobs and events in the database at ``url`` (tables named ``{prefix}jobs`` and
    ``{prefix}events``; tests use a prefix of their own)."""

    def __init__(self, url: str, prefix: str = "") -> None:
        self.engine = make_engine(url)
        self.metadata = MetaData()
        self.jobs, self.events = _tables(self.metadata, prefix)
        self.cal_clusters, self.cal_profiles, self.cal_observations = _calibration_tables(
            self.metadata, prefix
        )

    def create_tables(self) -> None:
        self.metadata.create_all(self.engine)

    def drop_tables(self) -> None:
        self.metadata.drop_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> str | None:
        """None when the database answers, else why not."""
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as e:  # any driver error means "not ready"
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None

    # --- jobs ---------------------------------------------------------------------------------

    def _job(self, row: Row[Any]) -> Job:
        m = row._mapping
        return Job(
            id=m["id"],
            kind=JobKind(m["kind"]),
            state=JobState(m["state"]),
            name=m["name"],
            spec=m["spec"],
            created_at=_utc(m["created_at"]) or now(),
            started_at=_utc(m["started_at"]),
            finished_at=_utc(m["finished_at"]),
            progress=m["progress"],
            result=m["result"],
            error=m["error"],
            ray_job_id=m["ray_job_id"],
        )

    def create_job(
        self, kind: JobKind, spec: dict[str, Any], name: str | None, token_hash: str
    ) -> Job:
        """A new ``queued`` job."""
        job_id = new_job_id()
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

    def list_jobs(
        self,
        state: JobState | None = None,
        kind: JobKind | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> Page:
        """Newest first; ``cursor`` (opaque) continues after the last job of a page."""
        query = select(self.jobs).order_by(self.jobs.c.num.desc()).limit(limit + 1)
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

    def counts(self) -> Counter[tuple[str, str]]:
        """How many jobs of each (state, kind)."""
        j = self.jobs
        query = select(j.c.state, j.c.kind, func.count()).group_by(j.c.state, j.c.kind)
        with self.engine.connect() as conn:
            return Counter({(s, k): int(n) for s, k, n in conn.execute(query).all()})

    def set_ray_job_id(self, job_id: str, ray_job_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(self.jobs).where(self.jobs.c.id == job_id).values(ray_job_id=ray_job_id)
            )

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

    # --- events -------------------------------------------------------------------------------

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
        ``failed``. :class:`JobFinished` when there is a new event for a terminal job
        (nothing stored). The first statement is a write, so that on SQLite the transaction
        holds the write lock before it reads the job's state (no stale read, no busy
        upgrade); on PostgreSQL it locks the job's row."""
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
                state = conn.execute(select(j.c.state).where(j.c.id == job_id)).scalar()
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
                        self._observe(conn, job_id, p.seq, observations[p.seq], received)
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

    # --- calibration from use ------------------------------------------------------------------

    def _insert_ignore(self, conn: Any, table: Table, values: dict[str, Any]) -> int:
        """Insert a row unless one with its key (or a unique column) exists; rows inserted."""
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        done = conn.execute(dialect.insert(table).values(**values).on_conflict_do_nothing())
        return int(done.rowcount or 0)

    def _observe(
        self, conn: Any, job_id: str, seq: int, o: ObservationRow, received: datetime
    ) -> None:
        """Store one observation (once per job and plan) and count it for its cluster."""
        c = self.cal_clusters
        if o.profile is not None:
            profile = {"sha256": o.profile_sha256, "doc": o.profile}
            self._insert_ignore(conn, self.cal_profiles, profile)
        values = {
            "cluster_name": o.cluster_name,
            "spec_sha256": o.spec_sha256,
            "job_id": job_id,
            "seq": seq,
            "plan_sha256": o.plan_sha256,
            "plan": o.plan,
            "profile_sha256": o.profile_sha256,
            "batch_time_s": o.batch_time_s,
            "forward_s": list(o.forward_s),
            "backward_s": list(o.backward_s),
            "emulated": o.emulated,
            "received_at": received,
        }
        if not self._insert_ignore(conn, self.cal_observations, values):
            return  # this job sent this plan before
        num = conn.execute(
            select(func.max(self.cal_observations.c.num)).where(
                self.cal_observations.c.job_id == job_id,
                self.cal_observations.c.plan_sha256 == o.plan_sha256,
            )
        ).scalar()
        first = {
            "name": o.cluster_name,
            "spec_sha256": o.spec_sha256,
            "spec": o.spec,
            "observations": 0,
            "last_observed_at": received,
            "last_observation": num,
        }
        self._insert_ignore(conn, c, first)
        conn.execute(
            update(c)
            .where(c.c.name == o.cluster_name, c.c.spec_sha256 == o.spec_sha256)
            .values(
                observations=c.c.observations + 1, last_observed_at=received, last_observation=num
            )
        )

    def profile_doc(self, sha256: str) -> dict[str, Any] | None:
        """The profile document of that hash an observation stored (None: none did)."""
        p = self.cal_profiles
        with self.engine.connect() as conn:
            doc = conn.execute(select(p.c.doc).where(p.c.sha256 == sha256)).scalar()
        return None if doc is None else dict(doc)

    def _record(self, row: Row[Any]) -> CalibrationRecord:
        m = row._mapping
        return CalibrationRecord(
            name=m["name"],
            spec_sha256=m["spec_sha256"],
            spec=m["spec"],
            observations=int(m["observations"]),
            last_observed_at=_utc(m["last_observed_at"]) or now(),
            last_observation=int(m["last_observation"]),
            fit=m["fit"],
            fitted_through=m["fitted_through"],
            fitted_at=_utc(m["fitted_at"]),
            fit_error=m["fit_error"],
        )

    def calibration(self, name: str, spec_sha256: str | None = None) -> CalibrationRecord | None:
        """The cluster ``name``'s record for the spec of that hash (None: the one observed
        last); None when there is none."""
        c = self.cal_clusters
        query = select(c).where(c.c.name == name)
        if spec_sha256 is not None:
            query = query.where(c.c.spec_sha256 == spec_sha256)
        query = query.order_by(c.c.last_observed_at.desc()).limit(1)
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else self._record(row)

    def calibrations(self, limit: int = 100) -> list[CalibrationRecord]:
        """Every cluster observed, the one observed last first."""
        c = self.cal_clusters
        query = select(c).order_by(c.c.last_observed_at.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [self._record(r) for r in conn.execute(query).all()]

    def observations(self, name: str, spec_sha256: str, limit: int) -> list[StoredObservation]:
        """The cluster's newest ``limit`` observations, oldest first, with their profiles."""
        o, p = self.cal_observations, self.cal_profiles
        query = (
            select(o, p.c.doc)
            .join(p, p.c.sha256 == o.c.profile_sha256)
            .where(o.c.cluster_name == name, o.c.spec_sha256 == spec_sha256)
            .order_by(o.c.num.desc())
            .limit(limit)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            StoredObservation(
                num=int(r.num),
                plan=r.plan,
                profile=r.doc,
                batch_time_s=float(r.batch_time_s),
                forward_s=tuple(float(v) for v in r.forward_s),
                backward_s=tuple(float(v) for v in r.backward_s),
                emulated=bool(r.emulated),
                job_id=r.job_id,
            )
            for r in reversed(rows)
        ]

    def save_fit(
        self,
        name: str,
        spec_sha256: str,
        fit: dict[str, Any] | None,
        through: int,
        error: str | None = None,
    ) -> None:
        """The cluster's fit over its observations up to number ``through`` (or why there
        is none: ``error``, the previous fit kept)."""
        c = self.cal_clusters
        values: dict[str, Any] = {"fitted_through": through, "fitted_at": now(), "fit_error": error}
        if fit is not None:
            values["fit"] = finite(fit)
        with self.engine.begin() as conn:
            conn.execute(
                update(c).where(c.c.name == name, c.c.spec_sha256 == spec_sha256).values(**values)
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
                received_at=_utc(r.received_at) or now(),
            )
            for r in rows
        ]


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
