"""Schedules as data: the order in which one stage runs its forward and backward ops.

An op is ``("F", j)`` or ``("B", j)`` for microbatch ``j``. Stage ``s`` cuts the global
batch ``B`` into ``M_s = ceil(B / b_s)`` microbatches of ``b_s`` samples, the last one
holding the remainder ``B - (M_s - 1) b_s`` (:func:`microbatch_samples`).

1F1B with unequal microbatches (or remainders): stage ``s`` runs ``w_s`` warm-up forwards
(:func:`one_f_one_b_warmups`), then alternates one forward and one backward, then drains.
``w_s`` counts the stage's own microbatches; it is at least what the stages after it hold in
samples (``ceil(sum_{t>s} b_t / b_s)``, which is 1F1B's ``S - s - 1`` when every ``b`` is
equal) and at least what keeps the schedule deadlock-free (the stage must have forwarded every
sample that the next stage needs before it can return the gradient the stage waits for).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Literal, TypeVar, cast

import numpy as np

Op = tuple[Literal["F", "B"], int]
Count = TypeVar("Count", int, np.ndarray)


class Schedule(StrEnum):
    """Order of a stage's forward and backward operations."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


def microbatch_count(global_batch: int, microbatch: Count) -> Count:
    """``M = ceil(B / b)``: a stage's microbatches, the last one holding the remainder."""
    return -(-global_batch // microbatch)


def microbatch_samples(j: int, microbatch: int, global_batch: int) -> int:
    """Samples of microbatch ``j``: ``b``, except the last one's ``B - (M - 1) b``."""
    return min(microbatch, global_batch - j * microbatch)


def gpipe_order(m: int) -> list[Op]:
    """GPipe: every forward, then every backward."""
    return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]


def warmup_order(m: int, warmup: int) -> list[Op]:
    """1F1B's shape: ``min(warmup, m)`` forwards, alternate F and B, then drain."""
    warmup = min(warmup, m)
    ops: list[Op] = [("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", j) for j in range(m - warmup, m)]
    return ops


def one_f_one_b_order(m: int, stage: int, num_stages: int) -> list[Op]:
    """1F1B with equal microbatches: ``min(S - s - 1, M)`` warm-up forwards, alternate F and
    B, then drain."""
    return warmup_order(m, num_stages - stage - 1)


def one_f_one_b_warmups(microbatch: Sequence[int], global_batch: int) -> list[int]:
    """Warm-up forwards ``w_s`` of each stage under 1F1B (the contract's rule 5).

    From the last stage up (``w_{S-1} = 0``)::

        w_s = min(M_s, max(ceil(sum_{t>s} b_t / b_s), max_i need_s(i)))
        need_s(i) = ceil(f_{s+1}(k_i) / b_s) - i - 1          for i < M_s
        k_i = ceil(min((i+1) b_s, B) / b_{s+1}) - 1           (rule 6: next stage's microbatch
                                                             holding the last sample of i)
        f_{s+1}(k) = min((w_{s+1} + k + 1) b_{s+1}, B)      (samples the next stage has
                                                             forwarded before its backward k)

    so that before its backward ``i`` the stage has forwarded the samples its neighbour needs
    to send that backward's gradient. Equal ``b``: ``min(S - s - 1, M)``.
    """
    B, b = global_batch, list(microbatch)
    S = len(b)
    w = [0] * S
    for s in range(S - 2, -1, -1):
        m = microbatch_count(B, b[s])
        need = -(-sum(b[s + 1 :]) // b[s])
        nxt, wn = b[s + 1], w[s + 1]
        for i in range(m):
            k = -(-min((i + 1) * b[s], B) // nxt) - 1
            need = max(need, -(-min((wn + k + 1) * nxt, B) // b[s]) - i - 1)
        w[s] = min(m, need)
    return w


def population_warmups(microbatch: np.ndarray, global_batch: int) -> np.ndarray:
    """(P, S) :func:`one_f_one_b_warmups` of every plan of a population (P, S) of sizes,
    computed once per distinct row."""
    rows, inverse = np.unique(microbatch, axis=0, return_inverse=True)
    warm = np.array(
        [one_f_one_b_warmups([int(v) for v in row], global_batch) for row in rows],
        dtype=np.int64,
    ).reshape(rows.shape)
    return warm[inverse.reshape(-1)]


def stage_orders(
    schedule: Schedule, microbatch: Sequence[int], global_batch: int
) -> list[list[Op]]:
    """Every stage's op order for per-stage microbatch sizes ``microbatch`` (rule 5)."""
    counts = [microbatch_count(global_batch, b) for b in microbatch]
    if schedule is Schedule.GPIPE:
        return [gpipe_order(m) for m in counts]
    warmups = one_f_one_b_warmups(microbatch, global_batch)
    return [warmup_order(m, w) for m, w in zip(counts, warmups, strict=True)]


def upstream_microbatch(
    j: int | np.ndarray, b_here: Count, b_there: Count, global_batch: int | None = None
) -> Count:
    """Index of the neighbour's microbatch holding the last sample of microbatch ``j`` (rule 6).

    That sample is ``min((j+1) b_here, B) - 1``, so the index is
    ``ceil(min((j+1) b_here, B) / b_there) - 1`` in integer arithmetic (without
    ``global_batch``: no remainder, ``ceil((j+1) b_here / b_there) - 1``); element-wise for
    arrays of microbatch sizes (a population's).
    """
    end = (j + 1) * b_here
    if global_batch is not None:
        end = (
            np.minimum(end, global_batch) if isinstance(end, np.ndarray) else min(end, global_batch)
        )
    return cast(Count, -(-end // b_there) - 1)
