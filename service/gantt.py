"""Draw a simulated schedule: one row per stage, forward/backward boxes, transfers beneath."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pipeplan.core.costmodel import Estimate

COLOURS = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "send": "#55A868",
    "grad": "#C44E52",
    "update": "#8172B3",
    "allreduce": "#937860",
}
LABELS = {
    "F": "forward",
    "B": "backward",
    "send": "activation send",
    "grad": "gradient send",
    "update": "optimizer update",
    "allreduce": "all-reduce",
}


def draw_gantt(est: Estimate, path: str | Path, title: str = "") -> None:
    """Write a PNG of the estimate's timeline (times in ms)."""
    S = len(est.stages)
    fig = Figure(figsize=(12, 1.0 + 0.9 * S))
    ax = fig.subplots()
    for e in est.timeline:
        compute = e.kind in ("F", "B", "update", "allreduce")
        y, h = (S - 1 - e.stage, 0.55) if compute else (S - 1 - e.stage - 0.38, 0.18)
        ax.broken_barh(
            [(e.start * 1e3, (e.end - e.start) * 1e3)],
            (y - h / 2, h),
            facecolors=COLOURS[e.kind],
            edgecolor="white",
            linewidth=0.4,
        )
        width = (e.end - e.start) / max(est.batch_time_s, 1e-12)
        if e.kind in ("F", "B") and width > 0.02:
            ax.text(
                (e.start + e.end) / 2 * 1e3,
                y,
                str(e.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(S))
    ax.set_yticklabels(
        [f"stage {S - 1 - i}\n{', '.join(est.stages[S - 1 - i].devices)}" for i in range(S)],
        fontsize=8,
    )
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, est.batch_time_s * 1e3 * 1.01)
    kinds = sorted({e.kind for e in est.timeline}, key=list(COLOURS).index)
    ax.legend(
        handles=[Patch(color=COLOURS[k], label=LABELS[k]) for k in kinds],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(kinds),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(
        label=title
        or f"{est.schedule.value} schedule, batch {est.global_batch}: "
        f"{est.batch_time_s * 1e3:.2f} ms (cost model)",
        pad=22,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
