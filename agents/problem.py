"""What a planner is asked (:class:`Problem`) and what it answers (:class:`PlanResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import Estimate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.limits import MAX_GLOBAL_BATCH, check_limit
from pipeplan.core.objective import Objective, score
from pipeplan.core.plan import Plan, Schedule
from pipeplan.core.profile import ModelProfile


class ProblemError(PipeplanError):
    """A problem is malformed (bad batch, budget, objective options)."""


class InfeasibleError(PipeplanError):
    """No plan satisfies the problem; the message says why (memory, throughput target)."""


@dataclass(frozen=True)
class Budget:
    """Search budget: plan evaluations and/or wall seconds (whichever runs out first)."""

    evaluations: int | None = 20_000
    seconds: float | None = 60.0

    def __post_init__(self) -> None:
        if self.evaluations is not None and self.evaluations < 1:
            raise ProblemError(f"budget.evaluations: must be >= 1, got {self.evaluations}")
        if self.seconds is not None and not self.seconds > 0:
            raise ProblemError(f"budget.seconds: must be > 0, got {self.seconds}")


@dataclass(frozen=True)
class Problem:
    """One planning problem. Validated on construction, before any search runs."""

    profile: ModelProfile
    cluster: ClusterSpec
    objective: Objective = Objective.TIME
    global_batch: int = 64
    schedule: Schedule = Schedule.GPIPE
    microbatches: int | None = None  # fixed microbatch count M; None = planner chooses
    min_throughput: float | None = None  # samples/s, for the cost objective
    seed: int = 0
    budget: Budget = field(default_factory=Budget)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective(self.objective))
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if (
            isinstance(self.global_batch, bool)
            or not isinstance(self.global_batch, int)
            or self.global_batch < 1
        ):
            raise ProblemError(f"global_batch: must be an integer >= 1, got {self.global_batch!r}")
        check_limit("global_batch", self.global_batch, MAX_GLOBAL_BATCH, "samples", ProblemError)
        if self.microbatches is not None and (
            self.microbatches < 1 or self.global_batch % self.microbatches
        ):
            raise ProblemError(
                f"microbatches: {self.microbatches} does not divide global_batch "
                f"{self.global_batch}"
            )
        if self.min_throughput is not None and self.min_throughput < 0:
            raise ProblemError(f"min_throughput: must be >= 0, got {self.min_throughput}")
        if self.objective is not Objective.COST and self.min_throughput is not None:
            raise ProblemError(
                f"min_throughput: only applies to the cost objective, not {self.objective.value!r}"
            )

    def microbatch_sizes(self) -> list[int]:
        """Allowed per-stage microbatch sizes: divisors of the batch, or the fixed one."""
        if self.microbatches is not None:
            return [self.global_batch // self.microbatches]
        return [d for d in range(1, self.global_batch + 1) if self.global_batch % d == 0]

    def score(self, batch_time: np.ndarray, fits: np.ndarray, price: np.ndarray) -> np.ndarray:
        """Objective value per plan, lower is better; ``inf`` when infeasible
        (:func:`core.objective.score` with this problem's batch and throughput floor)."""
        return score(
            self.objective,
            batch_time,
            fits,
            price,
            global_batch=self.global_batch,
            min_throughput=self.min_throughput,
        )

    def score_estimate(self, est: Estimate) -> float:
        return float(
            self.score(
                np.array([est.batch_time_s]), np.array([est.fits]), np.array([est.cost_per_hour])
            )[0]
        )


@dataclass(frozen=True)
class HistoryPoint:
    """The best objective value after ``evaluations`` plans and ``seconds`` of search."""

    evaluations: int
    seconds: float
    best: float


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    estimate: Estimate
    value: float  # objective value of the plan (see Problem.score)
    history: tuple[HistoryPoint, ...]
    evaluations: int
    wall_time_s: float
    planner: str
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "planner": self.planner,
            "options": self.options,
            "plan": self.plan.to_dict(),
            "estimate": self.estimate.to_dict(),
            "value": self.value,
            "evaluations": self.evaluations,
            "wall_time_s": self.wall_time_s,
            "history": [h.__dict__ for h in self.history],
        }
