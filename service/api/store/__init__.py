"""The job store: jobs and their events in a SQL database (SQLAlchemy 2 Core), and the
observations and fits of the calibration from use (:mod:`service.api.calibration`).

SQLite (WAL) is the embedded default; PostgreSQL is supported. :class:`Store` is built in
layers, one module each: :mod:`.database` (the engine and shared helpers),
:mod:`.calibrations` (the ``cal_*`` tables), :mod:`.jobs` (the ``jobs`` and ``events``
tables, the jobs' life) and :mod:`.events` (storing events and applying them to their job).
"""

from pipeplan.service.api.store.calibrations import (
    CalibrationRecord,
    CalibrationStore,
    ObservationRow,
    StoredObservation,
)
from pipeplan.service.api.store.database import Database, finite, make_engine, now
from pipeplan.service.api.store.events import ENDS, Store, check_batch
from pipeplan.service.api.store.jobs import (
    OPEN_STATES,
    BadCursor,
    JobFinished,
    JobNotFound,
    JobStore,
    Page,
    StoreError,
    new_job_id,
)

__all__ = [
    "ENDS",
    "OPEN_STATES",
    "BadCursor",
    "CalibrationRecord",
    "CalibrationStore",
    "Database",
    "JobFinished",
    "JobNotFound",
    "JobStore",
    "ObservationRow",
    "Page",
    "Store",
    "StoreError",
    "StoredObservation",
    "check_batch",
    "finite",
    "make_engine",
    "new_job_id",
    "now",
]
