"""``ParallelReward``: the simulated reward split over Ray tasks of the current cluster.

A :class:`ParallelReward` is a reward source (:class:`agents.rewards.RewardSource`) whose
values are the cost model's, exactly as :class:`agents.rewards.SimulatedReward` computes them
in this process: each population is split into ``workers`` chunks and each chunk is costed
in a Ray task with the vectorised model. It pays off where a population is costly to
simulate (long models, many microbatches); small populations are faster in process.

It runs on the Ray cluster this process is connected to and never starts one: a face starts
or joins a cluster first (:mod:`executor.runtime`). Workers hand failures back as text and
the driver raises one :class:`WorkerError` holding the worker's traceback.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from pipeplan.agents.problem import Problem
from pipeplan.agents.rewards import Rewards, simulated_rewards
from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.errors import PipeplanError
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError


class WorkerError(ExecutorError):
    """A Ray task failed to cost its plans; the message holds its traceback."""


def evaluate_chunk(problem: Problem, batch: PlanBatch) -> tuple[Rewards | None, str]:
    """The cost model's rewards of ``batch`` for ``problem``, or ``(None, traceback)``."""
    try:
        evaluator = BatchEvaluator(problem.profile, problem.cluster)
        return simulated_rewards(evaluator, problem, batch), ""
    except Exception:
        return None, traceback.format_exc()


def _rows(batch: PlanBatch, rows: np.ndarray) -> PlanBatch:
    return batch.rows(rows)


def _join(field: str, parts: Sequence[Rewards]) -> np.ndarray | None:
    arrays = [getattr(r, field) for r in parts]
    return None if any(a is None for a in arrays) else np.concatenate(arrays)


class ParallelReward:
    """The cost model over ``workers`` Ray tasks per population (module docstring)."""

    name = "parallel"

    def __init__(self, workers: int) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise PipeplanError(
                f"parallel reward: workers must be an integer >= 1, got {workers!r}"
            )
        self.workers = workers
        self._task: Any = ray.remote(num_cpus=1)(evaluate_chunk)
        self._problem: Problem | None = None
        self._problem_ref: Any = None

    def evaluate(self, problem: Problem, batch: PlanBatch) -> Rewards:
        """One value per plan of ``batch``, in order (as ``SimulatedReward`` gives them)."""
        if not runtime.is_connected():
            raise ExecutorError(
                "parallel reward: not connected to a Ray cluster; start or join one first "
                "(executor.runtime.start_local or executor.runtime.connect)"
            )
        ref = self._put(problem)
        chunks = [c for c in np.array_split(np.arange(batch.size), self.workers) if c.size]
        futures = [self._task.remote(ref, _rows(batch, c)) for c in chunks]
        parts: list[Rewards] = []
        for part, error in ray.get(futures):
            if part is None:
                raise WorkerError(f"parallel reward: a worker failed:\n{error}")
            parts.append(part)
        if not parts:
            return Rewards(np.zeros(0))
        return Rewards(
            values=np.concatenate([r.values for r in parts]),
            fits=_join("fits", parts),
            memory_ratio=_join("memory_ratio", parts),
            recompute_ratio=_join("recompute_ratio", parts),
            throughput=_join("throughput", parts),
        )

    def _put(self, problem: Problem) -> Any:
        """The problem in the object store, put once for as long as it is the same one."""
        if problem is not self._problem:
            self._problem, self._problem_ref = problem, ray.put(problem)
        return self._problem_ref
