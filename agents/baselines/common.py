"""Helpers the simple baselines share: device orders and fixed-structure populations."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.cluster import ClusterSpec


def devices_fastest_first(cluster: ClusterSpec) -> list[int]:
    """Device indices (into ``cluster.device_ids``) by descending type FLOP/s, stable."""
    ids = cluster.device_ids
    return sorted(range(len(ids)), key=lambda i: -cluster.device_type(ids[i]).flops)


def population(
    bounds: Sequence[Sequence[int]],
    stage_devices: Sequence[Sequence[Sequence[int]]],
    microbatch_sizes: Sequence[int],
) -> PlanBatch:
    """Every structure (bounds + devices per stage) x every equal microbatch size."""
    n, S = len(bounds), len(bounds[0]) - 1
    R = max(len(d) for devs in stage_devices for d in devs)
    dev = np.full((n, S, R), -1, dtype=np.int64)
    for i, devs in enumerate(stage_devices):
        for s, d in enumerate(devs):
            dev[i, s, : len(d)] = d
    k = len(microbatch_sizes)
    mb = np.repeat(np.asarray(microbatch_sizes, dtype=np.int64), n)[:, None].repeat(S, axis=1)
    return PlanBatch(
        np.tile(np.asarray(bounds, dtype=np.int64), (k, 1)), mb, np.tile(dev, (k, 1, 1))
    )
