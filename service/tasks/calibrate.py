"""The ``calibrate`` use-case: fit a cluster's calibration from runs measured on it, and say
how much it helps on plans the fit did not see.

1. On the cluster (started for the spec, or joined at ``address``): measure the model's
   profile on every device type, at a quarter of the batch and the whole batch.
2. Run the probe plans (:func:`executor.calibrate.probe_plans`: every type alone, pipelines
   across nodes, replicas within a node, every device) for real.
3. Fit the calibration (:func:`executor.calibrate.fit`) on the even-numbered probes; the
   odd-numbered ones are held out (:func:`core.held_out.alternate`): their errors before
   (the spec as given) and after (with the calibration) are the report's verdict.
4. Refit on every probe, so the calibration written uses all that was measured, and return
   the cluster spec with its ``calibration:`` block (the ``fit`` record holds the held-out
   errors and when it was made).

Numbers from an emulated cluster are EMULATED.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeplan.core import held_out as split
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.observations import Observation, observation_of_run
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.calibrate import Fit, errors, fit, probe_plans
from pipeplan.executor.emulation import EMULATED_NOTE
from pipeplan.executor.measure import Measurement
from pipeplan.executor.model import ModelSource
from pipeplan.executor.pipeline import RunConfig
from pipeplan.executor.pipeline import run as run_plan
from pipeplan.service.tasks.common import ClusterRef, Document, Request, RequestError, cluster_spec
from pipeplan.service.tasks.live import live_cluster, measure_on_cluster, model_source
from pipeplan.service.tasks.progress import QUIET, Reporter


class CalibrateRequest(Request):
    """The cluster to calibrate and the model its probe plans train; or, with ``runs``,
    runs already measured on it (``pipeplan run --json`` documents, predicted from
    ``profile``): then nothing runs and no Ray starts."""

    cluster: ClusterRef
    runs: list[Document] | None = None
    profile: Document | None = None
    model: str = "alexnet"
    input_size: int | None = None
    batch: int = 32
    steps: int = 3
    warmup: int = 1
    seed: int = 0
    address: str | None = None


@dataclass(frozen=True)
class ProbeRun:
    """One probe plan (or a run given), measured, and whether the fit left it out."""

    plan: Plan
    batch_time_s: float
    batch_time_std_s: float
    held_out: bool


@dataclass(frozen=True)
class CalibrationReport:
    """The calibrated spec, the probes, and the errors before and after calibration."""

    cluster: ClusterSpec
    model: str
    probes: tuple[ProbeRun, ...]
    before: tuple[float, ...]
    """Each probe's batch-time error on the spec as given."""
    after_held_out_fit: tuple[float, ...]
    """Each probe's error with the calibration fitted on the even probes only."""
    after: tuple[float, ...]
    """Each probe's error with the calibration written (fitted on every probe)."""
    emulated: bool
    wall_s: float

    def held_out(self, values: tuple[float, ...]) -> list[float]:
        return [v for v, p in zip(values, self.probes, strict=True) if p.held_out]

    def summary(self) -> dict[str, float]:
        return held_out_summary(self.probes, self.before, self.after_held_out_fit)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "cluster": self.cluster.to_dict(),
            "summary": self.summary(),
            "probes": [
                {
                    "plan": p.plan.to_dict(),
                    "held_out": p.held_out,
                    "measured_s": p.batch_time_s,
                    "measured_std_s": p.batch_time_std_s,
                    "error_before": b,
                    "error_after_held_out_fit": h,
                    "error_after": a,
                }
                for p, b, h, a in zip(
                    self.probes, self.before, self.after_held_out_fit, self.after, strict=True
                )
            ],
            "emulated": self.emulated,
            "note": EMULATED_NOTE if self.emulated else "measured on real devices",
            "wall_s": self.wall_s,
        }


def calibrate(request: CalibrateRequest, reporter: Reporter = QUIET) -> CalibrationReport:
    """Measure the probes, fit, hold out, refit (module docstring)."""
    t0 = time.perf_counter()
    if request.runs is not None:
        return _from_runs(request, t0)
    if request.batch < 1:
        raise RequestError(f"batch: must be >= 1, got {request.batch}")
    config = RunConfig(steps=request.steps, warmup=request.warmup, seed=request.seed)
    spec = cluster_spec(request.cluster).calibrated(None)
    source = model_source(request.model, request.input_size, None, request.seed)
    with live_cluster(spec, request.address, reporter) as live:
        live = live.calibrated(None)
        types = sorted(live.device_types)
        profile = measure_on_cluster(source, live, reporter, types, request.batch)
        plans = probe_plans(live, profile, request.batch)
        runs = measure_probes(plans, source, live, config, reporter)
    held = set(split.alternate(len(runs)).test)
    probes = [
        ProbeRun(plan, m.batch_time_s, m.batch_time_std_s, held_out=i in held)
        for i, (plan, m) in enumerate(zip(plans, runs, strict=True))
    ]
    observations = [Observation.of(m, profile) for m in runs]
    emulated = any(m.emulated for m in runs)
    return _report(live, request.model, profile, probes, observations, t0, emulated=emulated)


def measure_probes(
    plans: Sequence[Plan],
    source: ModelSource,
    live: ClusterSpec,
    config: RunConfig,
    reporter: Reporter,
) -> list[Measurement]:
    """Each probe plan run for real on the connected cluster, one after the other."""
    runs = []
    for i, plan in enumerate(plans):
        with reporter.step(f"probe {i + 1}/{len(plans)}: {_describe(plan)}"):
            runs.append(run_plan(plan, source, live, config))
    return runs


def _from_runs(request: CalibrateRequest, t0: float) -> CalibrationReport:
    """Fit to runs already measured (every other one held out); nothing runs."""
    if request.profile is None:
        raise RequestError("profile: required with runs (the profile the runs are predicted from)")
    if not request.runs:
        raise RequestError("runs: empty; give at least one measured run")
    spec = cluster_spec(request.cluster).calibrated(None)
    profile = ModelProfile.from_dict(request.profile)
    observations = [
        observation_of_run(doc, profile, f"runs[{i}]") for i, doc in enumerate(request.runs)
    ]
    for i, o in enumerate(observations):
        try:
            o.plan.validate(profile, spec)
        except PipeplanError as e:
            raise RequestError(f"runs[{i}].plan: {e}") from None
    held = set(split.alternate(len(observations)).test)
    probes = [
        ProbeRun(o.plan, o.batch_time_s, float(_std(doc)), held_out=i in held)
        for i, (o, doc) in enumerate(zip(observations, request.runs, strict=True))
    ]
    emulated = any(bool(doc.get("emulated")) for doc in request.runs)
    return _report(spec, profile.name, profile, probes, observations, t0, emulated=emulated)


def _std(doc: Document) -> float:
    value = doc["measured"].get("batch_time_std_s", 0.0)
    return float(value) if isinstance(value, int | float) else 0.0


def _report(
    live: ClusterSpec,
    model: str,
    profile: ModelProfile,
    probes: list[ProbeRun],
    observations: list[Observation],
    t0: float,
    *,
    emulated: bool,
) -> CalibrationReport:
    fitted = [o for o, p in zip(observations, probes, strict=True) if not p.held_out]
    partial = fit(live, fitted)
    after_held = errors(live.calibrated(partial.calibration), observations)
    before = errors(live, observations)
    record: dict[str, Any] = {
        "model": model,
        "profile": profile.name,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        **held_out_summary(probes, before, after_held),
    }
    final: Fit = fit(live, observations, record)
    calibrated = live.calibrated(final.calibration)
    return CalibrationReport(
        cluster=calibrated,
        model=model,
        probes=tuple(probes),
        before=before,
        after_held_out_fit=after_held,
        after=errors(calibrated, observations),
        emulated=emulated,
        wall_s=time.perf_counter() - t0,
    )


def held_out_summary(
    probes: Sequence[ProbeRun], before: Sequence[float], after: Sequence[float]
) -> dict[str, float]:
    """The held-out probes' errors before and after calibration: count, median and worst
    (:func:`core.held_out.summary`)."""
    b = [e for e, p in zip(before, probes, strict=True) if p.held_out]
    a = [e for e, p in zip(after, probes, strict=True) if p.held_out]
    return split.summary(b, a)


def _describe(plan: Plan) -> str:
    stages = " | ".join(
        f"{list(s.layers)} on {'+'.join(s.devices)} b{s.microbatch}" for s in plan.stages
    )
    return f"{plan.schedule.value} {stages}"
