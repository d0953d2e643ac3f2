"""The service's Prometheus metrics (``GET /metrics``): HTTP requests by route, method and
status with their latency, jobs by state and kind (read from the store at each scrape), and
events ingested by type. Each app has a registry of its own (tests build many apps).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
