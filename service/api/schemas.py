"""The documents of the HTTP contract (``../shared/API.md``): jobs, their events, pages.

These are the wire formats shared by the routes, the store, the job entrypoint and the
client. The ``spec`` of a job is the request model of its use-case (``service.tasks``):
:data:`SPEC_MODELS` maps each kind to it. ``POST /v1/jobs`` takes :data:`JobRequest`, a
union on ``kind`` whose spec models are those request models with the bounds of
:data:`FIELD_BOUNDS` stated in the OpenAPI document; :mod:`service.api.validation` enforces
the same table, so the document and the service agree on every field.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic.json_schema import models_json_schema

from pipeplan.agents.registry import PLANNERS
from pipeplan.core.limits import MAX_GLOBAL_BATCH, MAX_MICROBATCHES
from pipeplan.models import zoo_names
from pipeplan.service.tasks.requests import (
    BudgetRequest,
    CompareRequest,
    PlanRequest,
    ProfileRequest,
    RunRequest,
    TrainRequest,
    presets,
)


class JobKind(StrEnum):
    PROFILE = "profile"
    PLAN = "plan"
    COMPARE = "compare"
    RUN = "run"
    TRAIN = "train"


JOB_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
"""A job id (``/v1/jobs/{job_id}``): the routes and the auth dependencies that read one
from the path declare this pattern, so the document states it."""


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
    ATTEMPT = "attempt"
    """The service handed the job to the backend again after its work was lost (its Ray
    Job's driver or node died): ``{"attempt", "attempts", "submission_id", "reason",
    "resumes_from"}`` (the checkpoint the new attempt goes on from, or null: from the
    start). Posted by the service, never by the job."""
    WAITING = "waiting"
    """The job waits for devices others hold: ``{"devices", "held_by"}``. It stays (or
    goes back to) ``queued`` with this as its ``waiting_for`` until its next event; one
    with no devices (``{"devices": [], "waited_s"}``) says the wait is over."""
    RESULT = "result"
    ERROR = "error"


ENDING_EVENTS = frozenset({EventType.RESULT, EventType.ERROR})
"""Events that end their job (``succeeded`` / ``failed``)."""


NAME_PATTERN = r"^[^\x00]*$"
"""A job's ``name``: any text without a NUL character (the databases refuse one)."""


MAX_PRIORITY = 1000
"""A job's ``priority`` is in [-MAX_PRIORITY, MAX_PRIORITY]."""
MAX_DEADLINE_S = 30 * 24 * 3600.0
"""The longest ``deadline_s``: thirty days."""
MAX_RETRIES = 10
"""The most times a plan or compare job is handed to the backend again after its work was
lost (``retries``)."""


class JobCreate(BaseModel):
    """A job to create, as the service handles it: the kind, and the spec as a JSON object
    (validated as the kind's request model, and further, as far as it can be without a
    cluster, before anything is queued). ``POST /v1/jobs`` takes a :data:`JobRequest`, and
    :func:`job_create` makes this of it."""

    model_config = ConfigDict(extra="forbid")

    kind: JobKind
    spec: dict[str, Any]
    name: str | None = Field(default=None, max_length=200)
    calibration: bool = True
    """Whether the job predicts with its cluster's calibration from use, where there is one
    that applies (:mod:`service.api.calibration`); false: the spec exactly as given."""
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    retries: int = Field(default=0, ge=0, le=MAX_RETRIES)
    """How many times the job is handed to the backend again when its work is lost (only
    ``plan`` and ``compare`` jobs take it: :class:`RetriesField`)."""


# --- the body of POST /v1/jobs: one model per kind --------------------------------------------

MAX_INPUT_SIZE = 2048
"""A zoo model's input size (its example input is built and traced when profiled)."""
MAX_SEED = 2**53 - 1
"""The largest seed, as the largest integer every JSON reader holds exactly (the
document's bounds are JSON numbers)."""
MAX_TRAIN_STEPS = 10_000_000
"""Steps one job may ask for (``steps``, ``warmup`` and ``checkpoint_every``)."""
MAX_EPOCHS = 100_000
MAX_REPEATS = 1000
"""Timed steps per plan of a measured search."""
MAX_WORKERS = 1024
"""Ray tasks a parallel search splits its evaluations over."""


@dataclass(frozen=True)
class Bound:
    """A number field's range: at least ``low`` (above it where ``open_low``), at most
    ``high``; ``None``: no bound on that side."""

    low: int | None = None
    high: int | None = None
    open_low: bool = False

    def json_schema(self) -> dict[str, Any]:
        """The range as JSON Schema keywords."""
        schema: dict[str, Any] = {}
        if self.low is not None:
            schema["exclusiveMinimum" if self.open_low else "minimum"] = self.low
        if self.high is not None:
            schema["maximum"] = self.high
        return schema


FIELD_BOUNDS: dict[str, Bound] = {
    "batch": Bound(1, MAX_GLOBAL_BATCH),
    "microbatches": Bound(1, MAX_MICROBATCHES),
    "input_size": Bound(1, MAX_INPUT_SIZE),
    "seed": Bound(0, MAX_SEED),
    "min_throughput": Bound(0),
    "steps": Bound(1, MAX_TRAIN_STEPS),
    "warmup": Bound(0, MAX_TRAIN_STEPS),
    "epochs": Bound(1, MAX_EPOCHS),
    "checkpoint_every": Bound(0, MAX_TRAIN_STEPS),
    "repeats": Bound(1, MAX_REPEATS),
    "workers": Bound(1, MAX_WORKERS),
    "timeout_s": Bound(0, open_low=True),
    "lr": Bound(0, open_low=True),
    "momentum": Bound(0),
    "weight_decay": Bound(0),
    "evaluations": Bound(1),
    "seconds": Bound(0, open_low=True),
    "retries": Bound(0, MAX_RETRIES),
    "replan_threshold": Bound(0, 1),
}
"""The range of every number field of a job's spec (and of its ``budget``), by field name:
stated in the OpenAPI document and enforced by :func:`service.api.validation.check_limits`
before anything else reads the request. ``retries`` is a field of the job beside its spec
(:class:`RetriesField`): its range is this table's too."""

NAMED_CHOICES: dict[str, tuple[str, ...]] = {
    "planner": tuple(PLANNERS),
    "planners": tuple(PLANNERS),
    "cluster": tuple(presets()),
}
"""String fields whose values are names from a fixed set: a planner, or a cluster preset
(a ``cluster`` may be a document instead)."""


MODEL_PATTERNS = (r"^hf:[A-Za-z_]\w*$", r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""A ``model`` beside a zoo name: ``hf:ClassName``, or ``package.module:factory`` (which
only a service with ``PIPEPLAN_ALLOW_CODE`` takes)."""


def model_forms() -> list[dict[str, Any]]:
    """The forms of a ``model``: a zoo name (:mod:`models.zoo_names`: no torch) or
    :data:`MODEL_PATTERNS`."""
    return [{"enum": list(zoo_names.MODELS)}, *({"pattern": p} for p in MODEL_PATTERNS)]


def _with_model_forms(prop: dict[str, Any]) -> None:
    """:func:`model_forms` as the forms of ``prop``'s string (itself, or a branch)."""
    for branch in [prop, *prop.get("anyOf", [])]:
        if branch.get("type") == "string":
            branch["anyOf"] = model_forms()


def _with_choices(prop: dict[str, Any], choices: tuple[str, ...]) -> None:
    """``choices`` as the enum of ``prop``'s string form (itself, a branch, or its items)."""
    if prop.get("type") == "string":
        prop["enum"] = list(choices)
    for branch in prop.get("anyOf", []):
        _with_choices(branch, choices)
    if isinstance(prop.get("items"), dict):
        _with_choices(prop["items"], choices)


def _state_fields(schema: dict[str, Any]) -> None:
    """State each property's bound (:data:`FIELD_BOUNDS`) and named choices
    (:data:`NAMED_CHOICES`) in a spec model's JSON schema."""
    for name, prop in schema.get("properties", {}).items():
        if name in FIELD_BOUNDS:
            prop.update(FIELD_BOUNDS[name].json_schema())
        if name in NAMED_CHOICES:
            _with_choices(prop, NAMED_CHOICES[name])
        if name == "model":
            _with_model_forms(prop)


SPEC_CONFIG = ConfigDict(json_schema_extra=_state_fields)
"""A spec model's config: its request model's, with the ranges and names stated."""


class BudgetSpec(BudgetRequest):
    """Most plan evaluations and search seconds; absent: the use-case's default."""

    model_config = SPEC_CONFIG


class ProfileSpec(ProfileRequest):
    """A model to profile: ``model`` (a zoo name), where its layer times come from (the
    cost model, or ``measure`` on the cluster)."""

    model_config = SPEC_CONFIG


class PlanSpec(PlanRequest):
    """A planning problem (``model`` or ``profile``, ``cluster``, ``objective``, ``batch``)
    and the ``planner`` to search it with."""

    model_config = SPEC_CONFIG
    budget: BudgetSpec = BudgetSpec()


class CompareSpec(CompareRequest):
    """A planning problem and the ``planners`` to run on it (default: the baselines)."""

    model_config = SPEC_CONFIG
    budget: BudgetSpec = BudgetSpec()


class RunSpec(RunRequest):
    """A ``plan`` document to run on the cluster, with the model it places."""

    model_config = SPEC_CONFIG


class TrainSpec(TrainRequest):
    """What to train, on which ``plan`` (or ``planner``), for how long."""

    model_config = SPEC_CONFIG
    budget: BudgetSpec = BudgetSpec()


class JobRequestBase(BaseModel):
    """What every kind's request has beside its ``kind`` and ``spec``."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=200, pattern=NAME_PATTERN)
    calibration: bool = True
    """Whether the job predicts with its cluster's calibration from use, where there is one
    that applies; false: the spec exactly as given."""
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """Where a job that needs devices goes in the queue: higher first, then the older."""
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    """Fail the job (``deadline: ...``) if it has not started this many seconds after it
    was submitted; none: it waits as long as it takes."""


class RetriesField(BaseModel):
    """The ``retries`` of the kinds whose work is a search (``plan``, ``compare``)."""

    retries: int = Field(
        default=0,
        ge=FIELD_BOUNDS["retries"].low,
        le=FIELD_BOUNDS["retries"].high,
        description="How many times the service hands the job to Ray again when its Ray "
        "Job dies (a lost driver or node, not a cancel and not the job's own error); a "
        "search goes on from its last checkpoint",
    )


class ProfileJob(JobRequestBase):
    """``kind: profile``: the result is the profile document."""

    kind: Literal[JobKind.PROFILE]
    spec: ProfileSpec


class PlanJob(JobRequestBase, RetriesField):
    """``kind: plan``: the result is ``{"plan", "estimate", ...}``, as ``pipeplan plan
    --json`` prints it."""

    kind: Literal[JobKind.PLAN]
    spec: PlanSpec


class CompareJob(JobRequestBase, RetriesField):
    """``kind: compare``: the result is the rows ``pipeplan compare --json`` prints."""

    kind: Literal[JobKind.COMPARE]
    spec: CompareSpec


class RunJob(JobRequestBase):
    """``kind: run``: the result is the run, measured and predicted."""

    kind: Literal[JobKind.RUN]
    spec: RunSpec


class TrainJob(JobRequestBase):
    """``kind: train``: the result is the last checkpoint, the loss curve and the measured
    and predicted step times."""

    kind: Literal[JobKind.TRAIN]
    spec: TrainSpec


AnyJobRequest = ProfileJob | PlanJob | CompareJob | RunJob | TrainJob
JobRequest = Annotated[AnyJobRequest, Field(discriminator="kind")]
"""``POST /v1/jobs``: ``{"kind", "spec", "name"?, "calibration"?}``, the spec's fields those
of its kind. A spec the schema admits can still be refused (422) by the checks a schema
cannot state: a document's own consistency, fields that go together, a planner's options."""

REQUEST_SPECS: dict[JobKind, type[BaseModel]] = {
    JobKind.PROFILE: ProfileSpec,
    JobKind.PLAN: PlanSpec,
    JobKind.COMPARE: CompareSpec,
    JobKind.RUN: RunSpec,
    JobKind.TRAIN: TrainSpec,
}
"""Each kind's spec model in :data:`JobRequest` (a subclass of its :data:`SPEC_MODELS`)."""


def job_create(request: AnyJobRequest) -> JobCreate:
    """The job a request asks for, its spec the fields the request set (defaults stay
    implicit, so the stored spec reads as it was sent)."""
    return JobCreate(
        kind=request.kind,
        spec=request.spec.model_dump(mode="json", exclude_unset=True),
        name=request.name,
        calibration=request.calibration,
        priority=request.priority,
        deadline_s=request.deadline_s,
        retries=request.retries if isinstance(request, RetriesField) else 0,
    )


# --- results: what each kind's job ends with -------------------------------------------------


class ResultDoc(BaseModel):
    """A result document: the fields every client may rely on are stated; the rest of the
    document (nested plan, estimate and measurement documents: DESIGN's formats) is kept."""

    model_config = ConfigDict(extra="allow")


class ProfileJobResult(ResultDoc):
    """``profile``: the profile document."""

    name: str
    input_shape: list[int]
    layers: list[dict[str, Any]]


class PlanJobResult(ResultDoc):
    """``plan``: what ``pipeplan plan --json`` prints."""

    plan: dict[str, Any]
    estimate: dict[str, Any]
    planner: str
    evaluations: int
    wall_time_s: float
    rental: dict[str, Any] | None = None
    """``objective: cost``: the devices to rent and what they cost."""
    reward: str | None = None
    measured: dict[str, Any] | None = None
    """A measured search: the best plan's run on the cluster."""


class CompareJobResult(ResultDoc):
    """``compare``: the rows ``pipeplan compare --json`` prints."""

    problem: str
    objective: str
    exact_reference: str | None
    best: str | None
    results: list[dict[str, Any]]


class RunJobResult(ResultDoc):
    """``run``: the run, measured beside predicted, and their relative errors."""

    model: str
    cluster: str
    emulated: bool
    plan: dict[str, Any]
    predicted: dict[str, Any]
    measured: dict[str, Any]
    error: dict[str, Any]


class TrainJobResult(ResultDoc):
    """``train``: the plan trained on, each step, the last checkpoint, the loss curve and the
    step time measured beside predicted."""

    plan: dict[str, Any]
    first_step: int
    steps: list[dict[str, Any]]
    checkpoint: str | None
    resumed_from: str | None
    loss_curve: list[float | None]
    measured_step_s: float | None
    predicted_step_s: float | None
    replans: list[dict[str, Any]] = []
    """Elastic training's re-plans, as their ``replan`` events carry them."""


def result_schemas() -> dict[str, Any]:
    """The JSON schemas of :data:`RESULTS` (and what they refer to), by name, for the
    document's components (``Job.result`` refers to them)."""
    _, defs = models_json_schema(
        [(m, "validation") for m in RESULTS.values()], ref_template=REF_TEMPLATE
    )
    found: dict[str, Any] = defs.get("$defs", {})
    return found


REF_TEMPLATE = "#/components/schemas/{model}"

RESULTS: dict[JobKind, type[ResultDoc]] = {
    JobKind.PROFILE: ProfileJobResult,
    JobKind.PLAN: PlanJobResult,
    JobKind.COMPARE: CompareJobResult,
    JobKind.RUN: RunJobResult,
    JobKind.TRAIN: TrainJobResult,
}
"""Each kind's result document as the API states it (the document's ``Job.result`` is one of
them, by the job's ``kind``; a test checks each use-case's result reads as its model)."""


def _result_schema(schema: dict[str, Any]) -> None:
    """``Job.result`` in the document: null, or the result of the job's ``kind``."""
    schema["properties"]["result"] = {
        "anyOf": [
            *({"$ref": f"#/components/schemas/{m.__name__}"} for m in RESULTS.values()),
            {"type": "null"},
        ],
        "description": "null until the job succeeds; then the result of its kind "
        "(profile: ProfileJobResult, plan: PlanJobResult, compare: CompareJobResult, "
        "run: RunJobResult, train: TrainJobResult)",
    }


class Job(BaseModel):
    """A job as the API returns it (its ``result``: the document of its kind,
    :data:`RESULTS`)."""

    model_config = ConfigDict(json_schema_extra=_result_schema)

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
    created_by: str | None = None
    """The id of the token that submitted it (``bootstrap``: the service's own token)."""
    waiting_for: dict[str, Any] | None = None
    """While it waits: for devices, ``{"devices": [...], "held_by": [job ids]}``; for its
    turn, ``{"behind": [job ids]}`` (the queued jobs that start before it)."""
    priority: int = 0
    deadline_s: float | None = None
    retries: int = 0
    """How many times the job may be handed to the backend again after its work was lost."""
    attempt: int = 1
    """Which hand-over this is: 1, then one more for every retry (an ``attempt`` event
    records each)."""


class JobPage(BaseModel):
    """``GET /v1/jobs``: newest first; ``next`` is the cursor of the following page."""

    items: list[Job]
    next: str | None = None


SEQ_MAX = 2**53 - 1
"""The largest seq: the largest integer every JSON reader holds exactly (JavaScript's
``Number.MAX_SAFE_INTEGER``), so a schema's bound means the same to every client."""


class EventData(BaseModel):
    """The known fields of an event's ``data``; every one may be absent or null, and fields
    beside them are kept (a job may report more)."""

    model_config = ConfigDict(extra="allow")


class ProgressData(EventData):
    """A search's progress (``evaluations``, ``best_value``, ``elapsed_s``), or a training
    step's (``step``, ``loss``, ``samples_per_s``, ...)."""

    evaluations: int | None = None
    best_value: float | None = None
    elapsed_s: float | None = None
    search: str | None = None
    step: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    batch_time_s: float | None = None
    accuracy: float | None = None


class EvaluationData(EventData):
    """A plan the search evaluated, its value and where the value came from."""

    plan: dict[str, Any] | None = None
    value: float | None = None
    batch_time_s: float | None = None
    predicted_batch_time_s: float | None = None
    source: str | None = None
    search: str | None = None
    observation: dict[str, Any] | None = None


class CheckpointData(EventData):
    """A checkpoint written after ``step``, at ``path``."""

    step: int | None = None
    path: str | None = None


class WaitingData(EventData):
    """The devices a job waits for and the jobs that hold them (empty: it has them now,
    after ``waited_s``)."""

    devices: list[str] | None = None
    held_by: list[str] | None = None
    waited_s: float | None = None


class AttemptData(EventData):
    """The service handed the job over again: the attempt (2 for the first retry) out of
    ``attempts``, the backend's new submission id, why the last attempt was lost, and the
    checkpoint the new one resumes from (null: from the start)."""

    attempt: int | None = None
    attempts: int | None = None
    submission_id: str | None = None
    reason: str | None = None
    resumes_from: str | None = None


class ErrorData(EventData):
    """Why the job failed, one line."""

    message: str | None = None


EVENT_DATA: dict[EventType, type[EventData]] = {
    EventType.PROGRESS: ProgressData,
    EventType.EVALUATION: EvaluationData,
    EventType.CHECKPOINT: CheckpointData,
    EventType.WAITING: WaitingData,
    EventType.ATTEMPT: AttemptData,
    EventType.ERROR: ErrorData,
}
"""The ``data`` of each event type that has known fields; a ``measurement``, ``replan`` or
``result`` carries a document of its own (a ``result``: the job's result)."""


def _data_by_type(schema: dict[str, Any]) -> None:
    """State in an event's JSON schema that its ``data`` is its type's (:data:`EVENT_DATA`)."""
    schema["allOf"] = [
        {
            "if": {"properties": {"type": {"const": kind.value}}, "required": ["type"]},
            "then": {"properties": {"data": model.model_json_schema()}},
        }
        for kind, model in EVENT_DATA.items()
    ]


class EventIn(BaseModel):
    """``POST /v1/jobs/{id}/events`` (the control endpoint, with the job's token). Idempotent
    on ``seq``: a repeated seq is acknowledged and not stored twice. The ``data`` of a type
    of :data:`EVENT_DATA` is checked as that model when it is posted
    (:func:`service.api.validation.check_event_data`)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_data_by_type)

    seq: int = Field(ge=0, le=SEQ_MAX)
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
