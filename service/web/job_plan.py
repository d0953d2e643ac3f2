"""Which plan a job's page shows, and what is drawn of it: the plan panel.

- a search's best plan so far: the ``evaluation`` event the page names (by ``seq``);
- else the job's own plan: a ``plan`` job's result, the best row of a ``compare`` job's
  result, the plan a ``run`` job runs, the plan a ``train`` job trains on (its result's:
  the one its planner found, or the one it was given).

The plan is costed again with the job's profile and cluster to draw its Gantt chart from
the cost model's timeline. A job that names a zoo model is costed with the model's analytic
profile, as its search was, from the page's :data:`ZooProfiles` (the planner pool's
workers take it: profiling builds the model with torch, which the API process does not
import; without a pool there is no chart, and the note says why). A ``run`` job, and a
search with a measured reward, also show the measured stage times beside the predicted
ones. Whatever cannot be drawn is said in a note, never an error page: the job's spec may
lack a cluster document, a run may have used a profile it did not keep.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import Estimate, simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.service.api.schemas import Event, EventType, Job, JobKind
from pipeplan.service.device_groups import stage_labels
from pipeplan.service.tasks.requests import cluster_spec
from pipeplan.service.web.format import objective_value
from pipeplan.service.web.plan_view import gantt_svg, plan_grid_svg
from pipeplan.service.web.run_view import RunComparison, comparison_of, stage_bars_svg

MAX_GANTT_MICROBATCHES = 4096
"""Microbatches over all stages beyond which a plan is not simulated for its chart here
(the page answers within a request; the API's ``/v1/simulate`` has its own bound)."""

ZooProfiles = Callable[[str, int | None], ModelProfile]
"""``(model, input_size) ->`` the zoo model's analytic profile, as a job's search takes it
(:class:`~service.api.pool.profiles.PoolProfiles`); a :class:`PipeplanError` says why not."""
NO_PROFILES = (
    "the job names a zoo model, whose profile the planner pool's workers take, and this "
    "service runs without a pool: no Gantt chart (give the job a profile to have one)"
)


@dataclass
class PlanPanel:
    """What the job page's plan panel shows (``notes``: what could not be drawn, and why)."""

    job: Job
    objective: str
    plan: Plan | None = None
    origin: str = ""
    value: float | None = None
    cluster: ClusterSpec | None = None
    estimate: Estimate | None = None
    run: RunComparison | None = None
    grid_svg: str | None = None
    gantt_svg: str | None = None
    bars_svg: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def value_text(self) -> str:
        return objective_value(self.objective, self.value)

    @property
    def device_labels(self) -> list[str]:
        """Each stage's devices as the stages table shows them: ids on a small plan, counts
        by node kind and type on a large one (the ids then in a details element)."""
        return stage_labels([s.devices for s in self.plan.stages]) if self.plan else []


def _result_plan(job: Job) -> tuple[Any, str, float | None]:
    """The job's own plan document, where it came from, and its objective value."""
    spec, result = job.spec, job.result if isinstance(job.result, Mapping) else {}
    if job.kind is JobKind.PLAN and isinstance(result.get("plan"), Mapping):
        estimate = result.get("estimate") or {}
        cost = spec.get("objective") == "cost"
        value = estimate.get("cost_per_sample" if cost else "batch_time_s")
        return result["plan"], f"the plan {result.get('planner', 'the planner')} found", value
    if job.kind is JobKind.COMPARE and result.get("best") is not None:
        for row in result.get("results", []):
            if isinstance(row, Mapping) and row.get("planner") == result["best"]:
                return (
                    row.get("plan"),
                    f"the best plan of the comparison ({row['planner']})",
                    (row.get("value")),
                )
    if job.kind is JobKind.RUN:
        return spec.get("plan"), "the plan this job runs", None
    if job.kind is JobKind.TRAIN:
        if isinstance(result.get("plan"), Mapping):
            return result["plan"], "the plan this job trained on", None
        return spec.get("plan"), "the plan this job trains on", None
    return None, "", None


def _profile(
    spec: Mapping[str, Any], kind: JobKind, profiles: ZooProfiles | None
) -> tuple[ModelProfile | None, str]:
    """The profile the job's plans are costed with, or why there is none."""
    if isinstance(spec.get("profile"), Mapping):
        return ModelProfile.from_dict(spec["profile"]), ""
    if kind is JobKind.RUN:
        return None, (
            "this run predicted with a profile measured on the cluster, which its result does "
            "not keep: no Gantt chart (give the job a profile to have one)"
        )
    if isinstance(spec.get("model"), str):
        if profiles is None:
            return None, NO_PROFILES
        return profiles(spec["model"], spec.get("input_size")), ""
    return None, "the job's spec names no model and no profile: no Gantt chart"


def _cluster(spec: Mapping[str, Any]) -> tuple[ClusterSpec | None, str]:
    ref = spec.get("cluster")
    if isinstance(ref, str | dict):
        return cluster_spec(ref), ""
    return None, "the job ran on a live cluster whose spec it does not name: no Gantt chart"


def _choose(panel: PlanPanel, event: Event | None) -> Any:
    """The plan document to show (``panel.origin`` and ``value`` set), or None."""
    if event is not None and event.type is EventType.EVALUATION and event.data.get("plan"):
        value = event.data.get("value")
        panel.value = float(value) if isinstance(value, int | float) else None
        measured = ", measured" if event.data.get("source") == "measured" else ""
        panel.origin = f"the best plan so far (event {event.seq}{measured})"
        return event.data["plan"]
    doc, panel.origin, value = _result_plan(panel.job)
    panel.value = float(value) if isinstance(value, int | float) else None
    return doc


def _draw_estimate(panel: PlanPanel, plan: Plan, profiles: ZooProfiles | None) -> None:
    spec, kind = panel.job.spec, panel.job.kind
    panel.cluster, why = _cluster(spec)
    if panel.cluster is None:
        panel.notes.append(why)
        return
    ops = sum(plan.microbatches(s) for s in range(plan.num_stages))
    if ops > MAX_GANTT_MICROBATCHES:
        panel.notes.append(
            f"{ops} microbatches over all stages: more than the {MAX_GANTT_MICROBATCHES} "
            "this page simulates for a Gantt chart"
        )
        return
    profile, why = _profile(spec, kind, profiles)
    if profile is None:
        panel.notes.append(why)
        return
    panel.estimate = simulate(plan, profile, panel.cluster)
    panel.gantt_svg = gantt_svg(panel.estimate)
    if panel.gantt_svg is None:
        panel.notes.append(f"{len(panel.estimate.timeline)} boxes: too many to draw")


def plan_panel(
    job: Job, event: Event | None = None, profiles: ZooProfiles | None = None
) -> PlanPanel:
    """The panel of ``job``: the plan of ``event`` (a search's best so far) or its own;
    ``profiles``: where a zoo model's profile comes from (None: nowhere)."""
    panel = PlanPanel(job, objective=str(job.spec.get("objective", "time")))
    panel.run = comparison_of(job.kind, job.result) if job.state.terminal else None
    if panel.run is not None and panel.run.stages:
        panel.bars_svg = stage_bars_svg(panel.run)
    doc = _choose(panel, event)
    if doc is None:
        panel.notes.append(
            "a profile job makes no plan"
            if job.kind is JobKind.PROFILE
            else "no plan yet: the search has valued none"
        )
        return panel
    try:
        panel.plan = Plan.from_dict(doc)
        _draw_estimate(panel, panel.plan, profiles)
    except PipeplanError as e:  # a document the core refuses: said, not a failed page
        panel.notes.append(f"cannot draw the plan: {e}")
    if panel.plan is not None:
        panel.grid_svg = plan_grid_svg(panel.plan, panel.cluster)
    return panel
