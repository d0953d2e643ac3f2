"""The planner pool: ``size`` long-lived workers, a queue, and what became of each job.

Starting a Ray Job costs a new driver process that imports torch and Ray, seconds of work
before a search that may take milliseconds. The pool starts its workers once
(:class:`Workers`; on Ray, :class:`executor.worker_pool.RayWorkers`), each importing
:data:`WARM_MODULES`, and runs jobs on them through :data:`JOB_TARGET`: the very function the
job's Ray Job would run (``pipeplan job run``), so a job fetches its spec and posts its events
and result with its own token exactly as it would there.

- **Bounded.** One slot per worker, one job per slot at a time: at most ``size`` jobs run
  at once; the others wait in one first-in first-out queue (``pending``).
- **Crashes.** A worker whose process dies is replaced, and the job it ran goes back to the
  front of the queue, ``retries`` times (then it fails naming the worker and the cause).
  A retry is safe: the entrypoint does not run a job that has ended, the service stores
  each event's ``seq`` once, and a search with the same seed finds the same plan.
- **Cancel.** A waiting job leaves the queue; a running one's worker is killed (a search
  has no point at which to stop it cooperatively) and replaced.
- **Logs.** What the job printed or logged, captured in the worker, per job.
- **Calls.** :meth:`PlannerPool.call` runs another function on a worker under a time limit
  (``POST /v1/plan``); past it the worker is killed and replaced.

Which job runs where is :mod:`service.api.pool.routing`'s. The pool keeps what it knows in
this process only: its workers are owned by it and end with it (:meth:`PlannerPool.close`),
so nothing of a pool outlives the service that started it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeplan.executor.worker_calls import Outcome, WorkerLost, WorkerTimeout
from pipeplan.service.api.backend import BackendState, BackendStatus, Submission

log = logging.getLogger("pipeplan.service.pool")

JOB_TARGET = "pipeplan.service.cli.job:run_in_process"
"""What a worker runs for a job: the Ray Job's entrypoint, in-process (exit code back)."""
PLAN_TARGET = "pipeplan.service.api.pool.work:plan_document"
"""What a worker runs for a synchronous plan: the plan job's result document of a spec."""
PROFILE_TARGET = "pipeplan.service.api.pool.work:zoo_profile_document"
"""What a worker runs for the dashboard: a zoo model's analytic profile, as a document."""
WARM_MODULES = ("pipeplan.service.cli.job", "pipeplan.service.api.pool.work")
"""What a worker imports before its first job: the entrypoint and, with it, torch, the
planners and the use-cases."""
KEEP_FINISHED = 1000
"""Finished jobs whose state and log the pool remembers (the oldest are forgotten first)."""
START_BACKOFF_S = (1.0, 30.0)
"""First and longest wait before a slot tries again to start a worker that failed to."""


class Worker(Protocol):
    """One started worker (:class:`executor.worker_pool.RayWorker` on Ray)."""

    name: str

    def call(
        self, target: str, args: tuple[Any, ...], timeout_s: float | None = None
    ) -> Outcome: ...

    def kill(self) -> None: ...


class Workers(Protocol):
    """Starts workers, each warm (its modules imported) when :meth:`start` returns."""

    def start(self) -> Worker: ...

    def close(self) -> None:
        """End every worker started, and whatever the starting needed."""
        ...


class PoolTimeout(TimeoutError):
    """A call ran past its limit (its worker was replaced)."""


class PoolClosed(RuntimeError):
    """The pool was closed before the call or job could run."""


@dataclass(eq=False)
class _Job:
    """One job in the pool."""

    submission: Submission
    state: BackendState = BackendState.PENDING
    message: str = ""
    log: str = ""
    attempts: int = 0
    worker: Worker | None = None
    stopping: bool = False

    @property
    def args(self) -> tuple[Any, ...]:
        s = self.submission
        return (s.job_id, s.server_url, s.job_token)


@dataclass(eq=False)
class _Call:
    """One synchronous call, answered through ``future`` by ``deadline`` (monotonic)."""

    target: str
    args: tuple[Any, ...]
    deadline: float
    future: Future[Outcome] = field(default_factory=Future)
    attempts: int = 0
    started: bool = False
    """Whether a slot has taken it (a retried call is taken again)."""


class PlannerPool:
    """``size`` workers from ``workers``; a crashed job runs again ``retries`` times."""

    def __init__(self, workers: Workers, size: int, retries: int = 1) -> None:
        if size < 1:
            raise ValueError(f"size: a pool needs >= 1 worker, got {size}")
        if retries < 0:
            raise ValueError(f"retries: must be >= 0, got {retries}")
        self.workers, self.size, self.retries = workers, size, retries
        self._cond = threading.Condition()
        self._queue: deque[_Job | _Call] = deque()
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._threads: list[threading.Thread] = []
        self._warm = 0
        self._start_error: str | None = None
        self._closed = False

    # --- life -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the slots; each starts its worker in the background (jobs wait meanwhile)."""
        with self._cond:
            if self._threads or self._closed:
                return
            for n in range(self.size):
                t = threading.Thread(target=self._slot, name=f"planner-slot-{n}", daemon=True)
                self._threads.append(t)
        for t in self._threads:
            t.start()

    def wait_warm(self, timeout_s: float, count: int | None = None) -> bool:
        """Wait until ``count`` (default: every) worker is started; False on timeout."""
        want = self.size if count is None else count
        with self._cond:
            return self._cond.wait_for(lambda: self._warm >= want, timeout_s)

    def close(self, join_s: float = 30.0) -> None:
        """Stop taking work, end every worker (a running job's work ends with it) and the
        slots; what was waiting stays unrun (the service's reconcile names such jobs)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            waiting, self._queue = list(self._queue), deque()
            for item in waiting:
                self._drop(item, "the service stopped before it ran")
            self._cond.notify_all()
        self.workers.close()
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def ready(self) -> str | None:
        """None while the pool can run work (or is starting), else why not."""
        with self._cond:
            if self._closed:
                return "planner pool: closed"
            if self._warm == 0 and self._start_error is not None:
                return f"planner pool: no worker could start: {self._start_error}"
        return None

    # --- jobs -----------------------------------------------------------------------------------

    def submit(self, submission: Submission) -> None:
        """Queue the job (a job the pool has already is left as it is)."""
        with self._cond:
            if self._closed:
                raise PoolClosed("planner pool: closed (the service is stopping)")
            if submission.job_id in self._jobs:
                return
            job = _Job(submission)
            self._jobs[submission.job_id] = job
            self._queue.append(job)
            self._forget_old()
            self._cond.notify()

    def knows(self, job_id: str) -> bool:
        with self._cond:
            return job_id in self._jobs

    def status(self, job_id: str) -> BackendStatus | None:
        """The job's state in the pool (None: the pool does not know it)."""
        with self._cond:
            job = self._jobs.get(job_id)
            return None if job is None else BackendStatus(job.state, job.message)

    def logs(self, job_id: str) -> str | None:
        """What the job printed so far (its attempts' output once each ends); None: unknown."""
        with self._cond:
            job = self._jobs.get(job_id)
            return None if job is None else job.log

    def stop(self, job_id: str) -> None:
        """Take the job out of the queue, or kill the worker running it (no error if the job
        has ended or the pool does not know it)."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None or job.state.finished:
                return
            job.stopping = True
            if job in self._queue:
                self._queue.remove(job)
                self._finish(job, BackendState.STOPPED, "stopped by the user before it ran")
                return
            worker = job.worker
            if worker is not None:  # killed under the lock: the slot cannot reuse it meanwhile
                worker.kill()

    # --- calls ----------------------------------------------------------------------------------

    def call(self, target: str, args: tuple[Any, ...], timeout_s: float) -> Future[Outcome]:
        """Run ``target(*args)`` on a worker within ``timeout_s`` of now, waiting included.
        The future's result is the :class:`Outcome`; past the limit it raises
        :class:`PoolTimeout` (a running call's worker is replaced). Cancel the future to
        withdraw a call that has not started."""
        item = _Call(target, args, time.monotonic() + timeout_s)
        with self._cond:
            if self._closed:
                raise PoolClosed("planner pool: closed (the service is stopping)")
            self._queue.append(item)
            self._cond.notify()
        return item.future

    # --- the slots ------------------------------------------------------------------------------

    def _slot(self) -> None:
        worker: Worker | None = None
        wait = START_BACKOFF_S[0]
        while True:
            if worker is None:
                worker = self._start_worker()
                if worker is None:
                    if self._pause(wait):
                        return
                    wait = min(2 * wait, START_BACKOFF_S[1])
                    continue
                wait = START_BACKOFF_S[0]
            item = self._take()
            if item is None:
                return
            if isinstance(item, _Job):
                kept = self._run_job(item, worker)
            else:
                kept = self._run_call(item, worker)
            if not kept:
                worker.kill()
                worker = None
                with self._cond:
                    self._warm -= 1

    def _start_worker(self) -> Worker | None:
        try:
            worker = self.workers.start()
        except Exception as e:  # named by ready(); the slot tries again later
            log.warning("planner pool: a worker did not start: %s", e)
            with self._cond:
                self._start_error = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            return None
        with self._cond:
            if self._closed:
                worker.kill()
                return None
            self._warm += 1
            self._start_error = None
            self._cond.notify_all()
        return worker

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` or until closed; True when closed."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed, seconds)

    def _take(self) -> _Job | _Call | None:
        """The next item to run (None: closed); a withdrawn call is skipped."""
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._closed or bool(self._queue))
                if self._closed:
                    return None
                item = self._queue.popleft()
                if isinstance(item, _Call) and not item.started:
                    if not item.future.set_running_or_notify_cancel():
                        continue  # withdrawn while it waited
                    item.started = True
                return item

    def _run_job(self, job: _Job, worker: Worker) -> bool:
        """Run ``job`` on ``worker``; whether the worker may be used again."""
        with self._cond:
            job.state, job.worker = BackendState.RUNNING, worker
            job.attempts += 1
        try:
            outcome = worker.call(JOB_TARGET, job.args)
        except (WorkerLost, WorkerTimeout) as e:
            self._lost(job, e)
            return False
        with self._cond:
            job.worker = None
            job.log += outcome.log
            if job.stopping:  # its worker was killed, but the answer came first
                self._finish(job, BackendState.STOPPED, "stopped by the user")
                return False
            if outcome.ok and outcome.value == 0:
                self._finish(job, BackendState.SUCCEEDED, "")
            elif outcome.ok:
                self._finish(job, BackendState.FAILED, f"the job exited with {outcome.value}")
            else:
                job.log += outcome.traceback
                self._finish(job, BackendState.FAILED, f"the job's entrypoint: {outcome.error}")
        return True

    def _lost(self, job: _Job, cause: Exception) -> None:
        """``job``'s worker died under it: stopped, retried or failed."""
        with self._cond:
            job.worker = None
            if job.stopping:
                self._finish(job, BackendState.STOPPED, "stopped by the user")
            elif self._closed:
                self._finish(job, BackendState.FAILED, "the service stopped while it ran")
            elif job.attempts <= self.retries:
                job.state = BackendState.PENDING
                job.log += f"--- {cause}; the job runs again on a new worker ---\n"
                self._queue.appendleft(job)
                self._cond.notify()
            else:
                tries = f"{job.attempts} attempt{'s' if job.attempts != 1 else ''}"
                self._finish(job, BackendState.FAILED, f"{cause} ({tries}, not retried again)")

    def _run_call(self, call: _Call, worker: Worker) -> bool:
        """Run ``call`` on ``worker``; whether the worker may be used again."""
        left = call.deadline - time.monotonic()
        if left <= 0:
            call.future.set_exception(PoolTimeout("the limit passed while it waited"))
            return True
        call.attempts += 1
        try:
            outcome = worker.call(call.target, call.args, timeout_s=left)
        except WorkerTimeout:
            call.future.set_exception(PoolTimeout(f"it ran past the limit ({left:.3g} s left)"))
            return False
        except WorkerLost as e:
            retry = call.attempts <= self.retries and call.deadline > time.monotonic()
            with self._cond:
                if retry and not self._closed:
                    self._queue.appendleft(call)
                    self._cond.notify()
                    return False
            call.future.set_exception(e)
            return False
        call.future.set_result(outcome)
        return True

    # --- records --------------------------------------------------------------------------------

    def _finish(self, job: _Job, state: BackendState, message: str) -> None:
        job.state, job.message = state, message
        self._forget_old()

    def _drop(self, item: _Job | _Call, why: str) -> None:
        if isinstance(item, _Job):
            self._finish(item, BackendState.FAILED, why)
        elif item.started or item.future.set_running_or_notify_cancel():
            item.future.set_exception(PoolClosed(why))

    def _forget_old(self) -> None:
        """Forget the oldest finished jobs beyond :data:`KEEP_FINISHED`."""
        finished = [k for k, j in self._jobs.items() if j.state.finished]
        for key in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._jobs[key]
