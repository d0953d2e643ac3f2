"""The ``demo`` use-case (what ``make demo`` runs): the whole main job on one emulated
cluster.

1. Start the cluster (``local-hetero`` by default: three Ray nodes on this machine); it stays
   up for every step below and is stopped at the end, whatever happens.
2. Measure the model's profile on it (actors pinned to each device type time every layer).
3. Plan with the cost model fed by that profile: the exact planners (``brute``, ``dp``), the
   learned one (``tapp``, a few iterations), the baselines ``uniform`` and ``data_parallel``
   (which also try fewer, faster devices), and TAPP's baselines on every device:
   ``pipe-torch-all`` (equal layer counts) and ``bsp-all`` (one stage replicated on every
   device, the reference of the speed-ups).
4. Run every distinct plan for real on the cluster (warm-up + ``steps`` training steps each;
   actors are reused when stages repeat).

Numbers from an emulated cluster are EMULATED (every device is this machine's CPU; slower
types are slowed by sleeping). How long it takes: see bench/results and the README.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agents.baselines.every_device import bsp_all, pipe_torch_all
from agents.compare import Entry, Row, fixed_plan_row, run_comparison
from agents.problem import Budget, Objective, PlanResult, Problem
from agents.registry import make_planner
from core.plan import Plan
from executor.measured_reward import MeasuredReward, Outcome, plan_key
from executor.model import ModelSource
from executor.pipeline import RunConfig
from service.tasks.common import ClusterRef, Request, cluster_spec
from service.tasks.live import live_cluster, measure_on_cluster
from service.tasks.progress import QUIET, Reporter

EXACT = ("brute", "dp")
LEARNED = ("tapp",)
BASELINES = ("uniform", "data_parallel")
REFERENCE = "bsp-all"
"""Speed-ups are measured against it (TAPP's BSP)."""
DEMO_BUDGET = Budget(evaluations=500_000, seconds=60.0)
"""A budget that lets ``brute`` finish on the demo's models."""


class DemoRequest(Request):
    """The model to profile, plan and run, the cluster, and the size of the job."""

    model: str = "alexnet"
    input_size: int | None = 64
    cluster: ClusterRef = "local-hetero"
    batch: int = 32
    microbatches: int | None = None
    steps: int = 5
    warmup: int = 1
    tapp_iterations: int = 15
    seed: int = 0


@dataclass(frozen=True)
class DemoRow:
    """One planner in the demo: its plan and the run of it, or why there is none."""

    planner: str
    result: PlanResult | None
    outcome: Outcome | None
    error: str = ""

    @property
    def measured_s(self) -> float | None:
        m = self.outcome.measurement if self.outcome is not None else None
        return None if m is None else m.batch_time_s


@dataclass(frozen=True)
class Demo:
    """The demo's problem, its measured profile, one row per planner, and its wall time."""

    problem: Problem
    rows: list[DemoRow]
    seconds: float

    @property
    def best(self) -> DemoRow | None:
        """The exact or learned planner's plan with the lowest predicted batch time."""
        planned = [r for r in self.rows if r.result is not None and r.planner in (*EXACT, *LEARNED)]
        return min(planned, key=lambda r: r.result.value if r.result else math.inf, default=None)

    @property
    def emulated(self) -> bool:
        return any(r.outcome and r.outcome.measurement and r.outcome.measurement.emulated
                   for r in self.rows)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """``demo.json``: every row's plan, prediction and measurement."""
        docs = []
        for r in self.rows:
            d: dict[str, Any] = {"planner": r.planner, "error": r.error or None}
            if r.result is not None:
                d["plan"] = r.result.plan.to_dict()
                d["predicted"] = r.result.estimate.to_dict()
            m = r.outcome.measurement if r.outcome is not None else None
            d["measured"] = None if m is None else m.to_dict()
            docs.append(d)
        best = self.best
        return {
            "model": self.problem.profile.name,
            "cluster": self.problem.cluster.name,
            "global_batch": self.problem.global_batch,
            "best": None if best is None else best.planner,
            "reference": REFERENCE,
            "seconds": self.seconds,
            "rows": docs,
        }


def plan_all(problem: Problem, tapp_iterations: int, reporter: Reporter) -> list[Row]:
    """Step 3: each planner's plan, or its error; then TAPP's every-device baselines."""

    def run(entry: Entry, p: Problem) -> PlanResult:
        with reporter.search(entry.label, p.budget.evaluations) as progress:
            result = make_planner(entry.planner, **entry.options).plan(p, progress=progress)
        reporter.note(
            f"planned with {entry.label}: {result.estimate.batch_time_s * 1e3:.1f} ms "
            f"predicted ({result.evaluations} evaluations, {result.wall_time_s:.1f} s)"
        )
        return result

    entries = [Entry(n, n, {"iterations": tapp_iterations} if n == "tapp" else {})
               for n in (*EXACT, *LEARNED, *BASELINES)]  # fmt: skip
    rows = run_comparison(problem, entries, run, catch_bugs=False)
    rows.append(fixed_plan_row("pipe-torch-all", problem, pipe_torch_all))
    rows.append(fixed_plan_row(REFERENCE, problem, bsp_all))
    return rows


def _by_stages(plans: Sequence[Plan]) -> list[Plan]:
    """Plans ordered so that those with the same stages run one after the other."""
    key = {id(p): str([(s.layers, s.devices) for s in p.stages]) for p in plans}
    return sorted(plans, key=lambda p: key[id(p)])


def run_all(
    rows: Sequence[Row],
    source: ModelSource,
    problem: Problem,
    request: DemoRequest,
    reporter: Reporter,
) -> list[DemoRow]:
    """Step 4: every distinct plan run once on the cluster (same stages: same actors); plans
    the cost model says do not fit are not run."""
    spec = problem.cluster
    config = RunConfig(data="digits", seed=request.seed)
    plans = [r.result.plan for r in rows if r.result is not None]
    steps, warmup = request.steps, request.warmup
    with MeasuredReward(
        source, spec, repeats=steps, warmup=warmup, config=config, max_failures=len(plans) + 1
    ) as reward:
        distinct = len({plan_key(p) for p in plans})
        with reporter.step(f"running {distinct} distinct plans: {warmup} + {steps} steps each"):
            reward.run(_by_stages(plans), problem)
    out = []
    for r in rows:
        if r.result is None:
            out.append(DemoRow(r.planner, None, None, f"no plan: {r.error}"))
            continue
        outcome = reward.outcomes[plan_key(r.result.plan)]
        failed = f"run failed: {outcome.error}" if outcome.error else ""
        out.append(DemoRow(r.planner, r.result, outcome, failed))
    return out


def demo(request: DemoRequest, reporter: Reporter = QUIET) -> Demo:
    """Steps 1-4 (module docstring)."""
    t0 = time.perf_counter()
    spec = cluster_spec(request.cluster)
    source = ModelSource(request.model, request.input_size, seed=request.seed)
    source.build()  # a bad model name or size fails here, before the cluster starts
    with live_cluster(spec, None, reporter) as live:
        profile = measure_on_cluster(source, live, reporter, global_batch=request.batch)
        problem = Problem(
            profile,
            live,
            objective=Objective.TIME,
            global_batch=request.batch,
            microbatches=request.microbatches,
            seed=request.seed,
            budget=DEMO_BUDGET,
        )
        rows = plan_all(problem, request.tapp_iterations, reporter)
        demo_rows = run_all(rows, source, problem, request, reporter)
    return Demo(problem, demo_rows, time.perf_counter() - t0)
