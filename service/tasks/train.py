"""The ``train`` use-case: a model trained on a plan, with checkpoints, resumable.

The plan is ``plan`` (a document), or the one ``planner`` finds for the request's problem
first (simulated reward: the cost model). Training runs on the live cluster
(:func:`service.tasks.live.live_cluster`: the spec started locally, or the cluster at
``address``) through :func:`executor.train.train`; every step is reported
(``reporter.trained``), every checkpoint too (``reporter.checkpointed``). The answer holds
the loss curve, the last checkpoint, and the measured step time beside the cost model's
prediction when a profile is at hand (the planner's, or a ``profile`` document).

With ``elastic`` (the default) training goes through :func:`executor.elastic.elastic_train`:
a lost node re-plans on the devices left with ``dp`` on the request's objective, and a
joined node is put to use at the next checkpoint when the net gain clears
``replan_threshold``; each re-plan is reported (``reporter.replanned``) and listed in the
answer. The re-plan's profile is the one at hand, else the model profiled analytically when
a re-plan first needs it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.data import DataSpec
from pipeplan.executor.elastic import ElasticConfig, PlannerReplanner, Replanned, elastic_train
from pipeplan.executor.live_cluster import live_nodes
from pipeplan.executor.loss import LossSpec
from pipeplan.executor.model import ModelSource
from pipeplan.executor.pinning import check_feasible
from pipeplan.executor.train import TrainConfig, TrainResult, steps_for_epochs
from pipeplan.executor.train import train as train_plan
from pipeplan.service.tasks.common import cluster_spec, zoo_profile
from pipeplan.service.tasks.live import live_cluster, source_of
from pipeplan.service.tasks.plan import PlanRequest, plan
from pipeplan.service.tasks.progress import QUIET, Reporter
from pipeplan.service.tasks.requests import (
    ProblemRequest,
    TrainRequest,
    check_problem_fields,
    check_train_fields,
    train_config,
)


@dataclass(frozen=True)
class Trained:
    """A training run's answer."""

    plan: Plan
    """The plan trained on (the last one, after re-plans)."""
    result: TrainResult
    predicted_step_s: float | None
    """The cost model's step time of the first plan (each re-plan carries its own)."""
    replans: tuple[Replanned, ...] = ()

    @property
    def measured_step_s(self) -> float | None:
        times = [s.batch_time_s for s in self.result.steps[1:] or self.result.steps]
        return statistics.median(times) if times else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            **self.result.to_dict(),
            "loss_curve": [s.loss for s in self.result.steps],
            "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s,
            "replans": [r.to_dict() for r in self.replans],
        }


def _plan_of(request: TrainRequest, reporter: Reporter) -> tuple[Plan, ModelProfile | None]:
    if request.plan is not None:
        prof = ModelProfile.from_dict(request.profile) if request.profile is not None else None
        return Plan.from_dict(request.plan), prof
    assert request.planner is not None
    fields = {f: getattr(request, f) for f in ProblemRequest.model_fields}
    planned = plan(
        PlanRequest(**fields, planner=request.planner, options=request.options), reporter
    )
    return planned.result.plan, planned.problem.profile


def _checkpoint_dir(request: TrainRequest) -> Path | None:
    """Where checkpoints go: ``checkpoint_dir``, else the resumed checkpoint's directory."""
    if request.checkpoint_dir is not None:
        return Path(request.checkpoint_dir)
    if request.resume_from is None:
        return None
    resumed = Path(request.resume_from)
    return resumed.parent if resumed.name.startswith("step-") else resumed


def train(request: TrainRequest, reporter: Reporter = QUIET) -> Trained:
    """Train the request's model on its plan (module docstring)."""
    check_problem_fields(request)
    check_train_fields(request)
    DataSpec.parse(request.data)  # the forms, before planning (nothing is read or imported)
    LossSpec.parse(request.loss)
    spec = cluster_spec(request.cluster)
    the_plan, prof = _plan_of(request, reporter)
    the_plan.validate(prof, spec)
    named = None if request.model is not None else prof  # a planner's profile of model
    source = source_of(request, named)
    steps = request.steps or 10
    if request.epochs is not None:
        steps = steps_for_epochs(
            source, request.data, request.loss, the_plan.global_batch, request.seed, request.epochs
        )
    resume = Path(request.resume_from) if request.resume_from else None
    config = train_config(request, steps, _checkpoint_dir(request), resume)
    with live_cluster(spec, request.address, reporter) as live:
        check_feasible(the_plan, live_nodes())
        predicted = simulate(the_plan, prof, live).batch_time_s if prof is not None else None
        with reporter.step(f"training {source.name} for {steps} steps"):
            if not request.elastic:
                result = train_plan(
                    the_plan,
                    source,
                    live,
                    config,
                    on_step=reporter.trained,
                    on_checkpoint=reporter.checkpointed,
                )
                return Trained(the_plan, result, predicted)
            return _elastic(request, the_plan, prof, source, live, config, predicted, reporter)


def _elastic(
    request: TrainRequest,
    the_plan: Plan,
    prof: ModelProfile | None,
    source: ModelSource,
    live: ClusterSpec,
    config: TrainConfig,
    predicted: float | None,
    reporter: Reporter,
) -> Trained:
    """Train through :func:`executor.elastic.elastic_train` (module docstring)."""
    model = request.model

    def profile() -> ModelProfile:
        assert model is not None  # a request without a model has its profile document
        return zoo_profile(model, request.input_size, reporter, request)

    replanner = PlannerReplanner(
        prof if prof is not None else profile,
        request.objective,
        the_plan.global_batch,
        the_plan.schedule,
        seed=request.seed,
        min_throughput=request.min_throughput,
    )
    done = elastic_train(
        the_plan,
        source,
        live,
        config,
        replanner,
        ElasticConfig(replan_threshold=request.replan_threshold),
        on_step=reporter.trained,
        on_checkpoint=reporter.checkpointed,
        on_replan=reporter.replanned,
    )
    return Trained(done.plan, done.result, predicted, done.replans)
