"""The fit of a cluster's calibration from use, run in a child process of the API.

A 200-run fit holds the CPU for seconds; in a thread of the API process it would hold the
GIL against request handling, so :class:`FitWorker` runs it in one child process (spawned
on the first fit, kept for the next, shut down with the app). What crosses the boundary is
plain data: a :class:`FitPayload` (the uncalibrated spec, each profile once, the runs)
goes in, a :class:`FitOutcome` (the fit record, or why the runs could not be fitted) comes
back. Only :mod:`core` and :mod:`executor.calibrate` (no torch, no Ray) are needed on the
worker's side.

The fit is judged **held out** (:func:`core.held_out.by_count`): with
:data:`~core.held_out.HOLD_OUT_FROM` observations or more, the fit on all but the newest
quarter is judged on that quarter (the plans the cluster will be asked about next are more
like the newest); with fewer, leave-one-out. The calibration kept is
then fitted on every observation, and new jobs use it once it has :data:`MIN_RUNS` runs and
its held-out error is no worse than the spec's (:mod:`service.api.calibration`).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import UTC, datetime
from typing import Any, NotRequired, TypedDict

from pipeplan.core import held_out as split
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.observations import Observation
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.calibrate import fit, held_out_errors

MIN_RUNS = 3
"""Observations a calibration needs before new jobs use it."""


class RunDoc(TypedDict):
    """One measured plan as the worker is sent it (its profile by hash)."""

    plan: dict[str, Any]
    profile_sha256: str
    batch_time_s: float
    forward_s: list[float]
    backward_s: list[float]
    emulated: bool
    job_id: str
    allreduce_s: NotRequired[list[float]]
    """Per stage, the measured ring all-reduce, when the observation carried it."""
    update_s: NotRequired[list[float]]
    """Per stage, the measured optimizer update, when the observation carried it."""


class FitPayload(TypedDict):
    """What one fit reads: the uncalibrated spec, each profile once, the runs oldest first."""

    spec: dict[str, Any]
    profiles: dict[str, dict[str, Any]]
    runs: list[RunDoc]


class FitOutcome(TypedDict):
    """What one fit hands back: its record (None when the runs could not be fitted), why
    not (``error``), and the id of the process that fitted it."""

    fit: dict[str, Any] | None
    error: str | None
    pid: int


# --- the fit (either side of the boundary) ----------------------------------------------------


def _end_with_parent(parent: int) -> None:
    """In the worker: a daemon thread that ends the process once ``parent`` (the API's
    process) is gone, so that a service or test that never closed its worker leaves no
    process behind (the pool's own shutdown is not reached when the parent is killed)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def held_out(
    spec: ClusterSpec, observations: Sequence[Observation]
) -> tuple[str, list[float], list[float]]:
    """How the fit is judged (:func:`core.held_out.by_count`), and each held-out
    observation's batch-time error before (the spec as given) and after (the calibration
    fitted without it)."""
    method, folds = split.by_count(len(observations))
    return (method, *held_out_errors(spec, observations, folds))


def _or_none(x: float) -> float | None:
    """``x``, or None for NaN (JSON has no NaN)."""
    return None if math.isnan(x) else x


def _applied(runs: int, before: float | None, after: float | None) -> tuple[bool, str]:
    if runs < MIN_RUNS:
        return False, f"{runs} runs: new jobs use it from {MIN_RUNS}"
    if before is None or after is None or after > before:
        return False, "its held-out error is worse than the spec's: new jobs do not use it"
    return True, "new jobs on this cluster predict with it"


def observations_of(payload: FitPayload) -> list[Observation]:
    """The payload's runs as the fit reads them, each profile parsed once."""
    profiles = {sha: ModelProfile.from_dict(doc) for sha, doc in payload["profiles"].items()}
    return [
        Observation.from_doc(
            r, Plan.from_dict(r["plan"]), profiles[r["profile_sha256"]], f"runs[{i}]"
        )
        for i, r in enumerate(payload["runs"])
    ]


def fit_record(payload: FitPayload) -> dict[str, Any]:
    """The fit of the payload's spec to its runs as the service keeps it: the calibration
    (its ``fit`` block says how it was made) and the held-out verdict; a
    :class:`~core.errors.PipeplanError` when the runs cannot be fitted."""
    spec = ClusterSpec.from_dict(payload["spec"])
    runs = payload["runs"]
    observations = observations_of(payload)
    method, before, after = held_out(spec, observations)
    summary: dict[str, Any] = {
        "source": "service",
        "fitted_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "emulated_runs": sum(r["emulated"] for r in runs),
        "jobs": len({r["job_id"] for r in runs}),
        "held_out_method": method,
        **{k: _or_none(v) for k, v in split.summary(before, after).items()},
    }
    t0 = time.perf_counter()
    final = fit(spec, observations, summary)
    seconds = time.perf_counter() - t0
    applied, why = _applied(
        len(observations),
        summary["held_out_median_abs_error_before"],
        summary["held_out_median_abs_error_after"],
    )
    return {
        "calibration": final.calibration.to_dict(),
        "runs": len(observations),
        "applied": applied,
        "why": why,
        "fit_seconds": seconds,
    }


def fit_outcome(payload: FitPayload) -> FitOutcome:
    """:func:`fit_record`, its refusal handed back as ``error`` (the worker's entry point).
    Any other exception crosses the boundary as itself, with the worker's traceback."""
    try:
        return {"fit": fit_record(payload), "error": None, "pid": os.getpid()}
    except PipeplanError as e:
        return {"fit": None, "error": str(e), "pid": os.getpid()}


# --- the child process ------------------------------------------------------------------------


class FitWorker:
    """One spawned child process that runs fits (:func:`fit_outcome`), one at a time.

    The process starts on the first :meth:`fit` (spawned, not forked: the API process has
    threads) and stays for the next; :meth:`close` ends it (a fit after that starts another).
    A worker that died (killed, out of memory) fails its fit with ``BrokenProcessPool`` and
    is replaced on the next."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=context,
                    initializer=_end_with_parent,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def fit(self, payload: FitPayload) -> FitOutcome:
        """Fit ``payload`` in the child process and wait for it (:func:`fit_outcome`)."""
        pool = self._executor()
        try:
            return pool.submit(fit_outcome, payload).result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise

    def close(self) -> None:
        """End the child process, after the fit it runs (if any)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
