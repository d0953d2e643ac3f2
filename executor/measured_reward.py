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

Stage actors are expensive to start (a process and a model each): the source keeps the
:class:`~executor.pipeline.Pipeline`\\ s of its last runs open and, when a plan has the same
stages (layers and devices) as an open one, only
:meth:`~executor.pipeline.Pipeline.reconfigure`\\ s it (other microbatches or schedule, fresh
weights); an open pipeline holding a device that another plan needs is closed first. It
needs a connected cluster (a :class:`~executor.local_cluster.LocalCluster`, or one joined
with :func:`executor.runtime.connect`) for its whole life, and is a context manager that
closes its pipelines.

**Several plans at once.** With ``concurrent`` on, the new plans of one call are grouped,
in order, into sets whose plans use pairwise disjoint devices (:func:`disjoint_groups`,
first fit), and the plans of a set run at the same time, each on its own pipeline driven
from its own thread; the sets run one after another. What a call returns (outcomes in the
plans' order, values, the cache) is what one plan at a time gives; failures in a row are
counted and ``on_outcome`` called set by set, in order within a set. On real devices
(separate machines or GPUs) plans on disjoint devices do not slow each other, and
evaluations per hour grow with the set size. On a cluster **emulated** on one machine every
device is the same few cores: concurrent plans then compete for them and for the object
store, and each one's measured batch time includes the others' load, so the default
(``concurrent=None``) is on unless the spec is emulated (:func:`concurrent_default`;
``bench/cluster_use.py`` measures both on ``local-hetero``).

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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import numpy as np

from pipeplan.agents.problem import Problem
from pipeplan.agents.rewards import Rewards, plans_of
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import Estimate, simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan
from pipeplan.executor import metrics, runtime
from pipeplan.executor.emulation import is_emulated
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.measure import Measurement, publish_errors
from pipeplan.executor.model import Batch, ModelSource
from pipeplan.executor.pinning import check_shares
from pipeplan.executor.pipeline import Pipeline, RunConfig, make_batches


@dataclass(frozen=True)
class Outcome:
    """What evaluating one plan gave: its value and measurement, or why it has none."""

    plan: Plan
    value: float
    measurement: Measurement | None = None
    error: str = ""
    seconds: float = 0.0
    """Wall time of the evaluation (actor start-up included)."""
    started: float = 0.0
    """When the run began (``time.time()``; 0 for a plan screened out without a run)."""


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


def disjoint_groups(devices: Sequence[frozenset[str]]) -> list[list[int]]:
    """Indices of ``devices`` (one device set per plan) grouped, first fit in order, into
    groups whose sets are pairwise disjoint; an empty set (a plan that will not run) joins
    the first group. Each group keeps its indices in order."""
    groups: list[tuple[list[int], set[str]]] = []
    for i, devs in enumerate(devices):
        for members, used in groups:
            if used.isdisjoint(devs):
                members.append(i)
                used.update(devs)
                break
        else:
            groups.append(([i], set(devs)))
    return [members for members, _ in groups]


def concurrent_default(cluster: ClusterSpec) -> bool:
    """Whether plans on disjoint devices run at once by default: not on a spec emulated on
    one machine (module docstring)."""
    return not is_emulated(cluster)


@dataclass(frozen=True)
class _Pending:
    """A plan to evaluate: its key, and its screening (an outcome when it will not run)."""

    key: str
    plan: Plan
    screened: Outcome | None
    estimate: Estimate | None
    screen_s: float


class MeasuredReward:
    """Runs each plan ``repeats`` times on the connected cluster; the value is the mean batch
    time (module docstring). ``config`` sets everything else about a run (data, optimizer,
    emulation, timeouts); its ``steps`` and ``warmup`` are replaced by ``repeats`` and
    ``warmup``. ``cluster`` is the live cluster's spec (the plans' devices run there).
    ``concurrent``: run new plans on disjoint devices at once (None: :func:`concurrent_default`
    of ``cluster``)."""

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
        concurrent: bool | None = None,
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
        self.concurrent = concurrent_default(cluster) if concurrent is None else concurrent
        self.pipelines_started = 0
        self._pipes: list[Pipeline] = []
        self._lock = threading.Lock()
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
        """Kill the open pipelines' actors (idempotent)."""
        with self._lock:
            pipes, self._pipes = self._pipes, []
        for pipe in pipes:
            pipe.close()

    def _close_overlapping(self, devices: set[str], keep: Sequence[Plan] = ()) -> None:
        """Close the open pipelines that hold one of ``devices``, except those with the
        stages of a plan of ``keep`` (they are about to be reused)."""
        with self._lock:
            closing = [
                p
                for p in self._pipes
                if not devices.isdisjoint(p.plan.devices)
                and not any(_same_stages(p.plan, k) for k in keep)
            ]
            self._pipes = [p for p in self._pipes if p not in closing]
        for pipe in closing:
            pipe.close()

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
        pending: dict[str, _Pending] = {}
        for plan in plans:
            key = plan_key(plan)
            if key not in self.outcomes and key not in pending:
                pending[key] = self._screen(key, plan, problem)
        todo = list(pending.values())
        if self.concurrent:
            sets = [frozenset() if p.screened else frozenset(p.plan.devices) for p in todo]
            groups = [[todo[i] for i in g] for g in disjoint_groups(sets)]
        else:
            groups = [[p] for p in todo]
        for group in groups:
            self._evaluate_group(group, problem)
        return [self.outcomes[plan_key(plan)] for plan in plans]

    def measurement(self, plan: Plan) -> Measurement | None:
        """The run of ``plan``, if it was evaluated and ran."""
        outcome = self.outcomes.get(plan_key(plan))
        return None if outcome is None else outcome.measurement

    @property
    def runs(self) -> int:
        """Plans actually run (cache hits and plans screened out not counted)."""
        return sum(o.measurement is not None for o in self.outcomes.values())

    # --- evaluating plans ---------------------------------------------------------------------

    def _screen(self, key: str, plan: Plan, problem: Problem | None) -> _Pending:
        """Whether ``plan`` will run: an outcome (``inf``, the reason) when it cannot share
        its microbatches or does not fit in memory by the cost model (with a problem)."""
        t0 = time.perf_counter()
        try:  # a property of the plan, not a failure of the cluster: not counted as one
            check_shares(plan)
        except PipeplanError as e:
            outcome = Outcome(plan, math.inf, error=str(e))
            return _Pending(key, plan, outcome, None, time.perf_counter() - t0)
        est = None
        if problem is not None:
            est = simulate(plan, problem.profile, self.cluster)
            if not est.fits:
                reason = "does not fit in memory (cost model): " + "; ".join(est.not_fitting)
                outcome = Outcome(plan, math.inf, error=reason)
                return _Pending(key, plan, outcome, est, time.perf_counter() - t0)
        return _Pending(key, plan, None, est, time.perf_counter() - t0)

    def _evaluate_group(self, group: Sequence[_Pending], problem: Problem | None) -> None:
        """Run the plans of ``group`` (disjoint devices) at once, then record every outcome
        in order."""
        running = [p for p in group if p.screened is None]
        devices = {d for p in running for d in p.plan.devices}
        self._close_overlapping(devices, keep=[p.plan for p in running])
        for p in running:  # built here, not in the threads: one model build per batch size
            self._batches_for(p.plan.global_batch, self.config.warmup + self.config.steps)
        if len(running) > 1:
            with ThreadPoolExecutor(len(running), thread_name_prefix="measured") as pool:
                runs = list(pool.map(self._timed_run, [p.plan for p in running]))
        else:
            runs = [self._timed_run(p.plan) for p in running]
        ran = dict(zip([p.key for p in running], runs, strict=True))
        for p in group:
            self._record(p, ran.get(p.key), problem)

    def _timed_run(self, plan: Plan) -> tuple[Measurement | Exception, float, float]:
        """``plan``'s measurement (or the error that ended it), start time and wall time."""
        started, t0 = time.time(), time.perf_counter()
        result: Measurement | Exception
        try:
            result = self._measure(plan)
        except (PipeplanError, ExecutorError) as e:
            result = e
        return result, started, time.perf_counter() - t0

    def _record(
        self,
        p: _Pending,
        run: tuple[Measurement | Exception, float, float] | None,
        problem: Problem | None,
    ) -> None:
        """Keep ``p``'s outcome (from its screening or its run), count it in the metrics and
        the failures in a row, and hand it to ``on_outcome``."""
        if run is None:
            assert p.screened is not None  # a plan not run was screened out
            metrics.measured_evaluation("screened", p.screen_s)
            outcome = p.screened
        else:
            outcome = self._outcome(p, *run, problem)
        self.outcomes[p.key] = outcome
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _outcome(
        self,
        p: _Pending,
        result: Measurement | Exception,
        started: float,
        seconds: float,
        problem: Problem | None,
    ) -> Outcome:
        if isinstance(result, Exception):
            self._close_overlapping(set(p.plan.devices))  # its actors' state is unknown
            self._failures_in_a_row += 1
            metrics.measured_evaluation("failed", seconds)
            reason = str(result).splitlines()[0] if str(result) else type(result).__name__
            if self._failures_in_a_row >= self.max_failures:
                raise ExecutorError(
                    f"measured reward: {self._failures_in_a_row} plans failed in a row; "
                    f"last: {reason}"
                ) from result
            return Outcome(p.plan, math.inf, error=reason, seconds=seconds, started=started)
        self._failures_in_a_row = 0
        metrics.measured_evaluation("ran", seconds)
        value = result.batch_time_s
        if problem is not None and p.estimate is not None:
            publish_errors(p.estimate, result, self.name)
            value = measured_value(problem, p.plan, value)
        return Outcome(p.plan, value, result, seconds=seconds, started=started)

    def _measure(self, plan: Plan) -> Measurement:
        """Run ``plan`` on the open pipeline with its stages (reconfigured), else on a new
        one; safe to call from several threads for plans on disjoint devices."""
        with self._lock:
            pipe = next((p for p in self._pipes if _same_stages(p.plan, plan)), None)
        if pipe is not None:
            pipe.reconfigure(plan, self.config)
        else:
            pipe = Pipeline(plan, self.model, self.cluster, self.config)
            pipe.start()  # cleans up after itself when it fails
            with self._lock:
                self._pipes.append(pipe)
                self.pipelines_started += 1
        count = self.config.warmup + self.config.steps
        batches = self._batches_for(plan.global_batch, count)
        return pipe.measure(batches, self.config.warmup)

    def _batches_for(self, global_batch: int, count: int) -> list[Batch]:
        if global_batch not in self._batches:
            self._batches[global_batch] = make_batches(self.model, global_batch, count, self.config)
        return self._batches[global_batch]
