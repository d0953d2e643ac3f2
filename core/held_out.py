"""Judging a calibration on runs it did not see: the held-out splits and the error summaries.

A :class:`Fold` is one split of a list of measured plans (or of rows of them): fit on
``train``, judge on ``test``. The splits used:

- :func:`alternate`: the even-numbered fitted, the odd-numbered held out (``pipeplan
  calibrate``'s probes, ordered so that alternate ones cover every kind);
- :func:`newest_quarter`: all but the newest quarter fitted (the service's calibration from
  use: the plans a cluster will be asked about next are more like the newest);
- :func:`leave_one_out`: each plan held out in turn (the service below
  :data:`HOLD_OUT_FROM` observations; ``bench.fidelity``'s ``held-out plan``);
- :func:`leave_group_out`: each group (a model) held out in turn (``held-out model``).

An error is ``(predicted - measured) / measured`` (:func:`relative_error`); a summary gives
the median and the worst ``|error|`` (NaN where there is none).

Pure: the fits themselves are :func:`executor.calibrate.fit_folds`'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

HOLD_OUT_FROM = 4
"""From this many observations :func:`by_count` holds out the newest quarter; below,
leave-one-out."""


@dataclass(frozen=True)
class Fold:
    """One held-out split: fit on the indices ``train``, judge on ``test``."""

    train: tuple[int, ...]
    test: tuple[int, ...]


def alternate(n: int) -> Fold:
    """Fit the even-numbered of ``n``, hold out the odd-numbered."""
    return Fold(tuple(range(0, n, 2)), tuple(range(1, n, 2)))


def newest_quarter(n: int) -> Fold:
    """Fit all but the newest quarter of ``n`` (the last ``ceil(n / 4)``), hold that out."""
    k = math.ceil(n / 4)
    return Fold(tuple(range(n - k)), tuple(range(n - k, n)))


def leave_one_out(n: int) -> list[Fold]:
    """Each of ``n`` held out in turn, fitted on the others."""
    return [Fold(tuple(j for j in range(n) if j != i), (i,)) for i in range(n)]


def leave_group_out(groups: Sequence[str]) -> dict[str, Fold]:
    """Per group (sorted), its members held out and every other index fitted."""
    out: dict[str, Fold] = {}
    for g in sorted(set(groups)):
        out[g] = Fold(
            tuple(i for i, h in enumerate(groups) if h != g),
            tuple(i for i, h in enumerate(groups) if h == g),
        )
    return out


def by_count(n: int) -> tuple[str, list[Fold]]:
    """The service's split of ``n`` observations, oldest first, and its name: the newest
    quarter from :data:`HOLD_OUT_FROM`, else leave-one-out, and none for one observation."""
    if n >= HOLD_OUT_FROM:
        return "newest quarter", [newest_quarter(n)]
    if n < 2:
        return "none", []
    return "leave-one-out", leave_one_out(n)


def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured`` (NaN when nothing was measured)."""
    return (predicted - measured) / measured if measured else math.nan


def median_abs(values: Sequence[float]) -> float:
    """Median of ``|values|`` (NaN when empty)."""
    return statistics.median(abs(v) for v in values) if values else math.nan


def max_abs(values: Sequence[float]) -> float:
    """Largest ``|value|`` (NaN when empty)."""
    return max(abs(v) for v in values) if values else math.nan


def summary(before: Sequence[float], after: Sequence[float]) -> dict[str, float]:
    """The held-out plans' errors before and after calibration: their count, the median and
    the worst ``|error|`` of each (NaN where no plan was held out)."""
    return {
        "held_out_plans": len(before),
        "held_out_median_abs_error_before": median_abs(before),
        "held_out_median_abs_error_after": median_abs(after),
        "held_out_max_abs_error_before": max_abs(before),
        "held_out_max_abs_error_after": max_abs(after),
    }
