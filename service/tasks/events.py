"""The reporter of a use-case that runs as a service job: its reports become the job's events.

Inside a Ray Job (``pipeplan job run``), a use-case reports through an
:class:`EventReporter`, which posts to the service's control endpoint
(``POST {server}/v1/jobs/{id}/events``, with the job's own token, ``../shared/API.md``):

- ``progress`` ``{evaluations, best_value, elapsed_s, search}`` from a search's callback, at
  most every :data:`PROGRESS_EVERY_S` (and always the last one of a search);
- ``evaluation`` ``{plan, value, source, batch_time_s?, predicted_batch_time_s?,
  calibrated?, observation?, search}`` for every plan a search valued
  (:meth:`~service.tasks.progress.Reporter.evaluated`; a measured plan carries the cost
  model's prediction beside its measured time, and its ``observation`` for the service's
  calibration, :mod:`service.tasks.observations`: a profile's document goes out with the
  job's first observation that uses it, later ones name it by ``profile_sha256`` only);
- ``progress`` ``{step, loss, samples_per_s, batch_time_s, accuracy}`` for every step a
  training run trained (``step``: the steps trained in all once it is done, so a resumed
  run goes on from its checkpoint's count), and ``checkpoint`` ``{step, path}`` for every
  checkpoint it wrote (the steps trained when it was taken, and its folder);
- ``measurement``, ``result`` and ``error``, posted by the entrypoint.

Delivery (:class:`EventChannel`): every event gets the next ``seq`` (0, 1, 2 ...) and goes
out in that order from one sender thread, so the search never waits on the network; the
events that queue while a post is on its way go out together in the next post (a batch, a
JSON array: a fast search is not held to one round trip per event). While the service is
unreachable (a connection error, a 5xx, a 429) a post is retried with
exponential backoff, up to a total deadline; the service stores each seq once, so a retry
after a lost answer doubles nothing. Any other 4xx is a bug (a wrong token, a malformed
event): delivery stops and :meth:`EventChannel.flush` raises it. ``inf`` and ``nan`` are not
JSON: such values go out as ``null``.

Notes and steps are for people: they go to stdout, the Ray job's log.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from pipeplan.agents.problem import Objective
from pipeplan.agents.rewards import Population
from pipeplan.agents.search import Progress
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.plan import Plan, Schedule
from pipeplan.executor.reservation import Waiting
from pipeplan.service.tasks.observations import OBSERVATION_KEY
from pipeplan.service.tasks.progress import Reporter

if TYPE_CHECKING:  # the executor imports torch; the reporter only reads its steps
    from pipeplan.executor.elastic import Replanned
    from pipeplan.executor.reservation import Waiting
    from pipeplan.executor.train import TrainStep

PROGRESS_EVERY_S = 0.1
"""Least time between two ``progress`` events of one search (at most ~10 a second)."""
QUEUE_SIZE = 10_000
"""Events waiting to be sent; a search that outruns delivery waits for room."""
BATCH_SIZE = 500
"""The most events one post carries (the service takes up to 1,000)."""
BATCH_BYTES = 4 * 2**20
"""The largest body a post of several events may have; a bigger batch goes in halves."""


class EventDeliveryError(RuntimeError):
    """An event could not be delivered: refused by the service (4xx) or not answered
    before the deadline. Names the event's seq and type and the cause."""


@dataclass(frozen=True)
class Delivery:
    """How one event is retried: first wait, the longest wait, and the total deadline
    (seconds from the first failure of that event)."""

    first_wait_s: float = 0.1
    max_wait_s: float = 5.0
    deadline_s: float = 600.0


def finite(x: float) -> float | None:
    """``x``, or None for inf and nan (not JSON)."""
    return float(x) if math.isfinite(x) else None


def jsonable(doc: Any) -> Any:
    """``doc`` with every inf and nan float replaced by None, so that it is strict JSON."""
    if isinstance(doc, float):
        return finite(doc)
    if isinstance(doc, dict):
        return {k: jsonable(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [jsonable(v) for v in doc]
    return doc


def with_retries(
    send: Callable[[], httpx.Response],
    what: str,
    delivery: Delivery = Delivery(),
    sleep: Callable[[float], None] = time.sleep,
) -> httpx.Response:
    """``send()`` until the service answers other than with a 5xx or 429, with exponential
    backoff while it is unreachable; a 4xx is raised at once, and so is the last failure
    once ``delivery.deadline_s`` has passed since the first. Errors begin with ``what``."""
    wait, first_failure = delivery.first_wait_s, None
    while True:
        try:
            r = send()
            if r.status_code < 400:
                return r
            if r.status_code < 500 and r.status_code != 429:
                raise EventDeliveryError(f"{what}: refused with {r.status_code}: {r.text}")
            cause = f"{r.status_code} {r.text[:200]}"
        except httpx.TransportError as e:
            cause = f"{type(e).__name__}: {e}"
        first_failure = first_failure or time.monotonic()
        if time.monotonic() - first_failure + wait > delivery.deadline_s:
            raise EventDeliveryError(
                f"{what}: not delivered in {delivery.deadline_s:.0f} s; last: {cause}"
            )
        sleep(wait)
        wait = min(2 * wait, delivery.max_wait_s)


class EventChannel:
    """Posts one job's events in order, each until it is acknowledged (module docstring).

    ``client`` is an ``httpx.Client`` whose base URL is the service (tests hand in one with
    a ``MockTransport``); ``sleep`` is the backoff's wait."""

    def __init__(
        self,
        client: httpx.Client,
        job_id: str,
        token: str,
        delivery: Delivery = Delivery(),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.client, self.job_id, self.delivery, self.sleep = client, job_id, delivery, sleep
        self.path = f"/v1/jobs/{job_id}/events"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.next_seq = 0
        self.error: EventDeliveryError | None = None
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(QUEUE_SIZE)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"events-{job_id}", daemon=True)
        self._thread.start()

    def emit(self, type_: str, data: dict[str, Any]) -> int:
        """Queue an event; returns its seq. Raises the delivery error once there is one."""
        if self.error is not None:
            raise self.error
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            self._queue.put({"seq": seq, "type": type_, "data": jsonable(data)})
        return seq

    def flush(self) -> None:
        """Wait until every queued event is delivered; raises the delivery error if any."""
        self._queue.join()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Deliver what is queued, then stop the sender thread."""
        try:
            self.flush()
        finally:
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                if self.error is None:
                    self._deliver(batch)
            except EventDeliveryError as e:
                self.error = e
            finally:
                for _ in batch:
                    self._queue.task_done()
        self._queue.task_done()

    def _next_batch(self) -> list[dict[str, Any]] | None:
        """The next event and every one queued behind it, up to :data:`BATCH_SIZE` (None:
        closed). Events that queued while the last post was on its way go out together."""
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        while len(batch) < BATCH_SIZE:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                break
            if event is None:  # closing: this batch goes out, then the sentinel again
                self._queue.task_done()
                self._queue.put(None)
                break
            batch.append(event)
        return batch

    def _deliver(self, batch: list[dict[str, Any]]) -> None:
        """Post ``batch`` until the service acknowledges it (module docstring): one event as
        an object, several as an array; a body over :data:`BATCH_BYTES` goes in halves."""
        body = json.dumps(batch[0] if len(batch) == 1 else batch, allow_nan=False).encode()
        if len(body) > BATCH_BYTES and len(batch) > 1:
            half = len(batch) // 2
            self._deliver(batch[:half])
            self._deliver(batch[half:])
            return
        first, last = batch[0], batch[-1]
        if len(batch) == 1:
            what = f"event {first['seq']} ({first['type']}) of job {self.job_id}"
        else:
            what = f"events {first['seq']}..{last['seq']} ({len(batch)}) of job {self.job_id}"
        headers = self.headers | {"Content-Type": "application/json"}
        send = partial(self.client.post, self.path, content=body, headers=headers)
        with_retries(send, what, self.delivery, self.sleep)


@dataclass(frozen=True)
class PlanContext:
    """What turns a vectorised population into plans, and what its values mean."""

    cluster: ClusterSpec
    global_batch: int
    schedule: Schedule
    objective: Objective


def _plans(population: Population, context: PlanContext | None) -> list[Plan | None]:
    if not isinstance(population, PlanBatch):
        return list(population)
    if context is None:
        return [None] * population.size
    c = context
    return [
        population.plan(i, c.cluster, c.global_batch, c.schedule) for i in range(population.size)
    ]


def echo_line(text: str) -> None:
    """One line on stdout, flushed: a Ray job's log shows it at once."""
    print(text, flush=True)


class EventReporter(Reporter):
    """A use-case's reports as the job's events (module docstring). ``source`` says where
    values come from (``simulated`` or ``measured``); ``context`` decodes populations."""

    def __init__(
        self,
        channel: EventChannel,
        context: PlanContext | None = None,
        source: str = "simulated",
        echo: Callable[[str], None] = echo_line,
    ) -> None:
        self.channel, self.context, self.source, self.echo = channel, context, source, echo
        self._search = ""
        self._profiles_sent: set[str] = set()

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        self.echo(f"{text} ...")
        yield

    def note(self, text: str) -> None:
        self.echo(text)

    @contextmanager
    def search(self, label: str, total: int | None) -> Iterator[Progress]:
        start = time.monotonic()
        last_sent = -math.inf
        latest: dict[str, Any] | None = None
        self._search = label

        def progress(evaluations: int, best: float) -> None:
            nonlocal last_sent, latest
            now = time.monotonic()
            latest = {
                "evaluations": int(evaluations),
                "best_value": finite(best),
                "elapsed_s": now - start,
                "search": label,
            }
            if now - last_sent >= PROGRESS_EVERY_S:
                self.channel.emit("progress", latest)
                last_sent, latest = now, None

        self.echo(f"search {label} (budget {total if total is not None else '-'} evaluations)")
        yield progress
        if latest is not None:  # the last report of the search, whatever the throttle
            self.channel.emit("progress", latest)

    def evaluated(
        self,
        plans: Population,
        values: np.ndarray,
        details: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        time_is_value = self.context is not None and self.context.objective is Objective.TIME
        listed = _plans(plans, self.context)
        extra = details if details is not None else [{}] * len(listed)
        for plan, value, more in zip(listed, values, extra, strict=True):
            data: dict[str, Any] = {
                "plan": None if plan is None else plan.to_dict(),
                "value": finite(float(value)),
                "source": self.source,
                "search": self._search,
            }
            if time_is_value:
                data["batch_time_s"] = data["value"]
            self.channel.emit("evaluation", data | self._once(more))

    def _once(self, detail: Mapping[str, Any]) -> dict[str, Any]:
        """``detail`` with its observation's profile document left out when this job has
        sent that profile before (its ``profile_sha256`` names it)."""
        out = dict(detail)
        observation = out.get(OBSERVATION_KEY)
        if isinstance(observation, Mapping) and "profile" in observation:
            sha = str(observation.get("profile_sha256"))
            if sha in self._profiles_sent:
                out[OBSERVATION_KEY] = {k: v for k, v in observation.items() if k != "profile"}
            self._profiles_sent.add(sha)
        return out

    def trained(self, step: TrainStep) -> None:
        self.channel.emit(
            "progress",
            {
                "step": step.step + 1,
                "loss": finite(step.loss),
                "samples_per_s": finite(step.samples_per_s),
                "batch_time_s": finite(step.batch_time_s),
                "accuracy": finite(step.accuracy),
            },
        )

    def checkpointed(self, step: int, path: Path) -> None:
        self.echo(f"checkpoint after step {step}: {path}")
        self.channel.emit("checkpoint", {"step": step, "path": str(path)})

    def replanned(self, event: Replanned) -> None:
        self.echo(event.text())
        self.channel.emit("replan", event.to_dict())

    def waiting(self, waiting: Waiting) -> None:
        """The job waits for devices others hold: it shows ``queued`` with the reason."""
        self.echo(f"waiting for {waiting.text()}")
        self.channel.emit("waiting", waiting.to_dict())

    def granted(self, waited_s: float) -> None:
        """The devices came after ``waited_s``: the job runs again."""
        self.echo(f"devices reserved after {waited_s:.1f} s")
        done = {"devices": [], "held_by": [], "waited_s": round(waited_s, 3)}
        self.channel.emit("waiting", done)

    def measurement(self, data: dict[str, Any]) -> None:
        """A run measured on the cluster (the entrypoint posts them)."""
        self.channel.emit("measurement", data)
