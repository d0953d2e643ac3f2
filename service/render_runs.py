"""Rich tables and text lines for real runs: a run beside its prediction, the demo (a
measured search's lines are :func:`service.render.measured_lines`). Every number from an
emulated cluster is marked EMULATED."""

from __future__ import annotations

from rich.table import Table

from pipeplan.core.plan import Plan
from pipeplan.executor.measure import Comparison
from pipeplan.executor.measured_reward import plan_key
from pipeplan.service.device_groups import IDS_UP_TO, compact, stage_labels
from pipeplan.service.render import pct
from pipeplan.service.tasks.demo import REFERENCE, Demo, DemoRow


def run_table(c: Comparison) -> Table:
    """Predicted, measured and their error: batch time, throughput, each stage."""
    est, m = c.estimate, c.measurement
    title = f"{c.model} on {c.cluster}: measured vs cost model ({c.profile_from})"
    table = Table(title=title + (" [EMULATED]" if m.emulated else ""), title_justify="left")
    for col in ("quantity", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "quantity" else "right")

    def ms(label: str, p: float, q: float, spread: str = "") -> None:
        table.add_row(label, f"{p * 1e3:.2f}", f"{q * 1e3:.2f}{spread}", pct(p, q))

    ms("batch time ms", est.batch_time_s, m.batch_time_s, f" ± {m.batch_time_std_s * 1e3:.2f}")
    table.add_row("throughput samples/s", f"{est.throughput:,.1f}", f"{m.throughput:,.1f}",
                  pct(est.throughput, m.throughput))  # fmt: skip
    table.add_row("comm fraction", f"{est.comm_fraction:.2f}", f"{m.comm_fraction:.2f}",
                  f"{est.comm_fraction - m.comm_fraction:+.2f}")  # fmt: skip
    labels = stage_labels([p.devices for p in est.stages])
    for p, q, devices in zip(est.stages, m.stages, labels, strict=True):
        where = f"stage {p.index} [{p.layers[0]}, {p.layers[1]}) {devices}"
        ms(f"{where}: compute ms", p.compute_s, q.compute_s)
        ms(f"{where}: transfer ms", p.transfer_s, q.transfer_s)
    return table


def run_lines(c: Comparison, data: str) -> list[str]:
    """The batch-time error and what training did, under the table."""
    m = c.measurement
    return [
        f"error           {c.error:+.1%} in batch time ((predicted - measured) / measured)",
        f"training        loss {m.losses[0]:.4f} -> {m.losses[-1]:.4f}, accuracy "
        f"{m.accuracies[-1]:.3f} ({data} data, {m.steps} steps after {m.warmup} warm-up)",
    ]


def describe_plan(plan: Plan) -> str:
    """``[0,16) fast:0 x4 | [16,21) mid:0 x4`` (layers, devices, microbatches)."""
    parts = []
    large = sum(len(s.devices) for s in plan.stages) > IDS_UP_TO
    for i, s in enumerate(plan.stages):
        devices = compact(s.devices) if large else "+".join(d.split("/", 1)[1] for d in s.devices)
        parts.append(f"[{s.start},{s.end}) {devices} x{plan.microbatches(i)}")
    return " | ".join(parts)


def _demo_cells(r: DemoRow, ref_time: float | None, probe: bool = False) -> list[str]:
    """A planned row's cells; ``probe``: its plan was one the calibration was fitted to, so
    its error is marked as not held out."""
    assert r.result is not None  # rows without a plan are drawn by the caller
    predicted = r.result.estimate.batch_time_s
    m = r.outcome.measurement if r.outcome is not None else None
    plan, pred = describe_plan(r.result.plan), f"{predicted * 1e3:.1f}"
    if m is None:
        return [plan, pred, "[red]failed[/red]", *["-"] * 4]
    return [
        plan,
        pred,
        f"{m.batch_time_s * 1e3:.1f} ± {m.batch_time_std_s * 1e3:.1f}",
        pct(predicted, m.batch_time_s) + (" (probe)" if probe else ""),
        f"{ref_time / m.batch_time_s:.2f}x" if ref_time else "-",
        f"{m.comm_fraction:.2f}",
        f"{m.losses[-1]:.3f}",
    ]


def demo_table(demo: Demo) -> Table:
    """One row per planner: its plan, predicted and measured batch time, speed-up."""
    p = demo.problem
    ref = next((r for r in demo.rows if r.planner == REFERENCE), None)
    ref_time = ref.measured_s if ref is not None else None
    best = demo.best
    probes = {plan_key(q.plan) for q in demo.probes}
    title = (
        f"{p.profile.name} on {p.cluster.name}, batch {p.global_batch}: "
        f"cost model vs measured{' (EMULATED)' if demo.emulated else ''}"
    )
    table = Table(title=title, title_justify="left")
    for col in ("planner", "plan (layers devices xmicrobatches)", "predicted ms", "measured ms",
                "error", f"speed-up vs {REFERENCE}", "comm", "loss"):  # fmt: skip
        table.add_column(col, justify="left" if col.startswith("pla") else "right")
    for r in demo.rows:
        if r.result is None:
            table.add_row(r.planner, "[dim]no plan[/dim]", *["-"] * 6)
            continue
        name = f"{r.planner} (best)" if r is best else r.planner
        table.add_row(name, *_demo_cells(r, ref_time, plan_key(r.result.plan) in probes))
    return table
