"""What a spec can name: ``/v1/planners`` (with their options and defaults), ``/v1/models``
(the zoo) and ``/v1/clusters`` (the presets and their documents); and what the service
learnt of a cluster from use: ``/v1/clusters/{name}/calibration``."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, status

from pipeplan.agents.problem import ProblemError
from pipeplan.agents.registry import PLANNERS, planner_class
from pipeplan.core.cluster import ClusterSpec
from pipeplan.models import zoo_names
from pipeplan.service.api.auth import ApiAuth
from pipeplan.service.api.calibration import preset_sha256, view
from pipeplan.service.api.deps import StoreDep
from pipeplan.service.api.schemas import (
    ClusterCalibration,
    ClusterInfo,
    ModelInfo,
    PlannerInfo,
    error_responses,
)
from pipeplan.service.tasks.requests import PRESETS_DIR, presets

router = APIRouter(prefix="/v1", tags=["catalog"], responses=error_responses(401, 403))


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return _jsonable(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _jsonable(f.default_factory())
    return None


def planner_info(name: str) -> PlannerInfo:
    """A planner's options and their defaults; its reason when it cannot be loaded."""
    try:
        cls = planner_class(name)
    except ProblemError as e:
        return PlannerInfo(name=name, options={}, available=False, reason=str(e))
    fields = dataclasses.fields(cls.Config) if dataclasses.is_dataclass(cls.Config) else ()
    doc = (cls.__doc__ or "").strip().splitlines()
    return PlannerInfo(
        name=name,
        options={f.name: _default(f) for f in fields},
        needs_ray=cls.needs_ray,
        summary=doc[0] if doc else "",
    )


@router.get("/planners")
def list_planners(_: ApiAuth) -> list[PlannerInfo]:
    """Every planner a ``plan`` or ``compare`` job may name, with its options."""
    return [planner_info(name) for name in PLANNERS]


@router.get("/models")
def list_models(_: ApiAuth) -> list[ModelInfo]:
    """The zoo models a spec's ``model`` may name."""
    return [ModelInfo(name=name) for name in zoo_names.MODELS]


@router.get("/clusters")
def list_clusters(_: ApiAuth) -> list[ClusterInfo]:
    """The cluster presets a spec's ``cluster`` may name, with their documents."""
    return [
        ClusterInfo(name=name, cluster=ClusterSpec.load(PRESETS_DIR / f"{name}.yaml").to_dict())
        for name in presets()
    ]


SHA256 = r"^[0-9a-f]{64}$"


@router.get("/clusters/{name}/calibration", responses=error_responses(404, 422))
def cluster_calibration(
    name: Annotated[str, Path(min_length=1, max_length=200)],
    _: ApiAuth,
    store: StoreDep,
    spec_sha256: Annotated[str | None, Query(pattern=SHA256)] = None,
) -> ClusterCalibration:
    """The calibration the service fitted from the runs its jobs measured on the cluster
    ``name``: of the spec whose uncalibrated document hashes to ``spec_sha256``; by default,
    a preset's current spec, else the spec of that name observed last. 404 when no run was
    measured on it."""
    sha = spec_sha256 or preset_sha256(name)
    record = store.calibration(name, sha)
    if record is None:
        which = f" (spec {sha[:12]})" if sha else ""
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"cluster {name!r}{which}: no calibration yet (no run measured on it)",
        )
    return view(record)
