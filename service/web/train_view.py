"""A train job's curve on its page: the loss and samples per second of every step it
trained, and the steps it took a checkpoint after.

The page is rendered with the curve as it stands (:func:`train_curve` over the job's events
read from the store), as JSON in the page (:meth:`TrainCurve.to_json`); its script draws it
and goes on reading the events after :attr:`TrainCurve.after`, as a search's page does, so
the curve grows while the job runs. A step reported twice (a resumed job reports from its
checkpoint's count on) is drawn once, at its latest value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeplan.service.api.schemas import Event, EventType

MAX_EVENTS = 100_000
"""The most events the page reads of one job on the server; the script reads on."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass
class TrainCurve:
    """The steps trained so far, each with its loss and samples per second (``None``: not a
    finite number), the steps checkpointed, and the seq of the last event read."""

    points: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    """Step -> (loss, samples per second); a step reported again keeps its latest."""
    checkpoints: list[int] = field(default_factory=list)
    after: int = -1

    def add(self, event: Event) -> None:
        """Take one event of the job (any type; only a step's progress and a checkpoint
        count)."""
        self.after = max(self.after, event.seq)
        step = event.data.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        if event.type is EventType.CHECKPOINT:
            self.checkpoints.append(step)
        elif event.type is EventType.PROGRESS:
            d = event.data
            self.points[step] = (_number(d.get("loss")), _number(d.get("samples_per_s")))

    def to_dict(self) -> dict[str, Any]:
        """Steps in order, with their loss and samples per second as parallel lists."""
        steps = sorted(self.points)
        return {
            "steps": steps,
            "loss": [self.points[s][0] for s in steps],
            "samples_per_s": [self.points[s][1] for s in steps],
            "checkpoints": self.checkpoints,
            "after": self.after,
        }

    def to_json(self) -> str:
        """The curve as JSON to put in a ``<script type="application/json">`` (no ``</``)."""
        return json.dumps(self.to_dict(), allow_nan=False).replace("</", "<\\/")


def train_curve(events: Iterable[Event]) -> TrainCurve:
    """The curve of a train job's events, oldest first."""
    curve = TrainCurve()
    for event in events:
        curve.add(event)
    return curve
