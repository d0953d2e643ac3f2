"""Rich tables for estimates; units shown to people are ms, MB and GB."""

from __future__ import annotations

from rich.table import Table

from core.costmodel import Estimate


def estimate_table(est: Estimate, title: str = "") -> Table:
    table = Table(title=title or "cost model estimate", title_justify="left")
    for col in (
        "stage",
        "devices",
        "layers",
        "microbatch",
        "fwd ms",
        "bwd ms",
        "compute ms",
        "transfer ms",
        "memory GB",
        "fits",
    ):
        table.add_column(col, justify="left" if col in ("devices", "layers") else "right")
    for st in est.stages:
        table.add_row(
            str(st.index),
            ", ".join(st.devices),
            f"[{st.layers[0]}, {st.layers[1]})",
            f"{st.microbatch} x{st.microbatches}",
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
