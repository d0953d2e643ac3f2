"""The ``demo`` use-case (what ``make demo`` runs): the whole main job on one emulated
cluster.

1. Start the cluster (``local-pipeline`` by default: three Ray nodes on this machine, six
   devices of three speeds, fast:mid:slow = 4:3:2); it stays up for every step below and is
   stopped at the end, whatever happens.
2. Measure the model's profile on it (actors pinned to each device type time every layer).
3. Plan with the cost model fed by that profile: the exact planners (``brute``, at most
   :data:`BRUTE_MAX_STAGES` stages; ``dp``), the learned one (``tapp``, a few iterations), the
   baselines ``uniform`` and ``data_parallel`` (which also try fewer, faster devices), the
   best single device (``single-device``: each type alone, the best microbatch) and TAPP's
   baselines on every device: ``pipe-torch-all`` (equal layer counts) and ``bsp-all`` (one
   stage replicated on every device, the reference of the speed-ups).
4. Run every distinct plan for real on the cluster (warm-up + ``steps`` training steps each;
   actors are reused when stages repeat).

With ``calibrate``, between steps 2 and 3: run ``pipeplan calibrate``'s probe plans
(:func:`executor.calibrate.probe_plans`) on the cluster, fit the calibration to them
(:func:`executor.calibrate.fit`: per-type call overheads, links, all-reduce, updates) and
plan on the calibrated cluster, as a user who calibrated first would. The plans' errors are
then held out: a plan that is also a probe (a type alone, BSP on every device) was fitted on
and is left out of the median.

The default, AlexNet at 224 x 224 with a batch of 32, is where planning pays on
``local-pipeline``: its convolutions are most of the work and split well over the three
``mid`` devices as replicas, while its classifier (most of the weights, a large fixed cost
per call) stays on ``fast``; that plan is predicted ~1.6x faster than ``fast`` alone and
~2.5x faster than BSP on every device (see the README's demo section for a measured run).

Numbers from an emulated cluster are EMULATED (every device is this machine's CPU; slower
types are slowed by sleeping). How long it takes: see bench/results and the README.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeplan.agents.baselines.every_device import bsp_all, pipe_torch_all
from pipeplan.agents.compare import Entry, Row, fixed_plan_row, run_comparison
from pipeplan.agents.problem import Budget, InfeasibleError, Objective, PlanResult, Problem
from pipeplan.agents.registry import make_planner
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.observations import Observation
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.calibrate import fit, probe_plans
from pipeplan.executor.measure import relative_error
from pipeplan.executor.measured_reward import MeasuredReward, Outcome, plan_key
from pipeplan.executor.model import ModelSource
from pipeplan.executor.pipeline import RunConfig
from pipeplan.service.tasks.calibrate import CalibrateRequest, ProbeRun, measure_probes
from pipeplan.service.tasks.common import ClusterRef, Request, cluster_spec
from pipeplan.service.tasks.live import live_cluster, measure_on_cluster
from pipeplan.service.tasks.progress import QUIET, Reporter

EXACT = ("brute", "dp")
LEARNED = ("tapp",)
BASELINES = ("uniform", "data_parallel")
REFERENCE = "bsp-all"
"""Speed-ups are measured against it (TAPP's BSP)."""
SINGLE = "single-device"
"""The row of the best single device: what planning must beat to pay."""
DEMO_BUDGET = Budget(evaluations=500_000, seconds=60.0)
"""A budget that lets ``brute`` finish on the demo's models."""
BRUTE_MAX_STAGES = 3
"""``brute`` enumerates plans of at most this many stages: on six devices every stage count
is ~16 million plans (about a minute), three stages ~400,000 (about a second); ``dp`` and
``tapp`` still search every stage count."""


class DemoRequest(Request):
    """The model to profile, plan and run, the cluster, and the size of the job."""

    model: str = "alexnet"
    input_size: int | None = 224
    cluster: ClusterRef = "local-pipeline"
    batch: int = 32
    microbatches: int | None = None
    steps: int = 5
    warmup: int = 1
    tapp_iterations: int = 15
    seed: int = 0
    calibrate: bool = False


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
    probes: tuple[ProbeRun, ...] = ()
    """The probe plans the cluster was calibrated to before planning (``calibrate``), each
    with its measured batch time; every one was fitted on."""

    @property
    def best(self) -> DemoRow | None:
        """The exact or learned planner's plan with the lowest predicted batch time."""
        planned = [r for r in self.rows if r.result is not None and r.planner in (*EXACT, *LEARNED)]
        return min(planned, key=lambda r: r.result.value if r.result else math.inf, default=None)

    def row(self, planner: str) -> DemoRow | None:
        return next((r for r in self.rows if r.planner == planner), None)

    def speedup(self, over: str) -> float | None:
        """Measured batch time of the row ``over`` divided by the best plan's (``None`` when
        either was not measured)."""
        best, other = self.best, self.row(over)
        a = other.measured_s if other is not None else None
        b = best.measured_s if best is not None else None
        return None if a is None or b is None or b <= 0 else a / b

    @property
    def emulated(self) -> bool:
        return any(r.outcome and r.outcome.measurement and r.outcome.measurement.emulated
                   for r in self.rows)  # fmt: skip

    def errors(self) -> dict[str, float]:
        """Each measured plan's ``(predicted - measured) / measured``, by planner (a plan
        several planners chose counts once, under the first; a plan that was also a probe
        the calibration was fitted to is left out)."""
        out: dict[str, float] = {}
        seen: set[str] = {plan_key(p.plan) for p in self.probes}
        for r in self.rows:
            m = r.outcome.measurement if r.outcome is not None else None
            if r.result is None or m is None or plan_key(r.result.plan) in seen:
                continue
            seen.add(plan_key(r.result.plan))
            out[r.planner] = relative_error(r.result.estimate.batch_time_s, m.batch_time_s)
        return out

    def fidelity(self) -> dict[str, Any]:
        """How well the cost model predicted this run: calibrated or not, the median
        ``|error|`` over the distinct plans measured, and the best plan's error."""
        errors = self.errors()
        best = self.best
        cal = self.problem.cluster.calibration
        return {
            "calibrated": cal is not None,
            "calibration_fit": dict(cal.fit) if cal is not None else None,
            "calibrated_by_demo_probes": len(self.probes),
            "median_abs_error": statistics.median(abs(e) for e in errors.values())
            if errors
            else None,
            "best_error": errors.get(best.planner) if best is not None else None,
            "plans": len(errors),
        }

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
            "speedup_over_reference": self.speedup(REFERENCE),
            "speedup_over_single_device": self.speedup(SINGLE),
            "fidelity": self.fidelity(),
            "seconds": self.seconds,
            "probes": [
                {
                    "plan": p.plan.to_dict(),
                    "measured_batch_time_s": p.batch_time_s,
                    "predicted_uncalibrated_s": simulate(
                        p.plan, self.problem.profile, self.problem.cluster.calibrated(None)
                    ).batch_time_s,
                    "predicted_s": simulate(
                        p.plan, self.problem.profile, self.problem.cluster
                    ).batch_time_s,
                }
                for p in self.probes
            ],
            "rows": docs,
        }


def best_single_device(problem: Problem) -> Plan:
    """The whole model on one device: one device of each type, every allowed microbatch, the
    best by the cost model among those that fit (:class:`InfeasibleError` when none does)."""
    spec, n = problem.cluster, len(problem.profile)
    one_per_type = {spec.device_type(d).name: d for d in reversed(spec.device_ids)}
    scored = []
    for device in one_per_type.values():
        for m in problem.microbatch_sizes():
            plan = Plan(problem.global_batch, (Stage((0, n), (device,), m),), problem.schedule)
            est = simulate(plan, problem.profile, spec)
            value = problem.score_estimate(est)
            if est.fits and value != math.inf:
                scored.append((value, plan))
    if not scored:
        raise InfeasibleError(f"{SINGLE}: the model fits on no single device of {spec.name!r}")
    return min(scored, key=lambda vp: vp[0])[1]


def plan_all(problem: Problem, tapp_iterations: int, reporter: Reporter) -> list[Row]:
    """Step 3: each planner's plan, or its error; then the best single device and TAPP's
    every-device baselines."""

    def run(entry: Entry, p: Problem) -> PlanResult:
        with reporter.search(entry.label, p.budget.evaluations) as progress:
            result = make_planner(entry.planner, **entry.options).plan(p, progress=progress)
        reporter.note(
            f"planned with {entry.label}: {result.estimate.batch_time_s * 1e3:.1f} ms "
            f"predicted ({result.evaluations} evaluations, {result.wall_time_s:.1f} s)"
        )
        return result

    options: dict[str, dict[str, Any]] = {
        "brute": {"max_stages": BRUTE_MAX_STAGES},
        "tapp": {"iterations": tapp_iterations},
    }
    entries = [Entry(n, n, options.get(n, {})) for n in (*EXACT, *LEARNED, *BASELINES)]
    rows = run_comparison(problem, entries, run, catch_bugs=False)
    rows.append(fixed_plan_row(SINGLE, problem, best_single_device))
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


def calibrate_on_probes(
    live: ClusterSpec,
    source: ModelSource,
    profile: ModelProfile,
    request: DemoRequest,
    reporter: Reporter,
) -> tuple[ClusterSpec, tuple[ProbeRun, ...]]:
    """``live`` calibrated to the probe plans run on it (module docstring), and the probes
    as measured. Each probe runs ``pipeplan calibrate``'s steps (fewer if the demo's are)."""
    plans = probe_plans(live, profile, request.batch)
    steps = min(request.steps, CalibrateRequest.model_fields["steps"].default)
    config = RunConfig(steps=steps, warmup=request.warmup, data="digits", seed=request.seed)
    runs = measure_probes(plans, source, live, config, reporter)
    observations = [Observation.of(m, profile) for m in runs]
    record = {
        "model": profile.name,
        "by": "pipeplan demo --calibrate",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    calibrated = live.calibrated(fit(live, observations, record).calibration)
    reporter.note(f"calibrated to {len(runs)} probe runs; planning on the calibrated cluster")
    probes = tuple(
        ProbeRun(plan, m.batch_time_s, m.batch_time_std_s, held_out=False)
        for plan, m in zip(plans, runs, strict=True)
    )
    return calibrated, probes


def demo(request: DemoRequest, reporter: Reporter = QUIET) -> Demo:
    """Steps 1-4 (module docstring)."""
    t0 = time.perf_counter()
    spec = cluster_spec(request.cluster)
    source = ModelSource(request.model, request.input_size, seed=request.seed)
    source.build()  # a bad model name or size fails here, before the cluster starts
    probes: tuple[ProbeRun, ...] = ()
    with live_cluster(spec, None, reporter) as live:
        profile = measure_on_cluster(source, live, reporter, global_batch=request.batch)
        if request.calibrate:
            live, probes = calibrate_on_probes(live, source, profile, request, reporter)
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
    return Demo(problem, demo_rows, time.perf_counter() - t0, probes)
