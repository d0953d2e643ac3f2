"""The store's database: the engine (SQLite's pragmas), the helpers every table shares (UTC
times, JSON without inf/NaN, insert-or-ignore on either dialect), and :class:`Database`, the
base the job and calibration stores build their tables on."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, MetaData, Table, create_engine, event, inspect, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url


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


def utc(t: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return t.replace(tzinfo=UTC) if t is not None and t.tzinfo is None else t


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
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def insert_ignore(conn: Any, table: Table, values: dict[str, Any]) -> int:
    """Insert a row unless one with its key (or a unique column) exists; rows inserted."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    done = conn.execute(dialect.insert(table).values(**values).on_conflict_do_nothing())
    return int(done.rowcount or 0)


class Database:
    """The engine for ``url`` and the metadata the stores define their tables in, each
    named ``{prefix}...`` (tests use a prefix of their own)."""

    def __init__(self, url: str, prefix: str = "") -> None:
        self.engine = make_engine(url)
        self.metadata = MetaData()
        self.prefix = prefix

    def create_tables(self) -> None:
        """Create the tables that are missing, and add to an existing table the nullable
        columns a later version defined (the one kind of schema change the stores make: a
        database written before keeps its rows, which read the new column as NULL)."""
        self.metadata.create_all(self.engine)
        found = inspect(self.engine)
        for table in self.metadata.sorted_tables:
            have = {c["name"] for c in found.get_columns(table.name)}
            for column in table.columns:
                if column.name not in have and column.nullable:
                    kind = column.type.compile(dialect=self.engine.dialect)
                    with self.engine.begin() as conn:
                        conn.execute(
                            text(f'ALTER TABLE "{table.name}" ADD COLUMN "{column.name}" {kind}')
                        )

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
