"""Zoo models' analytic profiles for the dashboard, taken on the planner pool.

The plan panel costs a job's plan again with the job's profile; a job that names a zoo
model has none, and profiling one builds the model with torch, which the API process does
not import (DESIGN.md, "Import name and start-up"). :class:`PoolProfiles` asks a pool
worker instead (:data:`~service.api.pool.planner_pool.PROFILE_TARGET`: torch is warm
there) and keeps the last few profiles by model and input size, as the page asks for the
same ones again while a job runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.worker_calls import WorkerLost
from pipeplan.service.api.pool.planner_pool import (
    PROFILE_TARGET,
    PlannerPool,
    PoolClosed,
)

PROFILE_TIMEOUT_S = 60.0
"""The longest the page waits for a profile, waiting for a worker included."""
GRACE_S = 1.0
"""How much longer than the limit the page waits for the pool's own verdict."""
KEEP_PROFILES = 8
"""Profiles kept (the least recently used is forgotten first)."""


class PoolProfiles:
    """``profiles(model, input_size)``: the zoo model's analytic profile, from ``pool``;
    :class:`PipeplanError` saying why when the pool cannot give it."""

    def __init__(self, pool: PlannerPool, timeout_s: float = PROFILE_TIMEOUT_S) -> None:
        self.pool, self.timeout_s = pool, timeout_s
        self._kept: OrderedDict[tuple[str, int | None], ModelProfile] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, model: str, input_size: int | None) -> ModelProfile:
        key = (model, input_size)
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        profile = self._take(model, input_size)
        with self._lock:
            self._kept[key] = profile
            while len(self._kept) > KEEP_PROFILES:
                self._kept.popitem(last=False)
        return profile

    def _take(self, model: str, input_size: int | None) -> ModelProfile:
        try:
            future = self.pool.call(PROFILE_TARGET, (model, input_size), self.timeout_s)
            outcome = future.result(timeout=self.timeout_s + GRACE_S)
        except TimeoutError:  # the pool's PoolTimeout, or no worker was free in time
            future.cancel()
            raise PipeplanError(
                f"profiling {model} on the planner pool: not done within {self.timeout_s:g} s"
            ) from None
        except (PoolClosed, WorkerLost) as e:
            raise PipeplanError(f"profiling {model} on the planner pool: {e}") from None
        if not outcome.ok:
            raise PipeplanError(f"profiling {model}: {outcome.error}")
        return ModelProfile.from_dict(outcome.value)
