"""A lower bound on the batch time of every plan of a problem, and what memory rules out.

**Compute.** Under the cost model (:mod:`core.costmodel`) a stage runs its operations one at
a time, and each lasts at least what its busiest replica computes in it (rules 2 and 5), so
the batch time ``T`` is at least every used device's own compute: for a device ``d`` of type
``t`` that computes ``n_d`` samples of the layers of its stage, ``T >= n_d sum_l c[t, l]``,
with ``c[t, l]`` rule 1's forward + backward seconds per sample of layer ``l`` on ``t``
(calibrated; fixed costs, transfers, updates and idle time only add to it). Weight each
device by its type's FLOP/s ``F_t``: ``F_t T >= n_d sum_l W_l`` where ``W_l = min_t c[t, l]
F_t`` is layer ``l``'s work on the type that does it with the fewest FLOP-seconds. Summed
over every device of the cluster (an idle one adds ``F_t T >= 0``), and as each layer's
``B`` samples are all computed somewhere (``sum_d n_d = B`` over its stage's replicas):

    T >= step overhead + B x sum_l W_l / sum_d F_d

With analytic profiles (no timings) ``c[t, l] = 3 flops_l / F_t``, so the bound is the total
compute ``3 x forward FLOPs x B`` over the cluster's total FLOP/s, and then it is also the
optimum of the linear programme that spreads each layer's samples over the types freely.
The bound ignores communication, pipeline fill and drain, updates and memory: it is what a
perfect split would reach, and the ratio of a plan's batch time to it says how far any
planner could still improve (at most that factor).

**Memory** (rules 9 and 9r). Every device of a stage holds ``4 x params`` of it (weights,
gradients, two Adam states) and at least one sample of its activations, under either
schedule: GPipe holds the whole batch of them, but a stage that recomputes holds only its
inputs of the batch and one microbatch of activations, of one sample at microbatch 1. So no
plan fits when the model's state plus one sample of every layer's activations (``4 P + sum
act``) exceeds the cluster's total memory, or when one layer's own ``4 params + act``
exceeds the largest device: that layer cannot be pipelined at all, even at microbatch 1
with recomputation, and needs its tensors split across devices (tensor parallelism), which
pipeplan does not plan; a tensor-parallel group described as one device type (its
members' memory and FLOP/s summed) can hold it, and pipeplan then plans the pipeline over
such groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import ModelProfile
from pipeplan.core.schedules import Schedule
from pipeplan.core.tables import CostTables


@dataclass(frozen=True)
class OversizedLayer:
    """A layer whose state and one sample of activations fit on no device of the cluster."""

    index: int
    name: str
    needs_bytes: float
    largest_type: str
    largest_bytes: float

    def message(self) -> str:
        return (
            f"layers[{self.index}] ({self.name!r}) needs {self.needs_bytes / rules.GB:,.1f} GB "
            f"on one device (4 x its parameters + one sample's activations, even at microbatch "
            f"1 with recompute), the largest device type ({self.largest_type}) holds "
            f"{self.largest_bytes / rules.GB:,.1f} GB: it needs tensor parallelism, which "
            "pipeplan does not plan; describe a tensor-parallel group as one device type (its "
            "devices' memory and FLOP/s summed) to plan the pipeline over such groups"
        )


@dataclass(frozen=True)
class Bound:
    """The lower bound of one problem (module docstring) and the memory that any plan of
    it needs at least."""

    batch_time_s: float
    """The lower bound on the batch time: ``compute_s + step_overhead_s``."""
    compute_s: float
    """Every layer's work over the cluster's FLOP/s (rate-weighted, module docstring)."""
    step_overhead_s: float
    """Rule 8c: the calibration's seconds added to every batch."""
    total_flops: float
    """The cluster's FLOP/s, every device summed."""
    min_memory_bytes: float
    """The least memory a plan holds, devices summed: state plus one sample of every
    layer's activations (recomputing, at microbatch 1)."""
    capacity_bytes: float
    """The cluster's memory, every device summed."""
    oversized: tuple[OversizedLayer, ...]
    """Layers no device can hold (tensor parallelism would be needed)."""

    @property
    def fits(self) -> bool:
        """Whether memory leaves room for some plan (necessary, not sufficient)."""
        return self.min_memory_bytes <= self.capacity_bytes and not self.oversized

    def reasons(self) -> list[str]:
        """Why no plan can fit, one line each (empty when :attr:`fits`)."""
        out = []
        if self.min_memory_bytes > self.capacity_bytes:
            out.append(
                f"the model needs at least {self.min_memory_bytes / rules.GB:,.1f} GB "
                f"(4 x parameters + the fewest activations), the cluster holds "
                f"{self.capacity_bytes / rules.GB:,.1f} GB in all"
            )
        return out + [x.message() for x in self.oversized]

    def ratio(self, batch_time_s: float) -> float:
        """A plan's batch time over the bound (>= 1 for every plan; inf for a zero bound)."""
        if self.batch_time_s <= 0:
            return float("inf") if batch_time_s > 0 else 1.0
        return batch_time_s / self.batch_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "lower_bound_s": self.batch_time_s,
            "compute_s": self.compute_s,
            "step_overhead_s": self.step_overhead_s,
            "total_flops": self.total_flops,
            "min_memory_bytes": self.min_memory_bytes,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "reasons": self.reasons(),
        }


def lower_bound(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch: int,
    schedule: Schedule = Schedule.GPIPE,
) -> Bound:
    """The :class:`Bound` of training ``profile`` on ``cluster`` at ``global_batch``
    samples per step under ``schedule`` (module docstring)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PipeplanError(f"global_batch: must be an integer >= 1, got {global_batch!r}")
    tables = CostTables.of(profile, cluster)
    counts = cluster.counts_by_type()
    rate = np.array([cluster.device_types[t].flops for t in tables.types])
    present = np.array([counts.get(t, 0) > 0 for t in tables.types])
    per_sample = tables.fwd_per_sample + tables.bwd_per_sample  # (T, L)
    work = np.min(np.where(present[:, None], per_sample * rate[:, None], np.inf), axis=0)
    total_flops = float(sum(cluster.device_types[t].flops * n for t, n in counts.items()))
    compute = global_batch * float(np.sum(work)) / total_flops
    overhead = float(tables.step_overhead)
    return Bound(
        batch_time_s=compute + overhead,
        compute_s=compute,
        step_overhead_s=overhead,
        total_flops=total_flops,
        min_memory_bytes=_min_memory(profile),
        capacity_bytes=float(np.sum(tables.dev_capacity)),
        oversized=_oversized(profile, cluster),
    )


def _min_memory(profile: ModelProfile) -> float:
    """``4 P + sum act``: every stage holds one sample of its activations at least, under
    GPipe too once it recomputes (rule 9r) at microbatch 1."""
    acts = float(sum(x.activation_bytes for x in profile.layers))
    return float(rules.memory_bytes(profile.params_bytes, acts, 1, 1))


def _oversized(profile: ModelProfile, cluster: ClusterSpec) -> tuple[OversizedLayer, ...]:
    used = cluster.counts_by_type()
    largest = max(used, key=lambda t: (cluster.device_types[t].memory_bytes, t))
    capacity = cluster.device_types[largest].memory_bytes
    out = []
    for i, layer in enumerate(profile.layers):
        needs = float(rules.memory_bytes(layer.params_bytes, layer.activation_bytes, 1, 1))
        if needs > capacity:
            out.append(OversizedLayer(i, layer.name, needs, largest, capacity))
    return tuple(out)
