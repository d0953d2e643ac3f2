"""The ``run`` use-case: a plan trained for real on Ray actors, measured beside the cost
model's prediction (:class:`executor.measure.Comparison`,
``error = (predicted - measured) / measured``).

The model is ``model`` (a zoo name, factory or ``hf:`` class: :mod:`models.spec`), or the
zoo model a ``profile`` names (its name and input size). The prediction uses ``profile``, or
else a profile measured on the cluster first, for the device types the plan uses, at the
batch sizes its stages run. A plan that cannot be is refused before Ray starts (against the
profile and spec given), and a plan the live cluster cannot run before any actor starts.

The measured run is reported as one measured evaluation (``reporter.evaluated``) carrying
its observation, so that a service job's run feeds the cluster's calibration.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeplan.core.cluster import ClusterSpec, parse_device_id
from pipeplan.core.costmodel import Estimate, simulate
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.live_cluster import live_nodes
from pipeplan.executor.measure import Comparison, Measurement, publish_errors
from pipeplan.executor.model import ModelSource
from pipeplan.executor.pinning import check_feasible
from pipeplan.executor.pipeline import RunConfig, check_engine
from pipeplan.executor.pipeline import run as run_plan
from pipeplan.service.tasks.common import cluster_spec
from pipeplan.service.tasks.live import live_cluster, measure_on_cluster, source_of
from pipeplan.service.tasks.observations import OBSERVATION_KEY, observation_doc
from pipeplan.service.tasks.progress import QUIET, Reporter
from pipeplan.service.tasks.requests import DataKind, EngineKind, RunRequest

__all__ = ["DataKind", "EngineKind", "RunRequest", "measured_run", "plan_types", "run"]


def plan_types(plan: Plan) -> list[str]:
    """The device types a plan uses, sorted."""
    return sorted({parse_device_id(d)[1] for d in plan.devices})


def _predict(
    plan: Plan, source: ModelSource, live: ClusterSpec, prof: ModelProfile | None, r: Reporter
) -> tuple[ModelProfile, str]:
    """The profile to predict with, and where it came from (for people)."""
    if prof is not None:
        return prof, f"profile {prof.name!r} given"
    types = plan_types(plan)
    measured = measure_on_cluster(source, live, r, types, plan.global_batch)
    return measured, "profile measured on the cluster"


def measured_run(
    measurement: Measurement, estimate: Estimate, profile: ModelProfile, cluster: ClusterSpec
) -> dict[str, Any]:
    """What the run's ``evaluation`` event carries beside its plan and value: the measured
    and predicted batch times, whether the prediction was calibrated, and the observation
    the service refits the cluster's calibration with (:mod:`service.tasks.observations`)."""
    return {
        "source": "measured",
        "batch_time_s": measurement.batch_time_s,
        "predicted_batch_time_s": estimate.batch_time_s,
        "calibrated": cluster.calibration is not None,
        OBSERVATION_KEY: observation_doc(measurement, profile, cluster),
    }


def run(request: RunRequest, reporter: Reporter = QUIET) -> Comparison:
    """Run the plan; the measurement beside the prediction (``to_dict()``: the document)."""
    plan = Plan.from_dict(request.plan)
    prof = ModelProfile.from_dict(request.profile) if request.profile is not None else None
    source = source_of(request, prof)
    config = RunConfig(
        steps=request.steps,
        warmup=request.warmup,
        data=request.data.value,
        seed=request.seed,
        timeout_s=request.timeout_s,
        engine=request.engine.value,
        emulate=request.emulate,
    )  # checks steps, warmup and timeout before anything starts
    spec = cluster_spec(request.cluster) if request.cluster is not None else None
    if spec is not None or prof is not None:  # refuse a plan that cannot be, before Ray
        plan.validate(prof, spec)
    check_engine(plan, spec, config)
    with live_cluster(spec, request.address, reporter) as live:
        plan.validate(None, live)
        check_feasible(plan, live_nodes())  # the executor's check, before any actor
        prof, profile_from = _predict(plan, source, live, prof, reporter)
        plan.validate(prof, live)
        estimate = simulate(plan, prof, live)
        with reporter.step(f"running the plan: {request.warmup} warm-up + {request.steps} steps"):
            measurement = run_plan(plan, source, live, config)
        publish_errors(estimate, measurement, "run")  # while connected: Ray's metrics
    detail = measured_run(measurement, estimate, prof, live)
    reporter.evaluated([plan], np.array([measurement.batch_time_s]), [detail])
    return Comparison(source.name, live.name, profile_from, estimate, measurement)
