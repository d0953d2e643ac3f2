"""The job side's event delivery (service.tasks.events) against a stub control endpoint (an
httpx MockTransport): in order, each seq once, retried while the service is away, a 4xx
raised, bounded by a deadline; and a use-case's reports as events."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from pipeplan.agents.problem import Objective
from pipeplan.core.plan import Plan, Schedule
from pipeplan.service.cli.job import run_job
from pipeplan.service.tasks.common import cluster_spec
from pipeplan.service.tasks.events import (
    Delivery,
    EventChannel,
    EventDeliveryError,
    EventReporter,
    PlanContext,
)
from pipeplan.service.tasks.plan import PlanRequest, plan
from tests.core.test_formats import CLUSTER, PROFILE

JOB = "j1"
TOKEN = "job-token"


class Stub:
    """A control endpoint that stores each seq once and fails as told: ``down`` posts
    answered with a connection error, then ``fail`` with 503; ``lose`` posts are stored but
    their answer is a 503 (a reply lost on the way)."""

    def __init__(self, down: int = 0, fail: int = 0, lose: int = 0, status: int = 0) -> None:
        self.down, self.fail, self.lose, self.status = down, fail, lose, status
        self.posts: list[list[int]] = []
        """Each post's seqs."""
        self.bodies: list[int | None] = []
        """Each post's batch size (None: one event sent as an object)."""
        self.stored: list[dict[str, object]] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            assert request.url.path == f"/v1/jobs/{JOB}/events"
            assert request.headers["authorization"] == f"Bearer {TOKEN}"
            body = json.loads(request.content)
            batch = body if isinstance(body, list) else [body]
            self.posts.append([e["seq"] for e in batch])
            self.bodies.append(len(batch) if isinstance(body, list) else None)
            if self.down:
                self.down -= 1
                raise httpx.ConnectError("connection refused", request=request)
            if self.fail:
                self.fail -= 1
                return httpx.Response(503, text="starting")
            if self.status:
                return httpx.Response(self.status, text="wrong token")
            acks = []
            for event in batch:
                new = all(e["seq"] != event["seq"] for e in self.stored)
                if new:
                    self.stored.append(event)
                acks.append({"seq": event["seq"], "stored": new})
            if self.lose:
                self.lose -= 1
                return httpx.Response(503, text="lost")
            return httpx.Response(200, json=acks if isinstance(body, list) else acks[0])


def channel(
    stub: Stub, delivery: Delivery | None = None, waits: list[float] | None = None
) -> EventChannel:
    client = httpx.Client(base_url="http://service", transport=httpx.MockTransport(stub))
    kept = waits if waits is not None else []
    return EventChannel(client, JOB, TOKEN, delivery or Delivery(), sleep=kept.append)


def emit_all(ch: EventChannel, n: int) -> list[int]:
    seqs = [ch.emit("progress", {"evaluations": i}) for i in range(n)]
    ch.close()
    return seqs


def test_events_go_out_in_order_with_increasing_seq() -> None:
    stub = Stub()
    assert emit_all(channel(stub), 50) == list(range(50))
    assert [e["seq"] for e in stub.stored] == list(range(50))
    assert [e["data"] for e in stub.stored] == [{"evaluations": i} for i in range(50)]
    assert in_order(stub.posts) and sum(map(len, stub.posts)) == 50


def in_order(posts: list[list[int]]) -> bool:
    """Each post repeats the one before (a retry) or goes on after it, its seqs rising."""
    rising = all(p == sorted(p) for p in posts)
    return rising and all(b == a or b[0] > a[-1] for a, b in zip(posts, posts[1:], strict=False))


def test_events_queued_during_a_post_go_out_in_one_batch() -> None:
    stub, entered, gate = Stub(), threading.Event(), threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        entered.set()
        gate.wait(10)
        return stub(request)

    client = httpx.Client(base_url="http://service", transport=httpx.MockTransport(slow))
    ch = EventChannel(client, JOB, TOKEN)
    ch.emit("progress", {"evaluations": 0})
    assert entered.wait(10)  # the first post is on its way: the next 300 queue behind it
    for i in range(1, 301):
        ch.emit("evaluation", {"value": float(i)})
    gate.set()
    ch.close()
    assert stub.posts == [[0], list(range(1, 301))]
    assert stub.bodies == [None, 300]  # one event as an object, the rest as one array
    assert [e["seq"] for e in stub.stored] == list(range(301))


@pytest.mark.parametrize(("down", "fail", "lose"), [(3, 0, 0), (0, 4, 0), (2, 2, 3)])
def test_a_service_that_fails_at_first_loses_no_event_and_doubles_none(
    down: int, fail: int, lose: int
) -> None:
    stub, waits = Stub(down=down, fail=fail, lose=lose), list[float]()
    emit_all(channel(stub, waits=waits), 20)
    assert [e["seq"] for e in stub.stored] == list(range(20))
    distinct = [p for i, p in enumerate(stub.posts) if i == 0 or p != stub.posts[i - 1]]
    assert len(stub.posts) == len(distinct) + down + fail + lose
    assert in_order(stub.posts)  # retried in place: never one out of order
    assert waits[:3] == [0.1, 0.2, 0.4][: len(waits[:3])]  # exponential backoff


def test_backoff_is_capped_and_bounded_by_the_deadline() -> None:
    stub, waits = Stub(down=10**9), list[float]()
    ch = channel(stub, Delivery(first_wait_s=1.0, max_wait_s=4.0, deadline_s=0.0), waits)
    ch.emit("progress", {})
    with pytest.raises(EventDeliveryError, match=r"event 0 \(progress\) of job j1: not delivered"):
        ch.flush()
    assert waits == []  # a zero deadline: no wait at all
    waits.clear()
    stub2 = Stub(down=10**9)
    d = Delivery(first_wait_s=1.0, max_wait_s=4.0, deadline_s=1e9)
    ch2 = channel(stub2, d, waits)
    ch2.emit("progress", {})
    while len(waits) < 6:  # the sender keeps trying; its waits double up to the cap
        threading.Event().wait(0.01)
    assert waits[:6] == [1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    stub2.down = 0  # the service is back: the sender delivers and its thread ends (with a
    ch2.close()  # fake sleep and no deadline it would otherwise spin for the whole session)
    assert [e["seq"] for e in stub2.stored] == [0]


def test_a_refused_event_is_a_bug_raised_with_its_seq_and_status() -> None:
    ch = channel(Stub(status=403))
    ch.emit("result", {"x": 1})
    with pytest.raises(EventDeliveryError, match=r"event 0 \(result\).*refused with 403"):
        ch.flush()
    with pytest.raises(EventDeliveryError):
        ch.emit("progress", {})


def test_a_plan_use_case_reports_every_evaluation_and_its_progress() -> None:
    stub = Stub()
    ch = channel(stub)
    request = PlanRequest(profile=PROFILE, cluster=CLUSTER, planner="brute", batch=8)
    context = PlanContext(cluster_spec(CLUSTER), 8, Schedule.GPIPE, Objective.TIME)
    lines: list[str] = []
    done = plan(request, EventReporter(ch, context, echo=lines.append))
    ch.close()
    events = stub.stored
    assert [e["seq"] for e in events] == list(range(len(events)))
    evaluations = [e["data"] for e in events if e["type"] == "evaluation"]
    progress = [e["data"] for e in events if e["type"] == "progress"]
    assert len(evaluations) == done.result.evaluations
    assert all(e["source"] == "simulated" and e["search"] == "brute" for e in evaluations)
    values = [e["value"] for e in evaluations if e["value"] is not None]
    assert min(values) == done.result.value
    best = next(e for e in evaluations if e["value"] == done.result.value)
    assert best["batch_time_s"] == best["value"]
    assert Plan.from_dict(best["plan"]) == done.result.plan  # type: ignore[arg-type]
    assert progress and progress[-1]["evaluations"] == done.result.evaluations
    assert progress[-1]["best_value"] == done.result.value
    assert any("search brute" in line for line in lines)


def test_progress_is_throttled_but_the_last_report_is_sent() -> None:
    stub = Stub()
    ch = channel(stub)
    reporter = EventReporter(ch, echo=lambda _: None)
    with reporter.search("s", 1000) as progress:
        for i in range(1, 1001):
            progress(i, 1.0 / i)
    ch.close()
    sent = [e["data"] for e in stub.stored]
    assert 1 <= len(sent) < 100
    assert sent[-1]["evaluations"] == 1000 and sent[-1]["best_value"] == 1.0 / 1000


def test_infinite_values_go_out_as_null() -> None:
    stub = Stub()
    ch = channel(stub)
    reporter = EventReporter(ch, echo=lambda _: None)
    with reporter.search("s", None) as progress:
        progress(1, float("inf"))
    ch.close()
    assert stub.stored[0]["data"]["best_value"] is None  # type: ignore[index]


# --- the job entrypoint (service.cli.job) against the stub ------------------------------------


class JobStub(Stub):
    """The stub, also answering ``GET /v1/jobs/{id}`` with a job of ``kind`` and ``spec``."""

    def __init__(self, kind: str, spec: dict[str, object], **fails: int) -> None:
        super().__init__(**fails)
        self.job = {"id": JOB, "kind": kind, "spec": spec, "state": "queued"}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            assert request.headers["authorization"] == f"Bearer {TOKEN}"
            return httpx.Response(200, json=self.job)
        return super().__call__(request)


def test_a_plan_job_posts_its_evaluations_then_its_result_and_exits_0() -> None:
    spec = {"profile": PROFILE, "cluster": CLUSTER, "planner": "dp", "batch": 8}
    stub = JobStub("plan", spec, down=2, fail=1)
    code = run_job(JOB, "http://service", TOKEN, transport=httpx.MockTransport(stub))
    assert code == 0
    events = stub.stored
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "result"
    expected = plan(PlanRequest.model_validate(spec)).to_dict()
    result = events[-1]["data"]
    assert result["plan"] == expected["plan"]  # type: ignore[index]
    assert result["estimate"] == expected["estimate"]  # type: ignore[index]
    assert {e["type"] for e in events[:-1]} <= {"progress", "evaluation"}


def test_a_job_that_fails_posts_one_line_error_and_exits_1() -> None:
    spec = {"profile": PROFILE, "cluster": "no-such-preset", "planner": "dp"}
    stub = JobStub("plan", spec)
    code = run_job(JOB, "http://service", TOKEN, transport=httpx.MockTransport(stub))
    assert code == 1
    assert [e["type"] for e in stub.stored] == ["progress", "error"]  # running, then its end
    message = stub.stored[1]["data"]["message"]  # type: ignore[index]
    assert message.startswith("cluster: unknown preset 'no-such-preset'")
    assert "\n" not in message


def test_a_malformed_spec_names_the_field_and_the_value() -> None:
    stub = JobStub("plan", {"profile": PROFILE, "cluster": CLUSTER, "planner": "dp", "batch": "x"})
    assert run_job(JOB, "http://service", TOKEN, transport=httpx.MockTransport(stub)) == 1
    assert stub.stored[-1]["data"]["message"].startswith("batch: ")  # type: ignore[index]
    assert "'x'" in stub.stored[-1]["data"]["message"]  # type: ignore[index]
