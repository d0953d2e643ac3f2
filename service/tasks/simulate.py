"""The ``simulate`` and ``validate`` use-cases: the cost model's estimate of one plan, and
the check of a profile, cluster or plan document."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import Estimate
from pipeplan.core.costmodel import simulate as run_simulation
from pipeplan.core.errors import FormatError
from pipeplan.core.plan import Plan, Schedule, Stage, uniform_stages
from pipeplan.core.profile import ModelProfile
from pipeplan.service.tasks.requests import (
    ClusterRef,
    Document,
    Request,
    RequestError,
    cluster_spec,
)


class UniformPlan(Request):
    """GPipe's default plan: equal layer counts on the first ``devices`` devices, equal
    microbatches."""

    devices: int
    batch: int = 64
    microbatches: int = 8
    schedule: Schedule = Schedule.GPIPE


class SimulateRequest(Request):
    """A profile, a cluster and a plan (a document, or a :class:`UniformPlan` to make)."""

    profile: Document
    cluster: ClusterRef
    plan: Document | None = None
    uniform: UniformPlan | None = None


@dataclass(frozen=True)
class Simulated:
    """The plan costed, and what it was costed for."""

    model: str
    cluster: str
    plan: Plan
    estimate: Estimate

    def to_dict(self) -> dict[str, Any]:
        """What ``pipeplan simulate --json`` prints: the estimate."""
        return self.estimate.to_dict()


def uniform_plan(prof: ModelProfile, spec: ClusterSpec, uniform: UniformPlan) -> Plan:
    """The uniform plan the request describes, on the cluster's first devices."""
    ids, n = spec.device_ids, uniform.devices
    if not 1 <= n <= min(len(ids), len(prof)):
        raise RequestError(
            f"uniform.devices: must be in [1, {min(len(ids), len(prof))}] for "
            f"{len(ids)} devices and {len(prof)} layers, got {n}"
        )
    m, batch = uniform.microbatches, uniform.batch
    if m < 1 or batch % m:
        raise RequestError(f"uniform.microbatches: {m} does not divide uniform.batch {batch}")
    stages = tuple(
        Stage(r, (ids[k],), batch // m) for k, r in enumerate(uniform_stages(len(prof), n))
    )
    return Plan(batch, stages, uniform.schedule)


def simulate(request: SimulateRequest) -> Simulated:
    """Cost the request's plan with the cost model."""
    prof, spec = ModelProfile.from_dict(request.profile), cluster_spec(request.cluster)
    if (request.plan is None) == (request.uniform is None):
        raise RequestError("plan, uniform: give exactly one of a plan document or uniform")
    if request.plan is not None:
        plan = Plan.from_dict(request.plan)
    else:
        assert request.uniform is not None  # one of the two, checked above
        plan = uniform_plan(prof, spec, request.uniform)
    return Simulated(prof.name, spec.name, plan, run_simulation(plan, prof, spec))


class Kind(StrEnum):
    """What a document is (``auto``: tell from its fields)."""

    AUTO = "auto"
    PROFILE = "profile"
    CLUSTER = "cluster"
    PLAN = "plan"


class ValidateRequest(Request):
    """A document to check; a plan is also checked against ``profile`` and ``cluster``."""

    document: Any
    kind: Kind = Kind.AUTO
    profile: Document | None = None
    cluster: ClusterRef | None = None


@dataclass(frozen=True)
class Validated:
    """What the document is, summarised for people."""

    kind: Kind
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "summary": self.summary}


def detect(doc: Any) -> Kind:
    """The kind of a document, from its fields."""
    if isinstance(doc, dict):
        if "device_types" in doc or "nodes" in doc:
            return Kind.CLUSTER
        if "stages" in doc or "global_batch" in doc:
            return Kind.PLAN
        if "layers" in doc:
            return Kind.PROFILE
    raise FormatError(
        "cannot tell the kind of file: expected a profile (layers), a cluster "
        "(device_types, nodes) or a plan (global_batch, stages); give its kind"
    )


def _summary(kind: Kind, request: ValidateRequest) -> str:
    doc = request.document
    if kind is Kind.PROFILE:
        p = ModelProfile.from_dict(doc)
        types = ", ".join(p.device_types) or "none (analytic)"
        return f"profile {p.name!r}: {len(p)} layers, timings for {types}"
    if kind is Kind.CLUSTER:
        c = ClusterSpec.from_dict(doc)
        counts = ", ".join(f"{n} {t}" for t, n in c.counts_by_type().items())
        return f"cluster {c.name!r}: {len(c.nodes)} nodes, {len(c.device_ids)} devices ({counts})"
    plan = Plan.from_dict(doc)
    plan.validate(
        ModelProfile.from_dict(request.profile) if request.profile is not None else None,
        cluster_spec(request.cluster) if request.cluster is not None else None,
    )
    return (
        f"plan: {plan.num_stages} stages, {len(plan.devices)} devices, batch "
        f"{plan.global_batch}, {plan.schedule.value}"
    )


def validate(request: ValidateRequest) -> Validated:
    """Check the document (and a plan against the profile and cluster given)."""
    kind = detect(request.document) if request.kind is Kind.AUTO else request.kind
    return Validated(kind, _summary(kind, request))
