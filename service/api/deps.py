"""What the routes depend on, as typed aliases (``StoreDep``, ``BackendDep``, ...).

:func:`~service.api.app.create_app` puts one :class:`AppContext` on ``app.state``; each
dependency reads its part, so tests swap any of them with ``app.dependency_overrides``.
They are ``async``, though they await nothing: FastAPI runs a plain ``def`` dependency in its
thread pool, and a thread hop per accessor made every request several hops slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, cast

from fastapi import Depends, Request

from pipeplan.service.api.backend import JobsBackend
from pipeplan.service.api.calibration import Calibrator
from pipeplan.service.api.metrics import Metrics
from pipeplan.service.api.pool import PlannerPool
from pipeplan.service.api.settings import ApiToken, Settings
from pipeplan.service.api.store import Store
from pipeplan.service.web.job_plan import ZooProfiles

MAX_TOKEN_HASHES = 10_000


@dataclass
class AppContext:
    """The service's parts: settings, the API token, the store, the backend, metrics, the
    calibrator that refits clusters from the runs their jobs measured, the planner pool
    (None: there is none) and the zoo models' profiles the dashboard takes from it."""

    settings: Settings
    token: ApiToken
    store: Store
    backend: JobsBackend
    metrics: Metrics
    calibrator: Calibrator
    pool: PlannerPool | None = None
    profiles: ZooProfiles | None = None
    """Zoo models' analytic profiles for the plan panel (None: without a pool, none)."""
    token_hashes: dict[str, str] = field(default_factory=dict)
    """Job id -> its token's hash, as read from the store (they never change)."""

    def remember_token_hash(self, job_id: str, token_hash: str) -> None:
        if len(self.token_hashes) >= MAX_TOKEN_HASHES:
            self.token_hashes.clear()  # a bound, not an LRU: misses only cost a read
        self.token_hashes[job_id] = token_hash


async def get_context(request: Request) -> AppContext:
    return cast(AppContext, request.app.state.context)


ContextDep = Annotated[AppContext, Depends(get_context)]


async def get_store(context: ContextDep) -> Store:
    return context.store


async def get_backend(context: ContextDep) -> JobsBackend:
    return context.backend


async def get_app_settings(context: ContextDep) -> Settings:
    return context.settings


async def get_metrics(context: ContextDep) -> Metrics:
    return context.metrics


async def get_calibrator(context: ContextDep) -> Calibrator:
    return context.calibrator


async def get_pool(context: ContextDep) -> PlannerPool | None:
    return context.pool


async def get_profiles(context: ContextDep) -> ZooProfiles | None:
    return context.profiles


StoreDep = Annotated[Store, Depends(get_store)]
CalibratorDep = Annotated[Calibrator, Depends(get_calibrator)]
BackendDep = Annotated[JobsBackend, Depends(get_backend)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
PoolDep = Annotated[PlannerPool | None, Depends(get_pool)]
ProfilesDep = Annotated[ZooProfiles | None, Depends(get_profiles)]
