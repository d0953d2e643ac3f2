"""The job store on SQLite and on PostgreSQL (127.0.0.1:5432, database ``test``; skipped
with the reason where no server answers). PostgreSQL tests use tables of their own prefix
and drop them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeplan.service.api.schemas import EventIn, EventType, JobKind, JobState
from pipeplan.service.api.store import BadCursor, JobFinished, JobNotFound, Store


def _job(db: Store, kind: JobKind = JobKind.PLAN) -> str:
    return db.create_job(kind, {"planner": "dp"}, "a job", "hash").id


def test_a_new_job_is_queued_and_read_back(db: Store) -> None:
    job = db.create_job(JobKind.PLAN, {"planner": "dp", "x": [1, 2]}, "mine", "h")
    got = db.get_job(job.id)
    assert got.state is JobState.QUEUED
    assert got.spec == {"planner": "dp", "x": [1, 2]}
    assert got.name == "mine" and got.created_at.tzinfo is not None
    assert db.token_hash(job.id) == "h" and db.token_hash("nope") is None
    with pytest.raises(JobNotFound, match="nope"):
        db.get_job("nope")


def test_jobs_are_listed_newest_first_page_by_page(db: Store) -> None:
    ids = [_job(db, JobKind.PLAN if i % 2 else JobKind.RUN) for i in range(5)]
    first = db.list_jobs(limit=2)
    assert [j.id for j in first.jobs] == ids[::-1][:2] and first.next
    second = db.list_jobs(limit=2, cursor=first.next)
    assert [j.id for j in second.jobs] == ids[::-1][2:4]
    last = db.list_jobs(limit=2, cursor=second.next)
    assert [j.id for j in last.jobs] == ids[:1] and last.next is None
    assert [j.id for j in db.list_jobs(kind=JobKind.RUN).jobs] == [ids[4], ids[2], ids[0]]
    db.finish(ids[1], JobState.CANCELLED)
    assert [j.id for j in db.list_jobs(state=JobState.CANCELLED).jobs] == [ids[1]]
    with pytest.raises(BadCursor, match="cursor: .* got 'bogus'"):
        db.list_jobs(cursor="bogus")


def test_events_move_the_job_and_a_repeated_seq_is_stored_once(db: Store) -> None:
    job_id = _job(db)
    progress = EventIn(seq=0, type=EventType.PROGRESS, data={"evaluations": 3, "best_value": 1.5})
    assert db.add_event(job_id, progress)
    job = db.get_job(job_id)
    assert job.state is JobState.RUNNING and job.started_at is not None
    assert job.progress == {"evaluations": 3, "best_value": 1.5}
    assert not db.add_event(job_id, progress)
    late = EventIn(seq=1, type=EventType.EVALUATION, data={"value": float("inf")})
    assert db.add_event(job_id, late)
    assert db.add_event(job_id, EventIn(seq=2, type=EventType.RESULT, data={"plan": {"a": 1}}))
    job = db.get_job(job_id)
    assert job.state is JobState.SUCCEEDED and job.result == {"plan": {"a": 1}}
    assert [e.seq for e in db.events_after(job_id)] == [0, 1, 2]
    assert db.events_after(job_id, 0)[0].data == {"value": None}  # inf is not JSON
    with pytest.raises(JobFinished, match="succeeded"):
        db.add_event(job_id, EventIn(seq=3, type=EventType.PROGRESS, data={}))
    assert not db.add_event(job_id, progress)  # a repeat is still acknowledged
    assert db.has_result(job_id)


def test_an_error_event_fails_the_job_and_terminal_states_never_change(db: Store) -> None:
    job_id = _job(db)
    db.add_event(job_id, EventIn(seq=0, type=EventType.ERROR, data={"message": "boom"}))
    job = db.get_job(job_id)
    assert job.state is JobState.FAILED and job.error == "boom"
    with pytest.raises(JobFinished):
        db.finish(job_id, JobState.CANCELLED)
    assert db.get_job(job_id).state is JobState.FAILED
    with pytest.raises(JobNotFound):
        db.add_event("nope", EventIn(seq=0, type=EventType.PROGRESS, data={}))


def test_concurrent_copies_of_one_seq_are_stored_once(db: Store) -> None:
    job_id = _job(db)
    events = [EventIn(seq=i % 10, type=EventType.EVALUATION, data={"i": i}) for i in range(40)]
    with ThreadPoolExecutor(8) as pool:
        stored = list(pool.map(lambda e: db.add_event(job_id, e), events))
    assert sum(stored) == 10
    assert [e.seq for e in db.events_after(job_id)] == list(range(10))


def test_unfinished_jobs_and_counts(db: Store) -> None:
    a, b, c = _job(db), _job(db), _job(db, JobKind.RUN)
    db.mark_running(b)
    db.finish(c, JobState.FAILED, error="x")
    assert [j.id for j in db.unfinished_jobs()] == [a, b]
    counts = db.counts()
    assert counts[("queued", "plan")] == 1 and counts[("running", "plan")] == 1
    assert counts[("failed", "run")] == 1
    assert db.ping() is None


def _ev(seq: int, kind: EventType = EventType.EVALUATION, **data: object) -> EventIn:
    return EventIn(seq=seq, type=kind, data=dict(data))


def test_a_batch_is_stored_in_one_go_and_its_repeats_are_acknowledged(db: Store) -> None:
    job_id = _job(db)
    assert db.add_events(job_id, [_ev(1), _ev(0, EventType.PROGRESS, evaluations=1)]) == [
        True,
        True,
    ]
    job = db.get_job(job_id)
    assert job.state is JobState.RUNNING and job.progress == {"evaluations": 1}
    batch = [_ev(1), _ev(2), _ev(3, EventType.PROGRESS, evaluations=3), _ev(4, EventType.PROGRESS)]
    assert db.add_events(job_id, batch) == [False, True, True, True]
    assert db.get_job(job_id).progress == {}  # the highest seq's progress wins
    assert db.add_events(job_id, [_ev(2), _ev(4)]) == [False, False]
    assert [e.seq for e in db.events_after(job_id)] == [0, 1, 2, 3, 4]


def test_a_batch_that_ends_the_job_and_one_after_its_end(db: Store) -> None:
    job_id = _job(db)
    db.add_events(job_id, [_ev(0), _ev(1, EventType.RESULT, best=2.0)])
    job = db.get_job(job_id)
    assert job.state is JobState.SUCCEEDED and job.result == {"best": 2.0}
    with pytest.raises(JobFinished, match="succeeded"):
        db.add_events(job_id, [_ev(1), _ev(2)])  # one new event: refused, nothing stored
    assert [e.seq for e in db.events_after(job_id)] == [0, 1]
    assert db.add_events(job_id, [_ev(0), _ev(1)]) == [False, False]
    other = _job(db)
    db.add_events(other, [_ev(5, EventType.ERROR, message="boom"), _ev(4)])
    assert db.get_job(other).state is JobState.FAILED and db.get_job(other).error == "boom"


def test_a_malformed_batch_is_refused_naming_the_seq(db: Store) -> None:
    job_id = _job(db)
    with pytest.raises(ValueError, match=r"events\[2\]\.seq: 1 appears twice"):
        db.add_events(job_id, [_ev(0), _ev(1), _ev(1)])
    with pytest.raises(ValueError, match=r"events\[0\]\.type: 'result' at seq 0 ends the job"):
        db.add_events(job_id, [_ev(0, EventType.RESULT), _ev(1)])
    with pytest.raises(ValueError, match="empty batch"):
        db.add_events(job_id, [])
    assert db.events_after(job_id) == [] and db.get_job(job_id).state is JobState.QUEUED
    with pytest.raises(JobNotFound):
        db.add_events("nope", [_ev(0), _ev(1)])


def test_concurrent_overlapping_batches_store_each_seq_once(db: Store) -> None:
    job_id = _job(db)
    batches = [[_ev(s) for s in range(i, i + 5)] for i in range(0, 20, 2)]
    with ThreadPoolExecutor(6) as pool:
        acks = list(pool.map(lambda b: db.add_events(job_id, b), batches))
    assert sum(sum(a) for a in acks) == 23  # seqs 0..22, each acknowledged new once
    assert [e.seq for e in db.events_after(job_id)] == list(range(23))
