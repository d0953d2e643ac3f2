"""Schedules as data: the order in which one stage runs its forward and backward ops.

An op is ``("F", j)`` or ``("B", j)`` for microbatch ``j``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeVar

import numpy as np

Op = tuple[Literal["F", "B"], int]
Count = TypeVar("Count", int, np.ndarray)


class Schedule(StrEnum):
    """Order of a stage's forward and backward operations."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


def gpipe_order(m: int) -> list[Op]:
    """GPipe: every forward, then every backward."""
    return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]


def one_f_one_b_order(m: int, stage: int, num_stages: int) -> list[Op]:
    """1F1B: ``min(S - s - 1, M)`` warm-up forwards, alternate F and B, then drain."""
    warmup = min(num_stages - stage - 1, m)
    ops: list[Op] = [("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", j) for j in range(m - warmup, m)]
    return ops


def stage_order(schedule: Schedule, m: int, stage: int, num_stages: int) -> list[Op]:
    if schedule is Schedule.GPIPE:
        return gpipe_order(m)
    return one_f_one_b_order(m, stage, num_stages)


def upstream_microbatch(j: int, b_here: Count, b_there: Count) -> Count:
    """Index of the neighbour's microbatch holding sample ``(j+1) * b_here - 1`` (rule 6).

    ``ceil((j + 1) * b_here / b_there) - 1`` in integer arithmetic; element-wise for arrays
    of microbatch sizes (a population's).
    """
    return -(-(j + 1) * b_here // b_there) - 1
