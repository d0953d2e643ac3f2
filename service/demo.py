"""``pipeplan demo`` (what ``make demo`` runs): the whole main job on one emulated cluster.

1. Start ``local-hetero`` (a :class:`~executor.cluster.LocalCluster`: three Ray nodes on this
   machine); it stays up for every step below and is stopped at the end, whatever happens.
2. Measure the model's profile on it (:func:`executor.profiling.measure_profile`: an actor
   pinned to a device type times every layer) -> ``OUT/MODEL.profile.json``.
3. Plan with the cost model fed by that profile: the exact planners (``brute``, ``dp``), the
   learned one (``tapp``, a small number of iterations), the baseline planners ``uniform``
   and ``data_parallel`` (which also try fewer, faster devices), and TAPP's literal
   baselines on every device: ``pipe-torch-all`` (equal layer counts) and ``bsp-all`` (one
   stage replicated on every device).
4. Run every distinct plan for real on the cluster (:class:`executor.reward.MeasuredReward`:
   warm-up + ``steps`` training steps each; actors are reused when stages repeat).
5. Print one table (predicted vs measured batch time, their error, measured speed-up over
   ``bsp-all``, TAPP's reference, comm fraction, loss) and write ``OUT/demo.json``, every plan under
   ``OUT/plans/`` and the Gantt chart of the best planned plan, ``OUT/best.gantt.png``.

Numbers from ``local-hetero`` are EMULATED (every device is this machine's CPU; slower
types are slowed by sleeping) and the table says so. On this 2-core machine the default
(AlexNet at 64 x 64, batch 32) takes about 1-2 minutes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

if TYPE_CHECKING:
    from agents.problem import PlanResult, Problem
    from core.cluster import ClusterSpec
    from core.plan import Plan
    from core.profile import ModelProfile
    from executor.model import ModelSource
    from executor.reward import Outcome

EXACT = ("brute", "dp")
LEARNED = ("tapp",)
BASELINES = ("uniform", "data_parallel")
LITERAL = ("pipe-torch-all", "bsp-all")
"""TAPP's baselines as the paper ran them, on every device (``every_device``)."""
REFERENCE = "bsp-all"  # speed-ups are measured against it (TAPP's BSP)


@dataclass(frozen=True)
class Row:
    """One planner in the demo: its plan and the run of it, or why there is none."""

    planner: str
    result: PlanResult | None
    outcome: Outcome | None
    error: str = ""


def demo_command(
    model: Annotated[str, typer.Option(help="zoo model to profile, plan and run")] = "alexnet",
    input_size: Annotated[int | None, typer.Option(help="input height/width")] = 64,
    cluster: Annotated[str, typer.Option(help="cluster.yaml or a preset name")] = "local-hetero",
    batch: Annotated[int, typer.Option(help="global batch")] = 32,
    microbatches: Annotated[
        int | None, typer.Option(help="fix the number of microbatches (default: planners choose)")
    ] = None,
    steps: Annotated[int, typer.Option(help="measured steps per plan")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed steps per plan")] = 1,
    tapp_iterations: Annotated[int, typer.Option(help="TAPP's training iterations")] = 15,
    seed: Annotated[int, typer.Option(help="planner, weights and data seed")] = 0,
    out_dir: Annotated[Path, typer.Option("--out", help="where to write the results")] = Path(
        "build/demo"
    ),
) -> None:
    """The main job: local cluster, measured profile, planners, real runs, table, Gantt."""
    from executor.model import ModelSource
    from service.cli import err, load_cluster
    from service.run_cmd import live_cluster

    t0 = time.perf_counter()
    spec = load_cluster(cluster)
    source = ModelSource(model, input_size, seed=seed)
    source.build()  # a bad model name or size fails here, before the cluster starts
    (out_dir / "plans").mkdir(parents=True, exist_ok=True)
    with live_cluster(spec, None) as live:
        profile = demo_profile(source, live, batch, out_dir)
        problem = demo_problem(profile, live, batch, microbatches, seed)
        results = plan_all(problem, tapp_iterations)
        rows = run_all(results, source, live, profile, steps, warmup, seed)
    elapsed = time.perf_counter() - t0
    for r in rows:
        if r.result is not None:
            r.result.plan.save(out_dir / "plans" / f"{r.planner}.plan.json")
    best = best_planned(rows)
    gantt = out_dir / "best.gantt.png"
    if best is not None and best.result is not None:
        from service.gantt import draw_gantt

        draw_gantt(
            best.result.estimate,
            gantt,
            title=f"{model} on {spec.name}, best plan ({best.planner}): "
            f"{best.result.estimate.batch_time_s * 1e3:.1f} ms per batch (cost model)",
        )
    doc = demo_doc(problem, rows, elapsed)
    (out_dir / "demo.json").write_text(json.dumps(doc, indent=2))
    from executor.measure import EMULATED_NOTE
    from service.cli import out

    if any(r.outcome and r.outcome.measurement and r.outcome.measurement.emulated for r in rows):
        typer.echo(EMULATED_NOTE)
    out().print(demo_table(problem, rows))
    typer.echo(
        "error = (predicted - measured) / measured; speed-up = measured batch time of "
        f"{REFERENCE} / this plan's; comm = transfer / (transfer + compute), measured"
    )
    for r in rows:
        if r.error:
            typer.echo(f"{r.planner}: {r.error}")
    if best is not None:
        typer.echo(f"Gantt chart of the best plan ({best.planner}): {gantt}")
    typer.echo(f"results: {out_dir / 'demo.json'}, plans: {out_dir / 'plans'}")
    err.print(f"demo took {elapsed:.0f} s", markup=False, highlight=False)


# --- the steps ----------------------------------------------------------------------------------


def demo_profile(source: ModelSource, spec: ClusterSpec, batch: int, out_dir: Path) -> ModelProfile:
    """Step 2: the profile measured on the cluster at the sizes plans of ``batch`` run
    (:func:`executor.profiling.call_sizes`), saved."""
    from service.run_cmd import measure_on_cluster

    profile = measure_on_cluster(source, spec, global_batch=batch)
    profile.save(out_dir / f"{source.name}.profile.json")
    return profile


def demo_problem(
    profile: ModelProfile,
    spec: ClusterSpec,
    batch: int,
    microbatches: int | None,
    seed: int,
) -> Problem:
    """The planning problem: fastest batch; a budget that lets ``brute`` finish."""
    from agents.problem import Budget, Objective, Problem

    return Problem(
        profile,
        spec,
        objective=Objective.TIME,
        global_batch=batch,
        microbatches=microbatches,
        seed=seed,
        budget=Budget(evaluations=500_000, seconds=60.0),
    )


def plan_all(problem: Problem, tapp_iterations: int) -> list[tuple[str, PlanResult | str]]:
    """Step 3: each planner's plan, or its error."""
    from core.errors import PipeplanError
    from service.cli import err
    from service.plan_cmd import run_planner

    results: list[tuple[str, PlanResult | str]] = []
    for name in (*EXACT, *LEARNED, *BASELINES):
        options: dict[str, Any] = {"iterations": tapp_iterations} if name == "tapp" else {}
        try:
            result = run_planner(name, problem, **options)
        except PipeplanError as e:
            results.append((name, str(e)))
            continue
        err.print(
            f"planned with {name}: {result.estimate.batch_time_s * 1e3:.1f} ms predicted "
            f"({result.evaluations} evaluations, {result.wall_time_s:.1f} s)",
            markup=False,
            highlight=False,
        )
        results.append((name, result))
    results.extend(literal_baselines(problem))
    return results


def literal_baselines(problem: Problem) -> list[tuple[str, PlanResult | str]]:
    """TAPP's Pipe-Torch and BSP on every device (no search), as PlanResults."""
    from agents.baselines.every_device import bsp_all, pipe_torch_all
    from agents.problem import PlanResult
    from core.costmodel import simulate
    from core.errors import PipeplanError

    out: list[tuple[str, PlanResult | str]] = []
    for name, make in zip(LITERAL, (pipe_torch_all, bsp_all), strict=True):
        t0 = time.perf_counter()
        try:
            plan = make(problem)
        except PipeplanError as e:
            out.append((name, str(e)))
            continue
        est = simulate(plan, problem.profile, problem.cluster)
        seconds = time.perf_counter() - t0
        evaluations = len(problem.microbatch_sizes())
        out.append(
            (
                name,
                PlanResult(plan, est, problem.score_estimate(est), (), evaluations, seconds, name),
            )
        )
    return out


def run_all(
    results: Sequence[tuple[str, PlanResult | str]],
    source: ModelSource,
    spec: ClusterSpec,
    profile: ModelProfile,
    steps: int,
    warmup: int,
    seed: int,
) -> list[Row]:
    """Step 4: every distinct plan run once on the cluster (same stages: same actors)."""
    from executor.pipeline import RunConfig
    from executor.reward import MeasuredReward, plan_key
    from service.cli import err

    config = RunConfig(data="digits", seed=seed)
    plans = [r.plan for _, r in results if not isinstance(r, str)]
    with MeasuredReward(
        source, spec, repeats=steps, warmup=warmup, config=config, profile=profile,
        max_failures=len(plans) + 1,
    ) as reward:  # fmt: skip
        distinct = len({plan_key(p) for p in plans})
        with err.status(f"running {distinct} distinct plans: {warmup} + {steps} steps each"):
            reward.evaluate(_by_stages(plans))
    rows = []
    for name, r in results:
        if isinstance(r, str):
            rows.append(Row(name, None, None, f"no plan: {r}"))
            continue
        outcome = reward.outcomes[plan_key(r.plan)]
        failed = f"run failed: {outcome.error}" if outcome.error else ""
        rows.append(Row(name, r, outcome, failed))
    return rows


def _by_stages(plans: Sequence[Plan]) -> list[Plan]:
    """Plans ordered so that those with the same stages run one after the other."""
    key = {id(p): str([(s.layers, s.devices) for s in p.stages]) for p in plans}
    return sorted(plans, key=lambda p: key[id(p)])


def best_planned(rows: Sequence[Row]) -> Row | None:
    """The exact or learned planner's plan with the lowest predicted batch time."""
    planned = [r for r in rows if r.result is not None and r.planner in (*EXACT, *LEARNED)]
    return min(planned, key=lambda r: r.result.value if r.result else math.inf, default=None)


# --- the table ----------------------------------------------------------------------------------


def _measured(row: Row) -> float | None:
    m = row.outcome.measurement if row.outcome is not None else None
    return None if m is None else m.batch_time_s


def describe_plan(plan: Plan) -> str:
    """``[0,16) fast:0 x4 | [16,21) mid:0 x4`` (layers, devices, microbatches)."""
    parts = []
    for i, s in enumerate(plan.stages):
        devices = "+".join(d.split("/", 1)[1] for d in s.devices)
        parts.append(f"[{s.start},{s.end}) {devices} x{plan.microbatches(i)}")
    return " | ".join(parts)


def demo_table(problem: Problem, rows: Sequence[Row]) -> Table:
    from service.run_cmd import pct

    ref = next((r for r in rows if r.planner == REFERENCE), None)
    ref_time = _measured(ref) if ref is not None else None
    best = best_planned(rows)
    emulated = any(
        r.outcome and r.outcome.measurement and r.outcome.measurement.emulated for r in rows
    )
    title = (
        f"{problem.profile.name} on {problem.cluster.name}, batch {problem.global_batch}: "
        f"cost model vs measured{' (EMULATED)' if emulated else ''}"
    )
    table = Table(title=title, title_justify="left")
    for col in (
        "planner",
        "plan (layers devices xmicrobatches)",
        "predicted ms",
        "measured ms",
        "error",
        f"speed-up vs {REFERENCE}",
        "comm",
        "loss",
    ):
        table.add_column(col, justify="left" if col.startswith("pla") else "right")
    for r in rows:
        if r.result is None:
            table.add_row(r.planner, "[dim]no plan[/dim]", *["-"] * 6)
            continue
        predicted = r.result.estimate.batch_time_s
        m = r.outcome.measurement if r.outcome is not None else None
        name = f"{r.planner} (best)" if r is best else r.planner
        if m is None:
            table.add_row(name, describe_plan(r.result.plan), f"{predicted * 1e3:.1f}",
                          "[red]failed[/red]", *["-"] * 4)  # fmt: skip
            continue
        speedup = f"{ref_time / m.batch_time_s:.2f}x" if ref_time else "-"
        table.add_row(
            name,
            describe_plan(r.result.plan),
            f"{predicted * 1e3:.1f}",
            f"{m.batch_time_s * 1e3:.1f} ± {m.batch_time_std_s * 1e3:.1f}",
            pct(predicted, m.batch_time_s),
            speedup,
            f"{m.comm_fraction:.2f}",
            f"{m.losses[-1]:.3f}",
        )
    return table


def demo_doc(problem: Problem, rows: Sequence[Row], elapsed: float) -> dict[str, Any]:
    docs = []
    for r in rows:
        d: dict[str, Any] = {"planner": r.planner, "error": r.error or None}
        if r.result is not None:
            d["plan"] = r.result.plan.to_dict()
            d["predicted"] = r.result.estimate.to_dict()
        m = r.outcome.measurement if r.outcome is not None else None
        d["measured"] = None if m is None else m.to_dict()
        docs.append(d)
    best = best_planned(rows)
    return {
        "model": problem.profile.name,
        "cluster": problem.cluster.name,
        "global_batch": problem.global_batch,
        "best": None if best is None else best.planner,
        "reference": REFERENCE,
        "seconds": elapsed,
        "rows": docs,
    }
