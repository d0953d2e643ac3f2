"""The calibration from use's tables (:mod:`service.api.calibration`): ``cal_clusters`` (a
cluster by name and the hash of its uncalibrated spec, with its current fit),
``cal_observations`` (each measured plan, stored with the event that carried it, once per job
and plan) and ``cal_profiles`` (each profile document once, by its hash)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
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
    UniqueConstraint,
    func,
    select,
    update,
)

from pipeplan.service.api.store.database import Database, finite, insert_ignore, now, utc


def calibration_tables(metadata: MetaData, prefix: str) -> tuple[Table, Table, Table]:
    """The clusters, profiles and observations tables (module docstring)."""
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
        # per stage, the measured ring all-reduce; NULL in rows stored before it was sent
        Column("allreduce_s", JSON, nullable=True),
        # per stage, the measured optimizer update; NULL in rows stored before it was sent
        Column("update_s", JSON, nullable=True),
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
    allreduce_s: tuple[float, ...] = ()
    """Per stage, the measured ring all-reduce (0 without replicas); empty when not sent."""
    update_s: tuple[float, ...] = ()
    """Per stage, the measured optimizer update; empty when not sent."""

    @property
    def key(self) -> tuple[str, str]:
        return self.cluster_name, self.spec_sha256


@dataclass(frozen=True)
class StoredObservation:
    """An observation read back, with its profile's document (and that document's hash, so
    that a fit can read each profile once)."""

    num: int
    plan: dict[str, Any]
    profile: dict[str, Any]
    profile_sha256: str
    batch_time_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    emulated: bool
    job_id: str
    allreduce_s: tuple[float, ...] = ()
    update_s: tuple[float, ...] = ()


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


def _record(row: Row[Any]) -> CalibrationRecord:
    m = row._mapping
    return CalibrationRecord(
        name=m["name"],
        spec_sha256=m["spec_sha256"],
        spec=m["spec"],
        observations=int(m["observations"]),
        last_observed_at=utc(m["last_observed_at"]) or now(),
        last_observation=int(m["last_observation"]),
        fit=m["fit"],
        fitted_through=m["fitted_through"],
        fitted_at=utc(m["fitted_at"]),
        fit_error=m["fit_error"],
    )


class CalibrationStore(Database):
    """Observations, profiles and fits of the clusters the jobs measured plans on. An
    observation is written inside the transaction that stores its event
    (:meth:`observe`); the rest reads and writes on its own."""

    def __init__(self, url: str, prefix: str = "") -> None:
        super().__init__(url, prefix)
        self.cal_clusters, self.cal_profiles, self.cal_observations = calibration_tables(
            self.metadata, prefix
        )

    def observe(
        self, conn: Any, job_id: str, seq: int, o: ObservationRow, received: datetime
    ) -> None:
        """Store one observation (once per job and plan) and count it for its cluster, on
        ``conn`` (the transaction that stores its event)."""
        c = self.cal_clusters
        if o.profile is not None:
            profile = {"sha256": o.profile_sha256, "doc": o.profile}
            insert_ignore(conn, self.cal_profiles, profile)
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
            "allreduce_s": list(o.allreduce_s) if o.allreduce_s else None,
            "update_s": list(o.update_s) if o.update_s else None,
            "received_at": received,
        }
        if not insert_ignore(conn, self.cal_observations, values):
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
        insert_ignore(conn, c, first)
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
        return None if row is None else _record(row)

    def calibrations(self, limit: int = 100) -> list[CalibrationRecord]:
        """Every cluster observed, the one observed last first."""
        c = self.cal_clusters
        query = select(c).order_by(c.c.last_observed_at.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [_record(r) for r in conn.execute(query).all()]

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
                profile_sha256=r.profile_sha256,
                batch_time_s=float(r.batch_time_s),
                forward_s=tuple(float(v) for v in r.forward_s),
                backward_s=tuple(float(v) for v in r.backward_s),
                emulated=bool(r.emulated),
                job_id=r.job_id,
                allreduce_s=tuple(float(v) for v in r.allreduce_s or ()),
                update_s=tuple(float(v) for v in r.update_s or ()),
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
