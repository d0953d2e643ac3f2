"""TAPP's sampled plans evaluated on N Ray workers in parallel (``workers=N``).

The only module of ``agents/tapp`` that imports Ray, and only when a :class:`RayReward` is
made. Each call splits the plans into N chunks and costs each chunk in a Ray task with the
vectorised cost model; workers hand failures back as text and the driver raises once, with
the worker's traceback. Results are booked into the planner's :class:`~agents.search.Search`
(evaluations, best plan, history) as ``Search.evaluate`` would.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from agents.problem import HistoryPoint, Problem
from agents.search import Search
from core.batch_eval import BatchEvaluator, PlanBatch
from core.errors import PipeplanError
from core.plan import Plan


class WorkerError(PipeplanError):
    """A Ray worker failed to evaluate its plans; the message holds its traceback."""


def evaluate_chunk(problem: Problem, plans: Sequence[Plan]) -> tuple[np.ndarray | None, str]:
    """Objective values of ``plans`` (any stage counts), or ``(None, traceback)``."""
    try:
        evaluator = BatchEvaluator(problem.profile, problem.cluster)
        values = np.full(len(plans), np.inf)
        by_stages: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            by_stages.setdefault(plan.num_stages, []).append(i)
        for idx in by_stages.values():
            batch = PlanBatch.from_plans([plans[i] for i in idx], problem.cluster)
            res = evaluator.evaluate(batch, problem.global_batch, problem.schedule)
            values[idx] = problem.score(res.batch_time_s, res.fits, res.cost_per_hour)
        return values, ""
    except Exception:
        return None, traceback.format_exc()


def record(search: Search, plans: Sequence[Plan], values: np.ndarray) -> None:
    """Book values computed elsewhere into ``search`` (what ``Search.evaluate`` does)."""
    search.evaluations += len(plans)
    i = int(np.argmin(values))
    if values[i] < search.best_value:
        search.best_value, search.best_plan = float(values[i]), plans[i]
    search.history.append(HistoryPoint(search.evaluations, search.elapsed, search.best_value))
    if search.progress is not None:
        search.progress(search.evaluations, search.best_value)


class RayReward:
    """A :class:`~agents.tapp.rewards.RewardSource` over ``workers`` Ray tasks.

    Uses the Ray runtime this process has already initialised, else starts a local one of
    its own with ``workers`` CPUs (shut down on :meth:`close`); use it as a context manager.
    """

    def __init__(self, search: Search, workers: int) -> None:
        import ray

        if workers < 1:
            raise PipeplanError(f"workers: must be >= 1, got {workers}")
        self.search, self.workers = search, workers
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # a runtime of our own, even when another Ray cluster runs on this machine
            ray.init(
                address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False
            )
        self._problem = ray.put(search.problem)
        self._task: Any = ray.remote(num_cpus=1)(evaluate_chunk)

    def evaluate(self, plans: Sequence[Plan]) -> np.ndarray:
        import ray

        if not plans:
            return np.zeros(0)
        chunks = [c for c in np.array_split(np.arange(len(plans)), self.workers) if c.size]
        futures = [self._task.remote(self._problem, [plans[i] for i in c]) for c in chunks]
        values = np.full(len(plans), np.inf)
        for c, (part, error) in zip(chunks, ray.get(futures), strict=True):
            if part is None:
                raise WorkerError(f"a TAPP evaluation worker failed:\n{error}")
            values[c] = part
        record(self.search, plans, values)
        return values

    def close(self) -> None:
        import ray

        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RayReward:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
