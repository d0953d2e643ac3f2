"""The service's Prometheus metrics (``GET /metrics``): HTTP requests by route, method and
status with their latency, jobs by state and kind (read from the store at each scrape),
events ingested by type, and each recent job's best value and evaluation count, and a
training job's steps, last loss and samples per second (:class:`JobProgressCollector`,
read from the store at each scrape). Each app has a
registry of its own (tests build many apps).

The executor's own metrics (stage compute and transfer, batch time, samples per second, the
cost model's error) are Ray's to export: :mod:`executor.metrics`.
"""

from __future__ import annotations

import math
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeplan.service.api.schemas import Job, JobState
from pipeplan.service.api.store import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

RECENT_JOBS = 50
"""Jobs, newest first, whose progress :func:`progress_window` reports whatever their state."""
RUNNING_JOBS = 200
"""Running jobs, newest first, whose progress :func:`progress_window` reports too."""


class JobsCollector(Collector):
    """``pipeplan_jobs{state, kind}``: how many jobs the store holds, at scrape time."""

    def __init__(self, counts: Callable[[], Tally[tuple[str, str]]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "pipeplan_jobs", "Jobs by state and kind", labels=["state", "kind"]
        )
        for (state, kind), n in sorted(self.counts().items()):
            family.add_metric([state, kind], n)
        yield family


def progress_window(
    store: Store, recent: int = RECENT_JOBS, running: int = RUNNING_JOBS
) -> list[Job]:
    """The jobs whose progress a scrape reports: the ``recent`` newest jobs, whatever their
    state, and the ``running`` newest running jobs (at most ``recent + running`` jobs).

    Bounded because every job is a label value, so a time series of its own in Prometheus,
    and the scrape reads each of these jobs from the store: with every job ever run, both
    would grow without end. A running job's numbers are the live ones worth watching; a
    finished job's no longer change, so the most recent finished ones are kept (a search just
    ended stays on the dashboard) and older ones are left to ``GET /v1/jobs``. Queued jobs
    have no progress yet (their first event makes them running)."""
    newest = store.list_jobs(limit=recent).jobs if recent > 0 else []
    live = store.list_jobs(state=JobState.RUNNING, limit=running).jobs if running > 0 else []
    seen = {j.id for j in newest}
    return newest + [j for j in live if j.id not in seen]


def _number(value: Any) -> float | None:
    """A progress field as a finite float, None when it is not one (absent, ``null`` for an
    infinite best value, or a malformed document: a scrape never fails on one job)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


PROGRESS_GAUGES = (
    ("best_value", "pipeplan_job_best_value",
     "Best objective value a job's search found so far (lower is better)"),
    ("evaluations", "pipeplan_job_evaluations", "Plans a job's search valued so far"),
    ("step", "pipeplan_job_steps", "Steps a training job has trained so far, in all"),
    ("loss", "pipeplan_job_loss", "Loss of a training job's latest step"),
    ("samples_per_s", "pipeplan_job_samples_per_second",
     "Samples per second of a training job's latest step"),
)  # fmt: skip
"""The gauges of a job's latest ``progress``: (its field, the metric, the help)."""


class JobProgressCollector(Collector):
    """Each job's latest ``progress`` event as gauges labelled ``{job, kind}``
    (:data:`PROGRESS_GAUGES`): a search's ``pipeplan_job_best_value`` (the best objective
    value so far, lower is better) and ``pipeplan_job_evaluations`` (plans valued so far); a
    training job's ``pipeplan_job_steps`` (steps trained in all), ``pipeplan_job_loss`` and
    ``pipeplan_job_samples_per_second`` (of its latest step). For the jobs that ``jobs``
    returns at scrape time (:func:`progress_window`); a field a job has not reported (no
    progress yet, no feasible plan so far, a search's job has no loss) has no sample."""

    def __init__(self, jobs: Callable[[], Iterable[Job]]) -> None:
        self.jobs = jobs

    def collect(self) -> Iterator[Metric]:
        families = [
            (field, GaugeMetricFamily(name, text, labels=["job", "kind"]))
            for field, name, text in PROGRESS_GAUGES
        ]
        for job in self.jobs():
            progress = job.progress if isinstance(job.progress, dict) else {}
            labels = [job.id, job.kind.value]
            for field, family in families:
                if (value := _number(progress.get(field))) is not None:
                    family.add_metric(labels, value)
        for _, family in families:
            yield family

    def describe(self) -> Iterator[Metric]:
        """The families without samples (no store read when the collector is registered)."""
        return JobProgressCollector(lambda: ()).collect()


class _Joined(Collector):
    """A registry's collectors and some more, collected as one exposition."""

    def __init__(self, registry: CollectorRegistry, extra: Iterable[Collector]) -> None:
        self.registry, self.extra = registry, tuple(extra)

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
        for collector in self.extra:
            yield from collector.collect()


class Metrics:
    """The service's metrics in a registry of their own."""

    def __init__(self, job_counts: Callable[[], Tally[tuple[str, str]]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pipeplan_http_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "pipeplan_http_request_duration_seconds",
            "HTTP request latency by route and method",
            ["route", "method"],
            registry=self.registry,
        )
        self.events = Counter(
            "pipeplan_events_ingested",
            "Job events stored (repeats not counted) by type",
            ["type"],
            registry=self.registry,
        )
        self.registry.register(JobsCollector(job_counts))

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)

    def render(self, *extra: Collector) -> bytes:
        """The registry's metrics and those of ``extra``, collectors made for this scrape
        (the route's :class:`JobProgressCollector` over the request's store), in
        Prometheus' text format."""
        return generate_latest(_Joined(self.registry, extra))


def _route(scope: Scope) -> str:
    """The route template that matched (``/v1/jobs/{job_id}``), so labels stay few."""
    route = scope.get("route")
    return str(getattr(route, "path", "unmatched"))


class MetricsMiddleware:
    """Times every HTTP request and counts it by route template, method and status."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], Metrics | None]) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            metrics = self.metrics()
            if metrics is not None:
                metrics.observe(_route(scope), scope["method"], status, time.perf_counter() - start)
