"""The ``search`` use-case: planning with a measured reward (``plan`` with
``reward: measured``): a learned planner (TAPP or PPO) built with a
:class:`~executor.measured_reward.MeasuredReward` as its reward source.

Every plan the planner samples runs on a cluster, ``repeats`` steps after ``warmup``,
averaged, and is valued by the problem's objective; one cluster and, where stages repeat,
the same actors serve the whole search. Each evaluation takes seconds, so the defaults are
small: at most :func:`~service.tasks.requests.measured_budget` (16 evaluations or 900 s), and
TAPP samples :data:`MEASURED_ITERATIONS` iterations of :data:`MEASURED_BATCH_SIZE` plans.
PPO trains on the cost model inside its env and spends the measured runs on the plans it
finds (:mod:`agents.rllib_ppo`); it runs on the same cluster as the measured plans.

The cluster is the one the search runs on (:func:`~service.tasks.live.live_cluster`:
``address``, else this process's or its Ray Job's, else a local one for the spec). Plans of
one population on disjoint devices run at once where ``concurrent`` says so (default: unless
the spec is emulated on one machine; :class:`~executor.measured_reward.MeasuredReward`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeplan.agents.problem import PlanResult, Problem
from pipeplan.agents.registry import make_planner
from pipeplan.agents.rewards import Population, plans_of
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan
from pipeplan.executor.measured_reward import MeasuredReward
from pipeplan.service.tasks.live import live_cluster, model_source
from pipeplan.service.tasks.observations import OBSERVATION_KEY, observation_doc
from pipeplan.service.tasks.progress import Reporter

MEASURED_ITERATIONS = 3
MEASURED_BATCH_SIZE = 4


@dataclass(frozen=True)
class SearchSettings:
    """Where and how plans are measured: the model to build (``model`` or the profile's),
    steps per plan, the cluster to join (``address``; default: the one this process or its
    Ray Job has, else start one), and whether plans on disjoint devices run at once
    (``concurrent``; None: unless the spec is emulated)."""

    model: str | None
    input_size: int | None
    repeats: int
    warmup: int
    address: str | None
    concurrent: bool | None = None
    model_fields: Mapping[str, Any] = field(default_factory=dict)
    """How ``model`` is built beyond its name: :func:`~service.tasks.live.model_source`'s
    ``options``, ``input_shape``, ``input_dtype`` and ``example``."""


@dataclass(frozen=True)
class MeasuredSearch:
    """A search whose values are measured runs: the result and the book of every run."""

    result: PlanResult
    reward: MeasuredReward
    problem: Problem

    def to_dict(self) -> dict[str, Any]:
        """Every run of the search (``measured`` in ``pipeplan plan --json``)."""
        best = self.reward.measurement(self.result.plan)
        return {
            "best": None if best is None else best.to_dict(),
            "runs": self.reward.runs,
            "pipelines_started": self.reward.pipelines_started,
            "evaluated": [
                {
                    "plan": o.plan.to_dict(),
                    "value": o.value if math.isfinite(o.value) else None,
                    "batch_time_s": None if o.measurement is None else o.measurement.batch_time_s,
                    "predicted_batch_time_s": predicted_batch_time(
                        o.plan, self.problem, self.reward.cluster
                    ),
                    "emulated": None if o.measurement is None else o.measurement.emulated,
                    "error": o.error or None,
                    "seconds": o.seconds,
                }
                for o in self.reward.outcomes.values()
            ],
        }


def search(
    problem: Problem,
    planner: str,
    options: dict[str, Any],
    settings: SearchSettings,
    reporter: Reporter,
) -> MeasuredSearch:
    """``planner`` (tapp or ppo) rewarded by measured batch times."""
    if planner == "tapp":
        options = {"iterations": MEASURED_ITERATIONS, "batch_size": MEASURED_BATCH_SIZE, **options}
    make_planner(planner, **options)  # bad options fail here, before the cluster starts
    profile = None if settings.model else problem.profile
    fields = settings.model_fields if settings.model else {}
    source = model_source(settings.model, settings.input_size, profile, **fields)
    with (
        live_cluster(problem.cluster, settings.address, reporter) as live,
        MeasuredReward(
            source,
            live,
            repeats=settings.repeats,
            warmup=settings.warmup,
            concurrent=settings.concurrent,
        ) as reward,
        reporter.search(f"{planner} (measured)", problem.budget.evaluations) as progress,
    ):
        searcher = make_planner(planner, reward=reward, **options)

        def record(plans: Population, values: np.ndarray) -> None:
            listed = plans_of(problem, plans)
            details = [measured_detail(p, problem, reward) for p in listed]
            reporter.evaluated(listed, values, details)

        result = searcher.plan(problem, progress=progress, on_record=record)
    return MeasuredSearch(result, reward, problem)


def predicted_batch_time(plan: Plan, problem: Problem, cluster: ClusterSpec) -> float | None:
    """The cost model's batch time of ``plan`` on ``problem``'s profile (None: not a
    plan it can cost)."""
    try:
        return simulate(plan, problem.profile, cluster).batch_time_s
    except PipeplanError:
        return None


def measured_detail(plan: Plan, problem: Problem, reward: MeasuredReward) -> dict[str, Any]:
    """What an evaluation event of a measured plan carries beside its value: the measured
    mean batch time, the cost model's prediction of it (and whether the cluster it used was
    calibrated), and the observation the service refits the cluster's calibration with
    (:mod:`service.tasks.observations`; only for a plan that ran)."""
    m = reward.measurement(plan)
    detail: dict[str, Any] = {
        "batch_time_s": None if m is None else m.batch_time_s,
        "predicted_batch_time_s": predicted_batch_time(plan, problem, reward.cluster),
        "calibrated": reward.cluster.calibration is not None,
    }
    if m is not None:
        detail[OBSERVATION_KEY] = observation_doc(m, problem.profile, reward.cluster)
    return detail
