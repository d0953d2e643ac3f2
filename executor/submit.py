"""Submit one training step: one call per stage replica.

Each replica runs its stage's operations itself and talks to its neighbours over the run's
process group (:mod:`executor.stage`); the driver only hands the first stage the batch's
inputs and the last its labels (object refs, shared by the replicas of each) and collects
every replica's :class:`~executor.stage.StepOutput`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeplan.executor.stage import WorkerInfo, WorkerSpec

Ref = Any  # ray.ObjectRef


@dataclass
class WorkerHandle:
    """The driver's view of one stage replica: its spec, actor handle and where it runs."""

    spec: WorkerSpec
    actor: Any
    info: WorkerInfo | None = None

    @property
    def key(self) -> tuple[int, int]:
        return self.spec.stage, self.spec.replica

    def where(self) -> str:
        s = self.spec
        return f"stage {s.stage} replica {s.replica} ({s.device} on node {s.node})"


def submit_step(
    rows: Sequence[Sequence[WorkerHandle]], step: int, inputs: Ref, labels: Ref
) -> dict[Ref, WorkerHandle]:
    """Start step ``step`` on every replica; returns each one's output ref."""
    last = len(rows) - 1
    return {
        w.actor.run_step.remote(step, inputs if s == 0 else None, labels if s == last else None): w
        for s, row in enumerate(rows)
        for w in row
    }
