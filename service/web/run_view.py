"""A measured run beside the cost model's prediction, per stage: the figures of a ``run``
job's result (and of the best plan of a measured search), and their bars as SVG.

Both sides are per batch: compute (forward + backward over the stage's microbatches),
transfer, and update (the optimizer step, plus the predicted all-reduce of replicas).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeplan.core.errors import FormatError
from pipeplan.core.held_out import relative_error
from pipeplan.service.api.schemas import JobKind
from pipeplan.service.device_groups import stage_labels
from pipeplan.service.web.svg import Scale, Svg, nice_ticks, tick_label

PREDICTED, MEASURED = "#9db4d6", "#2f5d9e"


@dataclass(frozen=True)
class StageTimes:
    """One stage's seconds per batch."""

    compute_s: float
    transfer_s: float
    update_s: float


@dataclass(frozen=True)
class StageRow:
    index: int
    layers: tuple[int, int]
    devices: tuple[str, ...]
    predicted: StageTimes
    measured: StageTimes

    def error(self, part: str) -> float:
        """``(predicted - measured) / measured`` of ``compute``, ``transfer`` or ``update``."""
        return relative_error(
            getattr(self.predicted, f"{part}_s"), getattr(self.measured, f"{part}_s")
        )


@dataclass(frozen=True)
class RunComparison:
    """A measured batch beside its prediction, stage by stage."""

    predicted_batch_s: float
    measured_batch_s: float
    measured_std_s: float
    emulated: bool
    stages: tuple[StageRow, ...]

    @property
    def error(self) -> float:
        return relative_error(self.predicted_batch_s, self.measured_batch_s)

    @property
    def device_labels(self) -> list[str]:
        """Each stage's devices as the page shows them (ids on a small plan, else counts);
        the ids as the result gives them where one is not ``NODE/TYPE:INDEX``."""
        try:
            return stage_labels([s.devices for s in self.stages])
        except FormatError:  # a result document the core would refuse: shown, not raised
            return [", ".join(s.devices) for s in self.stages]


def _num(doc: Mapping[str, Any], key: str) -> float:
    value = doc.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


def _rows(predicted: Sequence[Any], measured: Sequence[Any]) -> tuple[StageRow, ...]:
    rows: list[StageRow] = []
    for p, m in zip(predicted, measured, strict=False):
        if not isinstance(p, Mapping) or not isinstance(m, Mapping):
            continue
        layers = p.get("layers") or [0, 0]
        rows.append(
            StageRow(
                index=int(p.get("index", len(rows))),
                layers=(int(layers[0]), int(layers[1])),
                devices=tuple(str(d) for d in p.get("devices", ())),
                predicted=StageTimes(
                    _num(p, "compute_s"),
                    _num(p, "transfer_s"),
                    _num(p, "update_s") + (_num(p, "allreduce_s") if "allreduce_s" in p else 0.0),
                ),
                measured=StageTimes(
                    _num(m, "compute_s"), _num(m, "transfer_s"), _num(m, "update_s")
                ),
            )
        )
    return tuple(rows)


def _pair(predicted: Any, measured: Any) -> RunComparison | None:
    if not isinstance(predicted, Mapping) or not isinstance(measured, Mapping):
        return None
    return RunComparison(
        predicted_batch_s=_num(predicted, "batch_time_s"),
        measured_batch_s=_num(measured, "batch_time_s"),
        measured_std_s=_num(measured, "batch_time_std_s"),
        emulated=bool(measured.get("emulated", False)),
        stages=_rows(predicted.get("stages") or [], measured.get("stages") or []),
    )


def comparison_of(kind: JobKind, result: Any) -> RunComparison | None:
    """The measured-beside-predicted figures of a finished job's result: a ``run`` job's
    run, or the best plan of a ``plan`` job with a measured reward; None for others."""
    if not isinstance(result, Mapping):
        return None
    if kind is JobKind.RUN:
        return _pair(result.get("predicted"), result.get("measured"))
    measured = result.get("measured")
    if kind is JobKind.PLAN and isinstance(measured, Mapping):
        return _pair(result.get("estimate"), measured.get("best"))
    return None


def stage_bars_svg(c: RunComparison) -> str:
    """Per stage, a predicted and a measured bar of compute, transfer and update (ms)."""
    parts = ("compute", "transfer", "update")
    groups = [(s, part) for s in c.stages for part in parts]
    values = [
        v * 1e3
        for s, part in groups
        for v in (getattr(s.predicted, f"{part}_s"), getattr(s.measured, f"{part}_s"))
        if math.isfinite(v)
    ]
    ticks = nice_ticks(max(values, default=0.0))
    left, top, bar, gap, width = 190.0, 32.0, 10.0, 9.0, 860.0
    height = top + len(groups) * (2 * bar + gap) + 34
    x = Scale(0.0, max(ticks[-1], 1e-9), left, width - 20)
    svg = Svg(width, height, "measured beside predicted, per stage")
    svg.data |= {"stages": len(c.stages)}
    svg.rect(left, 8, 12, 12, PREDICTED)
    svg.text(left + 16, 18, "predicted (cost model)", 12)
    svg.rect(left + 190, 8, 12, 12, MEASURED)
    svg.text(left + 206, 18, "measured" + (" (EMULATED)" if c.emulated else ""), 12)
    for t in ticks:
        svg.line(x(t), top - 4, x(t), height - 30, "#e3e5e8")
        svg.text(x(t), height - 16, tick_label(t), 11, text_anchor="middle", fill="#555")
    svg.text((left + width) / 2, height - 2, "ms per batch", 12, text_anchor="middle")
    for i, (s, part) in enumerate(groups):
        y = top + i * (2 * bar + gap)
        svg.text(8, y + bar + 4, f"stage {s.index} {part}", 12)
        sides = ((s.predicted, PREDICTED, "predicted"), (s.measured, MEASURED, "measured"))
        for j, (times, colour, side) in enumerate(sides):
            v = getattr(times, f"{part}_s") * 1e3
            if math.isfinite(v):
                svg.rect(left, y + j * bar, x(v) - left, bar - 1, colour, class_=side)
                svg.title(f"stage {s.index} {part}: {v:.3f} ms {side}")
    return svg.render("stage-bars", fill=False)
