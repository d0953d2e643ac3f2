"""Rich tables and text lines for estimates, plans, comparisons and a measured search's
document; units shown to people are ms, MB and GB. Neither torch nor Ray: the CLI's
``simulate`` and its client commands draw with it (:mod:`service.render_runs` has the
tables of real runs)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table

from pipeplan.agents.compare import Row, describe, exact_reference, ratios
from pipeplan.agents.problem import Objective, Problem
from pipeplan.core.costmodel import Estimate
from pipeplan.core.held_out import relative_error
from pipeplan.service.device_groups import stage_labels

if TYPE_CHECKING:
    from pipeplan.service.tasks.plan import Planned

NOTE_WIDTH = 48
"""Of the comparison table's note column."""


def format_value(value: float, objective: Objective) -> str:
    """An objective value for people: ms per batch, or $ per sample."""
    if not math.isfinite(value):
        return "none feasible yet"
    if objective is Objective.COST:
        return f"${value:.3e}/sample"
    return f"{value * 1e3:.3f} ms/batch"


def estimate_table(est: Estimate, title: str = "") -> Table:
    """A row per stage; its devices as :func:`~service.device_groups.stage_labels` writes
    them (ids on a small plan, counts by node kind and type on a large one); a stage that
    recomputes its activations says so beside its microbatch."""
    table = Table(title=title or "cost model estimate", title_justify="left")
    for col in ("stage", "devices", "layers", "microbatch", "fwd ms", "bwd ms", "compute ms",
                "transfer ms", "memory GB", "fits"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("devices", "layers") else "right")
    labels = stage_labels([st.devices for st in est.stages])
    for st, devices in zip(est.stages, labels, strict=True):
        table.add_row(
            str(st.index),
            devices,
            f"[{st.layers[0]}, {st.layers[1]})",
            f"{st.microbatch} x{st.microbatches}" + (", recompute" if st.recompute else ""),
            f"{st.forward_s * 1e3:.3f}",
            f"{st.backward_s * 1e3:.3f}",
            f"{st.compute_s * 1e3:.2f}",
            f"{st.transfer_s * 1e3:.2f}",
            f"{st.memory_bytes / 1e9:.3f} / {st.memory_capacity_bytes / 1e9:g}",
            "yes" if st.fits else "[red]NO[/red]",
        )
    return table


def totals_lines(est: Estimate) -> list[str]:
    lines = [
        f"batch time      {est.batch_time_s * 1e3:.3f} ms  ({est.schedule.value}, "
        f"batch {est.global_batch})",
        f"throughput      {est.throughput:,.1f} samples/s",
        f"price           ${est.cost_per_hour:.4f}/h   ${est.cost_per_batch:.3e}/batch   "
        f"${est.cost_per_sample:.3e}/sample",
        f"comm fraction   {est.comm_fraction:.1%} of op time is transfer",
        f"fits in memory  {'yes' if est.fits else 'NO'}",
    ]
    lines += [f"  does not fit: {p}" for p in est.not_fitting]
    return lines


def bound_lines(bound: Mapping[str, Any], batch_time_s: float) -> list[str]:
    """The lower bound on the batch time beside a plan's (``core.bounds``' ``Bound.to_dict``),
    and what memory rules out."""
    low = float(bound["lower_bound_s"])
    ratio = batch_time_s / low if low > 0 else float("inf")
    lines = [
        f"lower bound     {low * 1e3:.3f} ms  (all compute over the cluster's "
        f"{float(bound['total_flops']) / 1e12:,.1f} TFLOP/s); this plan is {ratio:.2f}x it"
    ]
    return lines + [f"  no plan fits: {reason}" for reason in bound.get("reasons", [])]


def rental_lines(planned: Planned) -> list[str]:
    """The rental of a cost-objective plan: nodes by kind, devices by type, prices."""
    hired = planned.rental
    if hired is None:
        return []
    kinds = ", ".join(f"{k} x{n}" for k, n in hired.nodes.items())
    types = ", ".join(f"{t} x{n}" for t, n in hired.devices.items())
    return [
        f"rental          {kinds}  ({types})",
        f"rental price    ${hired.price_per_hour:.4f}/h of devices used, "
        f"${hired.node_price_per_hour:.4f}/h for the nodes in full; "
        f"${hired.cost_per_sample:.3e}/sample at {hired.throughput:,.1f} samples/s",
    ]


def search_line(planned: Planned) -> str:
    r = planned.result
    how = ", measured reward" if planned.measured is not None else ""
    return (
        f"search          {r.evaluations} evaluations in {r.wall_time_s:.2f} s ({r.planner}{how})"
    )


def pct(predicted: float, measured: float) -> str:
    """The relative error of a prediction, ``+12.3%`` (``-`` when nothing was measured)."""
    e = relative_error(predicted, measured)
    return "-" if not math.isfinite(e) else f"{e:+.1%}"


def measured_lines(measured: dict[str, Any], predicted_s: float) -> list[str]:
    """What a measured search ran, for people, from its document
    (:meth:`~service.tasks.search.MeasuredSearch.to_dict`: the local command and a
    service job's ``--wait`` print the same lines); ``predicted_s`` is the cost model's
    batch time of the best plan."""
    best = measured.get("best")
    failed = [r for r in measured.get("evaluated", []) if r.get("error")]
    lines = []
    if isinstance(best, dict):
        t, std = best["batch_time_s"], best["batch_time_std_s"]
        flag = " EMULATED" if best.get("emulated") else ""
        lines.append(
            f"measured        {t * 1e3:.3f} ms/batch (mean of {best['steps']} runs, "
            f"std {std * 1e3:.2f}){flag}; cost model {predicted_s * 1e3:.3f} ms "
            f"({pct(predicted_s, t)})"
        )
    lines.append(
        f"runs            {measured.get('runs')} plans run on the cluster, {len(failed)} "
        f"refused or failed, {measured.get('pipelines_started')} sets of stage actors started"
    )
    return lines


# --- compare ------------------------------------------------------------------------------


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1].rstrip() + "\u2026"


def short_reason(row: Row) -> str:
    """The reason without the planner/problem prefix the table already shows."""
    name = re.escape(row.planner)
    return re.sub(rf"^(planner '{name}'|{name})( on [^:]*)?: ", "", row.error)


def _comparison_columns(table: Table, exact_col: str) -> None:
    for col in ("planner", "batch ms", "samples/s", "$/sample", "memory ok", "search s",
                "evaluations", "vs best", exact_col):  # fmt: skip
        table.add_column(col, justify="left" if col == "planner" else "right", no_wrap=True)
    table.add_column("note", max_width=NOTE_WIDTH)  # a long reason is cut; failure_lines has it


def comparison_table(problem: Problem, rows: Sequence[Row]) -> Table:
    to_best, to_exact = ratios(rows)
    ref = exact_reference(rows)
    table = Table(title=f"{describe(problem)} (cost model)", title_justify="left")
    _comparison_columns(table, f"vs {ref.planner}" if ref is not None else "vs exact")
    for r in rows:
        if r.result is None:
            dash = ["-"] * 4
            note = "failed: " + shorten(short_reason(r), 2 * NOTE_WIDTH)
            table.add_row(r.planner, *dash, f"{r.search_s:.2f}", *dash[:3], note)
            continue
        est, n = r.result.estimate, r.planner
        table.add_row(
            n,
            f"{est.batch_time_s * 1e3:.3f}",
            f"{est.throughput:,.1f}",
            f"{est.cost_per_sample:.3e}",
            "yes" if est.fits else "[red]NO[/red]",
            f"{r.search_s:.2f}",
            str(r.result.evaluations),
            f"{to_best[n]:.3f}",
            f"{to_exact[n]:.3f}" if n in to_exact else "-",
            "best" if to_best[n] == 1.0 else "",
        )
    return table


def failure_lines(rows: Sequence[Row]) -> list[str]:
    return [f"{r.planner} failed: {r.error}" for r in rows if r.result is None]


def reference_note(rows: Sequence[Row]) -> str:
    ref = exact_reference(rows)
    if ref is None:
        return "no exact reference: neither brute nor dp produced a plan"
    if ref.planner == "brute":
        return "vs brute: ratio to the exact optimum (exhaustive search in the cost model)"
    return (
        "vs dp: ratio to dp, exact for the steady-state bottleneck with one device type per "
        "stage; below 1 means a plan beat it in the full cost model"
    )
