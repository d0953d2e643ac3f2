"""Numbers for people on the dashboard's server-drawn parts (the Jinja2 filters): ms from
seconds, relative errors, FLOP/s, objective values, what a queued job waits for. ``-``
stands for a missing number."""

from __future__ import annotations

import math
from typing import Any

from pipeplan.core.cluster import parse_device_id


def _ok(x: float | None) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds, 4 significant digits (``12.35``)."""
    return f"{seconds * 1e3:.4g}" if seconds is not None and _ok(seconds) else "-"


def pct(error: float | None) -> str:
    """A relative error as a signed percentage (``+12.3%``)."""
    return f"{error:+.1%}" if error is not None and _ok(error) else "-"


def flops(value: float | None) -> str:
    """FLOP/s in G or T (``40 GFLOP/s``, ``14 TFLOP/s``)."""
    if value is None or not _ok(value):
        return "-"
    return f"{value / 1e12:.3g} TFLOP/s" if value >= 1e12 else f"{value / 1e9:.3g} GFLOP/s"


def count(value: float | None) -> str:
    """A resource amount: ``2`` for whole numbers, ``0.5`` otherwise."""
    return f"{value:g}" if value is not None and _ok(value) else "-"


def objective_value(objective: str, value: float | None) -> str:
    """An objective value: ms of batch time, or $ per million samples for ``cost``."""
    if value is None or not _ok(value):
        return "-"
    if objective == "cost":
        return f"${value * 1e6:.4g} per million samples"
    return f"{value * 1e3:.4g} ms"


def waiting(reason: dict[str, Any] | None) -> str:
    """A queued job's ``waiting_for`` for people: ``2 x mid on n1, held by job pp-...``
    (the devices counted by type and node; ``other actors`` when no job is named)."""
    if not reason or not reason.get("devices"):
        return ""
    groups: dict[tuple[str, str], int] = {}
    for device in reason["devices"]:
        node, dtype, _ = parse_device_id(str(device))
        groups[(dtype, node)] = groups.get((dtype, node), 0) + 1
    what = " and ".join(f"{n} x {dtype} on {node}" for (dtype, node), n in groups.items())
    held = list(reason.get("held_by") or [])
    by = f"job{'s' if len(held) > 1 else ''} {', '.join(held)}" if held else "other actors"
    return f"{what}, held by {by}"


FILTERS = {"ms": ms, "pct": pct, "flops": flops, "count": count, "waiting": waiting}
"""The Jinja2 filters the templates use."""
