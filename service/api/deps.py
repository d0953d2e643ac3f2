"""What the routes depend on, as typed aliases (``StoreDep``, ``BackendDep``, ...).

:func:`~service.api.app.create_app` puts one :class:`AppContext` on ``app.state``; each
dependency reads its part, so tests swap any of them with ``app.dependency_overrides``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, cast

from fastapi import Depends, Request

from service.api.backend import JobsBackend
from service.api.metrics import Metrics
from service.api.settings import ApiToken, Settings
from service.api.store import Store


@dataclass
class AppContext:
    """The service's parts: settings, the API token, the store, the backend, metrics."""

    settings: Settings
    token: ApiToken
    store: Store
    backend: JobsBackend
    metrics: Metrics


def get_context(request: Request) -> AppContext:
    return cast(AppContext, request.app.state.context)


ContextDep = Annotated[AppContext, Depends(get_context)]


def get_store(context: ContextDep) -> Store:
    return context.store


def get_backend(context: ContextDep) -> JobsBackend:
    return context.backend


def get_app_settings(context: ContextDep) -> Settings:
    return context.settings


def get_metrics(context: ContextDep) -> Metrics:
    return context.metrics


StoreDep = Annotated[Store, Depends(get_store)]
BackendDep = Annotated[JobsBackend, Depends(get_backend)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
