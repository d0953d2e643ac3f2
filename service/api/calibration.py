"""Calibration from use: the service refits a cluster's calibration from the plans its jobs
measure, and new jobs on that cluster predict with it (README, "Calibration from use").

- **Observations.** A ``run`` job and a measured search post each measured plan as an
  ``evaluation`` event carrying an ``observation`` (:mod:`service.tasks.observations`).
  :func:`parse_observations` checks it before anything is stored (422 naming the field and
  the value); the store keeps it with its event, in the same transaction, filed under the
  cluster's name and the hash of its **uncalibrated** spec (a changed spec starts over),
  once per job and plan.
- **The fit.** :class:`Calibrator` refits a cluster after new observations arrive (the
  event endpoint never waits for it), from its newest :data:`MAX_RUNS` observations, with
  :func:`executor.calibrate.fit`; a background thread schedules the refits and stores them,
  the fit itself runs in a child process (:mod:`service.api.calibration_fit`, where the
  held-out verdict is described). The calibration kept is fitted on every observation. A fit
  that fails keeps the previous one and says why.
- **Use.** A new ``plan``, ``compare``, ``run`` or ``train`` job whose ``cluster`` (a preset or a
  document without a ``calibration:`` block) has a calibration that is **applied** gets the
  calibrated spec as its ``cluster`` document, so its predictions use it; ``"calibration":
  false`` in ``POST /v1/jobs`` keeps the spec as given. A calibration is applied once it has
  :data:`MIN_RUNS` observations and its held-out error after is no worse than before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipeplan.core.calibration import Calibration
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.observations import Observation
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.service.api.calibration_fit import MIN_RUNS as MIN_RUNS
from pipeplan.service.api.calibration_fit import FitPayload, FitWorker, RunDoc
from pipeplan.service.api.schemas import (
    ClusterCalibration,
    EventIn,
    EventType,
    HeldOut,
    JobCreate,
    JobKind,
)
from pipeplan.service.api.store import CalibrationRecord, ObservationRow, Store, StoredObservation
from pipeplan.service.api.validation import (
    check_cluster_limits,
    check_plan_limits,
    check_profile_limits,
)
from pipeplan.service.tasks.observations import OBSERVATION_KEY, document_sha256, spec_sha256
from pipeplan.service.tasks.requests import RequestError, cluster_spec, presets

log = logging.getLogger("pipeplan.service.calibration")

MAX_RUNS = 200
"""The most observations one fit reads: a cluster's newest."""
CALIBRATED_KINDS = frozenset({JobKind.PLAN, JobKind.COMPARE, JobKind.RUN, JobKind.TRAIN})
"""The job kinds whose predictions a calibration changes."""
OBSERVED = frozenset({EventType.EVALUATION, EventType.MEASUREMENT})
"""The events whose data may hold an observation."""
OBSERVATION_KEYS = frozenset(
    {
        "cluster",
        "profile",
        "profile_sha256",
        "batch_time_s",
        "forward_s",
        "backward_s",
        "allreduce_s",
        "update_s",
        "emulated",
    }
)

Key = tuple[str, str]
"""A calibrated cluster: its name and the hash of its uncalibrated spec."""


# --- observations in events -------------------------------------------------------------------


def _core(where: str, e: PipeplanError) -> RequestError:
    return RequestError(f"{where}: {e}")


def _one(
    data: Mapping[str, Any], where: str, profiles: dict[str, ModelProfile], store: Store
) -> ObservationRow:
    doc = data[OBSERVATION_KEY]
    at = f"{where}.{OBSERVATION_KEY}"
    if not isinstance(doc, Mapping):
        raise RequestError(f"{at}: expected an object, got {doc!r}")
    unknown = sorted(set(doc) - OBSERVATION_KEYS)
    if unknown:
        known = ", ".join(sorted(OBSERVATION_KEYS))
        raise RequestError(f"{at}: unknown key {unknown[0]!r} (known: {known})")
    check_cluster_limits(doc.get("cluster"), f"{at}.cluster")
    check_profile_limits(doc.get("profile"), f"{at}.profile")
    check_plan_limits(data.get("plan"), f"{where}.plan")
    if not isinstance(doc.get("cluster"), Mapping):
        raise RequestError(f"{at}.cluster: expected a cluster document, got {doc.get('cluster')!r}")
    try:
        spec = ClusterSpec.from_dict(doc["cluster"]).calibrated(None)
    except PipeplanError as e:
        raise _core(f"{at}.cluster", e) from None
    sha = doc.get("profile_sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        raise RequestError(f"{at}.profile_sha256: expected a sha256 in hex, got {sha!r}")
    profile_doc = doc.get("profile")
    if profile_doc is not None:
        if document_sha256(profile_doc) != sha:
            raise RequestError(f"{at}.profile_sha256: not the hash of its profile, got {sha!r}")
        try:
            profiles[sha] = ModelProfile.from_dict(profile_doc)
        except PipeplanError as e:
            raise _core(f"{at}.profile", e) from None
    elif sha not in profiles:
        found = store.profile_doc(sha)
        if found is None:
            raise RequestError(
                f"{at}.profile_sha256: no profile of that hash was sent before, got {sha!r}"
            )
        profiles[sha] = ModelProfile.from_dict(found)
    try:
        plan = Plan.from_dict(data.get("plan"))
        plan.validate(profiles[sha], spec)
    except PipeplanError as e:
        raise _core(f"{where}.plan", e) from None
    emulated = doc.get("emulated", False)
    if not isinstance(emulated, bool):
        raise RequestError(f"{at}.emulated: expected true or false, got {emulated!r}")
    try:
        o = Observation.from_doc(doc, plan, profiles[sha], at)
    except PipeplanError as e:
        raise RequestError(str(e)) from None
    plan_doc = plan.to_dict()
    return ObservationRow(
        cluster_name=spec.name,
        spec_sha256=spec_sha256(spec),
        spec=spec.to_dict(),
        profile_sha256=sha,
        profile=None if profile_doc is None else dict(profile_doc),
        plan_sha256=document_sha256(plan_doc),
        plan=plan_doc,
        batch_time_s=o.batch_time_s,
        forward_s=o.forward_s,
        backward_s=o.backward_s,
        emulated=emulated,
        allreduce_s=o.allreduce_s,
        update_s=o.update_s,
    )


def parse_observations(posted: Sequence[EventIn], store: Store) -> dict[int, ObservationRow]:
    """The observations of a posted batch (``evaluation`` and ``measurement`` events whose
    data holds one), by seq, checked completely; :class:`RequestError` naming the field and
    the value otherwise (``data.observation.X`` for one event, ``events[i].data...`` in a
    batch). A profile named by hash only must have come earlier in the batch or be stored."""
    out: dict[int, ObservationRow] = {}
    profiles: dict[str, ModelProfile] = {}
    order = sorted(range(len(posted)), key=lambda i: posted[i].seq)
    for i in order:
        p = posted[i]
        if p.type not in OBSERVED or p.data.get(OBSERVATION_KEY) is None:
            continue
        where = "data" if len(posted) == 1 else f"events[{i}].data"
        out[p.seq] = _one(p.data, where, profiles, store)
    return out


# --- the refits -------------------------------------------------------------------------------


def fit_payload(spec: dict[str, Any], stored: Sequence[StoredObservation]) -> FitPayload:
    """What the fit worker is sent for ``stored`` (oldest first): plain data, each profile
    document once."""
    runs: list[RunDoc] = []
    for s in stored:
        run: RunDoc = {
            "plan": s.plan,
            "profile_sha256": s.profile_sha256,
            "batch_time_s": s.batch_time_s,
            "forward_s": list(s.forward_s),
            "backward_s": list(s.backward_s),
            "emulated": s.emulated,
            "job_id": s.job_id,
        }
        if s.allreduce_s:
            run["allreduce_s"] = list(s.allreduce_s)
        if s.update_s:
            run["update_s"] = list(s.update_s)
        runs.append(run)
    profiles = {s.profile_sha256: s.profile for s in stored}
    return {"spec": spec, "profiles": profiles, "runs": runs}


class Calibrator:
    """Refits clusters, one at a time, from one background thread (module docstring): the
    thread reads a cluster's runs and stores its fit; the fit itself runs in the child
    process of a :class:`~service.api.calibration_fit.FitWorker`, so that it does not hold
    the API process's GIL. :meth:`observed` asks for a refit and returns at once; several
    requests for one cluster while a fit runs make one more fit (never two at once).

    ``worker``: a worker to share (tests); by default the calibrator has its own, ended by
    :meth:`stop`."""

    def __init__(
        self, store: Store, max_runs: int = MAX_RUNS, worker: FitWorker | None = None
    ) -> None:
        self.store, self.max_runs = store, max_runs
        self.worker = worker if worker is not None else FitWorker()
        self._owns_worker = worker is None
        self._pending: list[Key] = []
        self._busy = False
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, and refit every cluster whose fit is older than its runs."""
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="calibrator", daemon=True)
            self._thread.start()
        self.observed((r.name, r.spec_sha256) for r in self.store.calibrations() if r.stale)

    def stop(self) -> None:
        """Stop the thread (after the fit it waits for) and end the calibrator's own worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=60)
        if self._owns_worker:
            self.worker.close()

    def observed(self, keys: Iterable[Key]) -> None:
        """New observations of these clusters: refit them (in the background)."""
        with self._cond:
            for key in keys:
                if key not in self._pending:
                    self._pending.append(key)
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until no fit is pending or running (tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                key = self._pending.pop(0)
                self._busy = True
            try:
                self.refit(key)
            except Exception:  # a broken fit (or worker) is logged; the thread goes on
                log.exception("calibration: refit of %s", key)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def refit(self, key: Key, force: bool = False) -> CalibrationRecord | None:
        """Fit the cluster ``key`` now (in the worker process, this thread waiting for it)
        and store the fit, or why the runs could not be fitted, the previous fit kept;
        nothing when no run arrived since the last fit and not ``force``. A worker that
        fails otherwise raises here, and nothing is stored (the cluster stays stale)."""
        name, sha = key
        record = self.store.calibration(name, sha)
        if record is None or not (force or record.stale):
            return record
        stored = self.store.observations(name, sha, self.max_runs)
        through = max((s.num for s in stored), default=record.last_observation)
        outcome = self.worker.fit(fit_payload(record.spec, stored))
        if outcome["error"] is not None:
            log.warning("calibration: %s cannot be fitted: %s", key, outcome["error"])
        self.store.save_fit(name, sha, outcome["fit"], through, error=outcome["error"])
        return self.store.calibration(name, sha)


# --- use --------------------------------------------------------------------------------------


def current(record: CalibrationRecord | None) -> Calibration | None:
    """The record's calibration when new jobs use it (module docstring), else None."""
    if record is None or not record.fit or not record.fit.get("applied"):
        return None
    return Calibration.from_dict(record.fit["calibration"])


def calibrated_job(create: JobCreate, store: Store) -> JobCreate:
    """``create`` with its ``cluster`` replaced by the calibrated spec's document where a
    calibration applies (module docstring); as it is otherwise."""
    if not create.calibration or create.kind not in CALIBRATED_KINDS:
        return create
    ref = create.spec.get("cluster")
    if ref is None:
        return create
    spec = cluster_spec(ref)
    if spec.calibration is not None:  # the request's own calibration wins
        return create
    calibration = current(store.calibration(spec.name, spec_sha256(spec)))
    if calibration is None:
        return create
    doc = spec.calibrated(calibration).to_dict()
    return create.model_copy(update={"spec": create.spec | {"cluster": doc}})


def preset_sha256(name: str) -> str | None:
    """The hash of the preset ``name``'s spec (None: not a preset)."""
    if name not in presets():
        return None
    return spec_sha256(cluster_spec(name))


def view(record: CalibrationRecord) -> ClusterCalibration:
    """The record as ``GET /v1/clusters/{name}/calibration`` answers it."""
    fit_doc = record.fit or {}
    calibration = fit_doc.get("calibration")
    summary = (calibration or {}).get("fit", {})
    state = "failed" if record.fit_error else ("fitted" if calibration else "pending")
    held = None
    if summary:
        held = HeldOut(
            method=str(summary.get("held_out_method", "none")),
            plans=int(summary.get("held_out_plans", 0)),
            median_abs_error_before=summary.get("held_out_median_abs_error_before"),
            median_abs_error_after=summary.get("held_out_median_abs_error_after"),
            max_abs_error_before=summary.get("held_out_max_abs_error_before"),
            max_abs_error_after=summary.get("held_out_max_abs_error_after"),
        )
    return ClusterCalibration(
        cluster=record.name,
        spec_sha256=record.spec_sha256,
        state=state,
        observations=record.observations,
        last_observed_at=record.last_observed_at,
        runs=fit_doc.get("runs"),
        fitted_at=record.fitted_at if calibration else None,
        stale=record.stale,
        applied=bool(fit_doc.get("applied")),
        why=fit_doc.get("why"),
        calibration=calibration,
        held_out=held,
        error=record.fit_error,
    )
