"""``MeasuredReward``: a planner's reward measured for real, one run of each plan on the cluster.

A :class:`MeasuredReward` is a reward source (:class:`agents.rewards.RewardSource`: plans in,
objective values out, lower is better, ``inf`` for a plan that cannot run), so any planner can
be valued by runs: ``make_planner("tapp", reward=MeasuredReward(...))``. For each plan it never
saw it trains ``warmup`` + ``repeats`` global batches on the connected Ray cluster and takes
the mean batch time of the ``repeats`` measured ones (TAPP averages repeated runs of one
training step); the value is that time scored for the problem's objective
(:func:`measured_value`: the batch time for ``time``, $ per sample under the throughput floor
for ``cost``). Values are cached by plan, so a plan is run once however often it is sampled:
use one source per problem. :meth:`MeasuredReward.run` runs plans without a search (their
value is then the batch time).

Stage actors are expensive to start (a process and a model each): the source keeps one
:class:`~executor.pipeline.Pipeline` open and, when the next plan has the same stages (layers
and devices), only :meth:`~executor.pipeline.Pipeline.reconfigure`\\ s it (other microbatches
or schedule, fresh weights); any other plan closes it and starts a new one. It needs a
connected cluster (a :class:`~executor.local_cluster.LocalCluster`, or one joined with
:func:`executor.runtime.connect`) for its whole life, and is a context manager that closes
its pipeline.

A plan that fails (refused by the live cluster, a stage that raised, a timeout) is worth
``inf`` and its reason is kept in :attr:`outcomes` and handed to the search (which quotes it
when nothing ran); plans the cost model says do not fit in memory (on the problem's profile),
and plans with fewer samples in a microbatch than replicas to share it, are ``inf`` without a
run. ``max_failures`` plans failing in a row end the search with an
:class:`~executor.errors.ExecutorError` instead: a broken cluster should not read as a search
space without feasible plans.

Every plan valued goes to Ray's metrics (:mod:`executor.metrics`): its outcome and wall
time and, for a plan that ran for a problem, the cost model's error on it (with the
problem's profile) as ``source="measured"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np

from agents.problem import Problem
from agents.rewards import Rewards, plans_of
from core.batch_eval import PlanBatch
from core.cluster import ClusterSpec
from core.costmodel import simulate
from core.errors import PipeplanError
from core.plan import Plan
from executor import metrics, runtime
from executor.errors import ExecutorError
from executor.measure import Measurement, publish_errors
from executor.model import Batch, ModelSource
from executor.pinning import check_shares
from executor.pipeline import Pipeline, RunConfig, make_batches


@dataclass(frozen=True)
class Outcome:
    """What evaluating one plan gave: its value and measurement, or why it has none."""

    plan: Plan
    value: float
    measurement: Measurement | None = None
    error: str = ""
    seconds: float = 0.0
    """Wall time of the evaluation (actor start-up included)."""


def plan_key(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), sort_keys=True)


def measured_value(problem: Problem, plan: Plan, batch_time: float) -> float:
    """``problem``'s objective value of ``plan`` from its measured mean batch time (seconds):
    the plan ran, so it fits; its price is that of its devices in ``problem``'s cluster."""
    cluster = problem.cluster
    price = sum(cluster.device_type(d).price_per_hour for d in plan.devices)
    return float(problem.score(np.array([batch_time]), np.array([True]), np.array([price]))[0])


def _same_stages(a: Plan, b: Plan) -> bool:
    return [(s.layers, s.devices) for s in a.stages] == [(s.layers, s.devices) for s in b.stages]


class MeasuredReward:
    """Runs each plan ``repeats`` times on the connected cluster; the value is the mean batch
    time (module docstring). ``config`` sets everything else about a run (data, optimizer,
    emulation, timeouts); its ``steps`` and ``warmup`` are replaced by ``repeats`` and
    ``warmup``. ``cluster`` is the live cluster's spec (the plans' devices run there)."""

    name = "measured"

    def __init__(
        self,
        model: ModelSource,
        cluster: ClusterSpec,
        *,
        repeats: int = 3,
        warmup: int = 1,
        config: RunConfig | None = None,
        max_failures: int = 3,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> None:
        if repeats < 1 or warmup < 0 or max_failures < 1:
            raise PipeplanError(
                f"measured reward: repeats >= 1, warmup >= 0 and max_failures >= 1 needed, "
                f"got {repeats}, {warmup}, {max_failures}"
            )
        self.model, self.cluster = model, cluster
        self.config = dataclasses.replace(config or RunConfig(), steps=repeats, warmup=warmup)
        self.max_failures = max_failures
        self.on_outcome = on_outcome
        self.outcomes: dict[str, Outcome] = {}
        self.pipelines_started = 0
        self._pipe: Pipeline | None = None
        self._batches: dict[int, list[Batch]] = {}
        self._failures_in_a_row = 0

    # --- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> MeasuredReward:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill the open pipeline's actors (idempotent)."""
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    # --- the reward source ------------------------------------------------------------------

    def evaluate(self, problem: Problem, batch: PlanBatch) -> Rewards:
        """One value per plan of ``batch``, in order; plans seen before come from the cache."""
        outcomes = self.run(plans_of(problem, batch), problem)
        return Rewards(
            values=np.array([o.value for o in outcomes], dtype=np.float64),
            errors=tuple(dict.fromkeys(o.error for o in outcomes if o.error)),
        )

    def run(self, plans: Sequence[Plan], problem: Problem | None = None) -> list[Outcome]:
        """The outcome of each plan, in order, running the plans never seen. With a
        ``problem``, plans that do not fit its profile (cost model) are not run, and values
        are its objective's; without one, a value is the mean batch time."""
        if not runtime.is_connected():
            raise ExecutorError(
                "measured reward: not connected to a Ray cluster; start or join one first "
                "(executor.local_cluster.LocalCluster or executor.runtime.connect)"
            )
        out = []
        for plan in plans:
            key = plan_key(plan)
            if key not in self.outcomes:
                self.outcomes[key] = self._evaluate(plan, problem)
                if self.on_outcome is not None:
                    self.on_outcome(self.outcomes[key])
            out.append(self.outcomes[key])
        return out

    def measurement(self, plan: Plan) -> Measurement | None:
        """The run of ``plan``, if it was evaluated and ran."""
        outcome = self.outcomes.get(plan_key(plan))
        return None if outcome is None else outcome.measurement

    @property
    def runs(self) -> int:
        """Plans actually run (cache hits and plans screened out not counted)."""
        return sum(o.measurement is not None for o in self.outcomes.values())

    # --- one plan ---------------------------------------------------------------------------

    def _evaluate(self, plan: Plan, problem: Problem | None) -> Outcome:
        t0 = time.perf_counter()
        try:  # a property of the plan, not a failure of the cluster: not counted as one
            check_shares(plan)
        except PipeplanError as e:
            metrics.measured_evaluation("screened", time.perf_counter() - t0)
            return Outcome(plan, math.inf, error=str(e))
        est = None
        if problem is not None:
            est = simulate(plan, problem.profile, self.cluster)
            if not est.fits:
                metrics.measured_evaluation("screened", time.perf_counter() - t0)
                reason = "does not fit in memory (cost model): " + "; ".join(est.not_fitting)
                return Outcome(plan, math.inf, error=reason)
        try:
            measured = self._measure(plan)
        except (PipeplanError, ExecutorError) as e:
            self.close()  # the actors' state is unknown after a failure
            self._failures_in_a_row += 1
            metrics.measured_evaluation("failed", time.perf_counter() - t0)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if self._failures_in_a_row >= self.max_failures:
                raise ExecutorError(
                    f"measured reward: {self._failures_in_a_row} plans failed in a row; "
                    f"last: {reason}"
                ) from e
            return Outcome(plan, math.inf, error=reason, seconds=time.perf_counter() - t0)
        self._failures_in_a_row = 0
        seconds = time.perf_counter() - t0
        metrics.measured_evaluation("ran", seconds)
        value = measured.batch_time_s
        if problem is not None and est is not None:
            publish_errors(est, measured, self.name)
            value = measured_value(problem, plan, value)
        return Outcome(plan, value, measured, seconds=seconds)

    def _measure(self, plan: Plan) -> Measurement:
        if self._pipe is not None and _same_stages(self._pipe.plan, plan):
            self._pipe.reconfigure(plan, self.config)
        else:
            self.close()
            pipe = Pipeline(plan, self.model, self.cluster, self.config)
            pipe.start()  # cleans up after itself when it fails
            self._pipe = pipe
            self.pipelines_started += 1
        count = self.config.warmup + self.config.steps
        batches = self._batches_for(plan.global_batch, count)
        return self._pipe.measure(batches, self.config.warmup)

    def _batches_for(self, global_batch: int, count: int) -> list[Batch]:
        if global_batch not in self._batches:
            self._batches[global_batch] = make_batches(self.model, global_batch, count, self.config)
        return self._batches[global_batch]
