"""The executor's metrics, published through ``ray.util.metrics`` for Ray's metrics endpoint.

Each process of a Ray cluster (the driver, every stage actor) hands what it records to its
node's metrics agent, which serves it in Prometheus' text format on the node's
``MetricsExportPort`` (every node's port is listed in Ray's service-discovery file; see
``deploy/monitoring/``). Ray prefixes the names with ``ray_``: :attr:`HistogramSpec.exported`.

What is published, all histograms (their ``_count`` counts the events):

- :data:`STAGE_COMPUTE`: each forward, backward and update of a stage replica, from the stage
  actor itself (emulation sleep included, as the run's ``compute_s``);
- :data:`STAGE_TRANSFER`: each forward's and backward's transfer time (the wait for inputs
  already produced, :func:`executor.measure.transfers`), charged to the receiving stage by
  the driver, which alone sees both ends;
- :data:`BATCH` and :data:`THROUGHPUT`: each training step's batch time and samples per
  second, from the driver;
- :data:`PREDICTION_ERROR`: how far the cost model's prediction was from the measurement
  (batch time, each stage's compute and transfer), for every plan a measured search ran and
  every ``run``;
- :data:`MEASURED_EVALUATION`: each plan a measured search valued, by outcome, with its
  wall time.

The definitions are data (:data:`HISTOGRAMS`), so the Grafana dashboard's test can check it
names only metrics that exist. The Ray objects are made on first use in each process.

**Guarded.** ``ray.util.metrics`` exports only from a process connected to a cluster, so
nothing is recorded in a process that is not (:func:`enabled`): the cost model, the planners
and every test without Ray see no difference. Recording never raises: a metric that fails
is logged once and then skipped, so telemetry cannot fail a run or change a result. Each
record costs a couple of microseconds.

**Export.** A process hands its metrics over every ``metrics_report_interval_ms`` (Ray's
default 10 s) and when it exits. Ray's Prometheus output reconstructs a histogram's
``_sum`` from bucket midpoints, so averages (``_sum / _count``) are approximate; quantiles
from the buckets are what the dashboard shows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import ray
from ray.util.metrics import Histogram

log = logging.getLogger(__name__)

EXPORT_PREFIX = "ray_"
"""What Ray's metrics agent puts before the name of an application metric."""

OpName = Literal["forward", "backward", "update"]
OP_NAMES: Mapping[str, OpName] = {"F": "forward", "B": "backward", "U": "update"}
"""A stage operation's kind (:data:`executor.stage.OpKind`) as the ``op`` tag names it; the
replicas' gradient exchange (``G``) is not recorded: it is communication, in many small
steps, and the cost model does not cost it per operation either."""

Quantity = Literal["batch_time", "stage_compute", "stage_transfer"]
"""What a prediction error is about."""


@dataclass(frozen=True)
class HistogramSpec:
    """One histogram: its name, meaning, tag keys and bucket upper bounds (Ray needs them
    positive and increasing)."""

    name: str
    description: str
    tags: tuple[str, ...]
    boundaries: tuple[float, ...]

    def __post_init__(self) -> None:
        b = self.boundaries
        if not b or b[0] <= 0 or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"{self.name}: boundaries must be positive and increasing, got {b}")

    @property
    def exported(self) -> str:
        """The family's name at Ray's metrics endpoint (``_bucket``, ``_sum``, ``_count``)."""
        return EXPORT_PREFIX + self.name


SECONDS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
    *(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
"""Buckets of an operation's seconds: 0.5 ms (a tiny layer) to a minute."""
BATCH_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
SAMPLES_PER_S = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1e3, 2.5e3, 5e3, 1e4, 1e5)
RELATIVE = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
"""Buckets of ``|predicted - measured| / measured`` (1 % to 5x)."""
EVALUATION_SECONDS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

STAGE_COMPUTE = HistogramSpec(
    "pipeplan_stage_compute_seconds",
    "Seconds of one stage operation (forward, backward or update of one microbatch on one "
    "replica), emulation included",
    ("stage", "device_type", "op"),
    SECONDS,
)
STAGE_TRANSFER = HistogramSpec(
    "pipeplan_stage_transfer_seconds",
    "Seconds a stage's forward or backward waited for inputs already produced (object "
    "store, serialisation, dispatch), charged to the receiving stage",
    ("stage", "device_type", "op"),
    SECONDS,
)
BATCH = HistogramSpec(
    "pipeplan_batch_seconds",
    "Seconds of one pipelined training step (a global batch)",
    ("model", "cluster", "schedule"),
    BATCH_SECONDS,
)
THROUGHPUT = HistogramSpec(
    "pipeplan_samples_per_second",
    "Samples per second of one pipelined training step",
    ("model", "cluster", "schedule"),
    SAMPLES_PER_S,
)
PREDICTION_ERROR = HistogramSpec(
    "pipeplan_prediction_error",
    "Relative error of the cost model, |predicted - measured| / measured; direction says "
    "whether it predicted more (over) or less (under) than measured",
    ("quantity", "direction", "source"),
    RELATIVE,
)
MEASURED_EVALUATION = HistogramSpec(
    "pipeplan_measured_evaluation_seconds",
    "Wall seconds of one plan valued by a measured search (actor start-up included), by "
    "outcome: ran, failed, or screened out without a run",
    ("outcome",),
    EVALUATION_SECONDS,
)
HISTOGRAMS = (
    STAGE_COMPUTE,
    STAGE_TRANSFER,
    BATCH,
    THROUGHPUT,
    PREDICTION_ERROR,
    MEASURED_EVALUATION,
)


class Recorder(Protocol):
    """Where observations go (Ray's metrics; a fake in tests)."""

    def observe(self, spec: HistogramSpec, value: float, tags: dict[str, str]) -> None: ...


class RayRecorder:
    """``ray.util.metrics`` histograms, each made on its first observation in this process."""

    def __init__(self) -> None:
        self._made: dict[str, Histogram] = {}

    def observe(self, spec: HistogramSpec, value: float, tags: dict[str, str]) -> None:
        histogram = self._made.get(spec.name)
        if histogram is None:
            histogram = Histogram(
                spec.name, spec.description, list(spec.boundaries), tag_keys=spec.tags
            )
            self._made[spec.name] = histogram
        histogram.observe(value, tags=tags)


_recorder: Recorder = RayRecorder()
_failed: set[str] = set()
"""Names of metrics that raised once: logged, then skipped."""
_forced: bool = False


def enabled() -> bool:
    """Whether records go anywhere: this process is connected to a Ray cluster (or a test
    installed a recorder with :func:`recording_to`)."""
    return _forced or ray.is_initialized()


AnyRecorder = TypeVar("AnyRecorder", bound=Recorder)


@contextmanager
def recording_to(recorder: AnyRecorder) -> Iterator[AnyRecorder]:
    """Send this process's records to ``recorder`` (connected or not) while in the block."""
    global _recorder, _forced
    saved = _recorder, _forced
    _recorder, _forced = recorder, True
    try:
        yield recorder
    finally:
        _recorder, _forced = saved


def observe(spec: HistogramSpec, value: float, **tags: str) -> None:
    """Record ``value`` in ``spec``'s histogram when :func:`enabled`; non-finite values and a
    failing metric are skipped (module docstring)."""
    if spec.name in _failed or not enabled() or not math.isfinite(value):
        return
    try:
        _recorder.observe(spec, float(value), tags)
    except Exception:  # telemetry never fails the work it watches
        _failed.add(spec.name)
        log.warning("metric %s: recording failed; not recorded again", spec.name, exc_info=True)


# --- what the executor records --------------------------------------------------------------


def stage_compute(stage: int, device_type: str, kind: str, seconds: float) -> None:
    """One operation of a stage replica (``kind``: ``F``, ``B`` or ``U``; others ignored)."""
    op = OP_NAMES.get(kind)
    if op is not None:
        observe(STAGE_COMPUTE, seconds, stage=str(stage), device_type=device_type, op=op)


def stage_transfer(stage: int, device_type: str, kind: str, seconds: float) -> None:
    """The transfer time of one forward or backward of a stage replica."""
    op = OP_NAMES.get(kind)
    if op is not None:
        observe(STAGE_TRANSFER, seconds, stage=str(stage), device_type=device_type, op=op)


def training_step(model: str, cluster: str, schedule: str, seconds: float, samples: int) -> None:
    """One training step: its batch time and its samples per second."""
    tags = {"model": model, "cluster": cluster, "schedule": schedule}
    observe(BATCH, seconds, **tags)
    if seconds > 0:
        observe(THROUGHPUT, samples / seconds, **tags)


def prediction_error(quantity: Quantity, source: str, error: float) -> None:
    """A signed relative error ``(predicted - measured) / measured``
    (:func:`executor.measure.relative_error`), recorded as its size and direction."""
    direction = "over" if error > 0 else "under"
    observe(PREDICTION_ERROR, abs(error), quantity=quantity, direction=direction, source=source)


def measured_evaluation(outcome: Literal["ran", "failed", "screened"], seconds: float) -> None:
    """One plan valued by a measured search."""
    observe(MEASURED_EVALUATION, seconds, outcome=outcome)
