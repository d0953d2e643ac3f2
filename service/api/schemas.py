"""The documents of the HTTP contract (``../shared/API.md``): jobs, their events, pages.

These are the wire formats shared by the routes, the store, the job entrypoint and the
client. The ``spec`` of a job is the request model of its use-case (``service.tasks``):
:data:`SPEC_MODELS` maps each kind to it.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pipeplan.service.tasks.requests import (
    CompareRequest,
    PlanRequest,
    ProfileRequest,
    RunRequest,
    TrainRequest,
)


class JobKind(StrEnum):
    PROFILE = "profile"
    PLAN = "plan"
    COMPARE = "compare"
    RUN = "run"
    TRAIN = "train"


class JobState(StrEnum):
    """``queued -> running -> succeeded | failed | cancelled``; terminal states never change."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

SPEC_MODELS: dict[JobKind, type[BaseModel]] = {
    JobKind.PROFILE: ProfileRequest,
    JobKind.PLAN: PlanRequest,
    JobKind.COMPARE: CompareRequest,
    JobKind.RUN: RunRequest,
    JobKind.TRAIN: TrainRequest,
}
"""The request model a job's ``spec`` must validate as, per kind."""


class EventType(StrEnum):
    PROGRESS = "progress"
    EVALUATION = "evaluation"
    MEASUREMENT = "measurement"
    CHECKPOINT = "checkpoint"
    """A training job wrote a checkpoint: ``{"step", "path"}``."""
    REPLAN = "replan"
    """A training job changed plans: the reason, the new plan and its prediction."""
    RESULT = "result"
    ERROR = "error"


ENDING_EVENTS = frozenset({EventType.RESULT, EventType.ERROR})
"""Events that end their job (``succeeded`` / ``failed``)."""


class JobCreate(BaseModel):
    """``POST /v1/jobs``: what to run. The spec is validated as the kind's request model
    (and further, as far as it can be without a cluster) before anything is queued."""

    model_config = ConfigDict(extra="forbid")

    kind: JobKind
    spec: dict[str, Any]
    name: str | None = Field(default=None, max_length=200)
    calibration: bool = True
    """Whether the job predicts with its cluster's calibration from use, where there is one
    that applies (:mod:`service.api.calibration`); false: the spec exactly as given."""


class Job(BaseModel):
    """A job as the API returns it."""

    id: str
    kind: JobKind
    state: JobState
    name: str | None
    spec: dict[str, Any]
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    progress: dict[str, Any] | None = None
    result: Any = None
    error: str | None = None
    ray_job_id: str | None = None


class JobPage(BaseModel):
    """``GET /v1/jobs``: newest first; ``next`` is the cursor of the following page."""

    items: list[Job]
    next: str | None = None


class EventIn(BaseModel):
    """``POST /v1/jobs/{id}/events`` (the control endpoint, with the job's token). Idempotent
    on ``seq``: a repeated seq is acknowledged and not stored twice."""

    model_config = ConfigDict(extra="forbid")

    seq: int = Field(ge=0, le=2**62)
    type: EventType
    data: dict[str, Any] = {}


MAX_BATCH = 1000
"""The most events one ``POST /v1/jobs/{id}/events`` may carry."""

EventBatch = Annotated[list[EventIn], Field(min_length=1, max_length=MAX_BATCH)]
"""A batch of events for the control endpoint (a JSON array), stored in one go."""


def _one_or_batch(value: Any) -> str:
    return "batch" if isinstance(value, list) else "one"


EventPost = Annotated[
    Annotated[EventIn, Tag("one")] | Annotated[EventBatch, Tag("batch")],
    Discriminator(_one_or_batch),
]
"""The control endpoint's body: one event or a batch. The JSON's shape picks the model, so
an error names the fields of that shape only."""


class Event(EventIn):
    """A stored event, with when the service received it."""

    received_at: datetime


class EventAck(BaseModel):
    """The answer to a posted event: whether it was new (``stored``) or a repeat."""

    seq: int
    stored: bool


# --- added with the routes (additive) ---------------------------------------------------------


class ErrorBody(BaseModel):
    """Every error the API answers: one line naming the field and the value."""

    detail: str


ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route answers: JSON ``{"detail": ...}``,
    whatever the route's own media type."""
    return {
        code: {
            "description": "An error: one line naming the field and the value",
            "content": {"application/json": {"schema": ERROR_SCHEMA}},
        }
        for code in codes
    }


ERROR_KEY = "message"
"""An ``error`` event's data holds the reason under this key (``{"message": TEXT}``); a
``result`` event's data is the result document itself."""


class PlannerInfo(BaseModel):
    """``GET /v1/planners``: a planner, its options with their defaults, and whether it
    can be loaded here."""

    name: str
    options: dict[str, Any]
    needs_ray: bool = False
    available: bool = True
    reason: str | None = None
    summary: str = ""


class ModelInfo(BaseModel):
    """``GET /v1/models``: a zoo model a spec's ``model`` may name."""

    name: str


class ClusterInfo(BaseModel):
    """``GET /v1/clusters``: a preset a spec's ``cluster`` may name, and its document."""

    name: str
    cluster: dict[str, Any]


class HeldOut(BaseModel):
    """How a calibration fares on observations its fit did not see: the method (``newest
    quarter``, ``leave-one-out`` or ``none``), how many, and the median and largest
    |batch-time error| before (the spec as given) and after (calibrated)."""

    method: str
    plans: int
    median_abs_error_before: float | None = None
    median_abs_error_after: float | None = None
    max_abs_error_before: float | None = None
    max_abs_error_after: float | None = None


class ClusterCalibration(BaseModel):
    """``GET /v1/clusters/{name}/calibration``: the calibration the service fitted from the
    plans its jobs measured on the cluster ``name`` (the spec of hash ``spec_sha256``,
    uncalibrated). ``state``: ``fitted``, ``pending`` (runs arrived, the first fit is on its
    way) or ``failed`` (``error`` says why; a previous fit is kept). ``applied``: whether new
    jobs on the cluster predict with it (``why``)."""

    cluster: str
    spec_sha256: str
    state: str
    observations: int
    last_observed_at: datetime
    runs: int | None = None
    """Observations the fit read (the newest, at most 200)."""
    fitted_at: datetime | None = None
    stale: bool = False
    """Runs arrived since the fit (a new one is on its way)."""
    applied: bool = False
    why: str | None = None
    calibration: dict[str, Any] | None = None
    """The ``calibration:`` block (``../shared/DESIGN.md``'s cluster format)."""
    held_out: HeldOut | None = None
    error: str | None = None


class Health(BaseModel):
    """``GET /healthz`` and ``GET /readyz``: ``status`` and, for readiness, each part."""

    status: str
    database: str | None = None
    backend: str | None = None
