"""The dual-chromosome genome of UMPIPE's DGAP and its decoding to a :class:`PlanBatch`.

One individual, ``S`` stages, ``N`` cluster devices, ``L`` layers:

- chromosome 1, the structure: ``cuts`` (``S-1`` increasing layer indices in ``[1, L)``, the
  stage boundaries) and ``assign`` (one gene per device: the stage it serves, or ``-1`` for
  unused). Several devices on one stage are replicas; unused devices are left out of the
  price, so the cost objective's provisioning (which devices to rent) is part of the search.
- chromosome 2, the data partition: ``mb``, one index per stage into the allowed microbatch
  sizes (divisors of the batch). Unequal per-stage sizes (UMPIPE) under GPipe and 1F1B; one
  shared size when the problem fixes the microbatch count, or with ``unequal=False``.

A population of one stage count is held as arrays (:class:`Genomes`), so that operators and
the fitness work on whole populations at once. Devices of one type on one node are
interchangeable (:func:`device_classes`); :func:`canonical` keeps one genome per orbit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.cluster import ClusterSpec

IntArray = np.ndarray
FloatArray = np.ndarray


@dataclass
class Genomes:
    """A population of ``P`` individuals with ``S`` stages: the two chromosomes as arrays."""

    cuts: IntArray  # (P, S-1) stage boundaries, strictly increasing in [1, L)
    assign: IntArray  # (P, N) stage of each device, -1 = unused
    mb: IntArray  # (P, S) index into the allowed microbatch sizes

    @property
    def size(self) -> int:
        return int(self.assign.shape[0])

    @property
    def stages(self) -> int:
        return int(self.mb.shape[1])

    def take(self, idx: IntArray) -> Genomes:
        return Genomes(self.cuts[idx].copy(), self.assign[idx].copy(), self.mb[idx].copy())

    def keys(self) -> list[bytes]:
        """One hashable key per individual (stage count included)."""
        flat = np.concatenate([self.cuts, self.assign, self.mb], axis=1).astype(np.int16)
        head = bytes([self.stages])
        return [head + row.tobytes() for row in flat]

    @staticmethod
    def concat(parts: list[Genomes]) -> Genomes:
        return Genomes(
            np.concatenate([g.cuts for g in parts]),
            np.concatenate([g.assign for g in parts]),
            np.concatenate([g.mb for g in parts]),
        )


def decode(g: Genomes, sizes: IntArray, n_layers: int) -> PlanBatch:
    """Genomes -> a :class:`PlanBatch` (replicas listed by device index, ``-1`` padded)."""
    P, S = g.size, g.stages
    bounds = np.concatenate(
        [np.zeros((P, 1), np.int64), g.cuts, np.full((P, 1), n_layers, np.int64)], axis=1
    )
    member = g.assign[:, None, :] == np.arange(S)[None, :, None]  # (P, S, N)
    R = max(int(member.sum(-1).max()), 1)
    order = np.argsort(~member, axis=-1, kind="stable")[:, :, :R]
    devices = np.where(np.take_along_axis(member, order, -1), order, -1)
    return PlanBatch(bounds.astype(np.int64), sizes[g.mb].astype(np.int64), devices)


def device_classes(cluster: ClusterSpec) -> list[IntArray]:
    """Indices of interchangeable devices: one type on one node (the cost model sees a device
    only through its type and its node), for classes of two or more."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, d in enumerate(cluster.device_ids):
        dev = cluster.device(d)
        groups.setdefault((dev.node, dev.type), []).append(i)
    return [np.array(g, dtype=np.int64) for g in groups.values() if len(g) > 1]


def canonical(assign: IntArray, classes: list[IntArray]) -> IntArray:
    """One representative per symmetry orbit: stage genes sorted (descending, so unused
    devices come last) within each device class. The plan's Estimate is unchanged, and
    duplicates become visible to the fitness cache."""
    out = assign.copy()
    for cols in classes:
        out[:, cols] = -np.sort(-out[:, cols], axis=1)
    return out
