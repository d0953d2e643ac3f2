"""The cost model's rules (DESIGN.md, "Cost model") as small arithmetic functions.

Each formula of the contract is written here once; the simulator (:mod:`core.costmodel`),
the population evaluator (:mod:`core.batch_eval`), the env, the features of TAPP's networks
and the classical planners call these instead of spelling it again. The functions use
arithmetic only (except :func:`in_flight`, which needs an element-wise minimum), so each
argument may be a float or a numpy array (broadcast as usual), and most take torch tensors
as well. The order of the operations is part of the contract: results are compared to
1e-9 relative across implementations, so a caller passes the quantities named here rather
than regrouping the expression.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeplan.core.schedules import Schedule

Quantity = Any
"""A float, a numpy array or a torch tensor: the rules apply element-wise."""

GB = 1e9
"""Bytes (or bits) per gigabyte (gigabit): memory_gb, memory_bandwidth_gbps, bandwidth_gbps."""
BITS_PER_BYTE = 8
US = 1e-6
"""Seconds per microsecond (latency_us)."""

OPTIMIZER_COPIES = 4
"""Copies of a stage's parameters that training holds and the update streams through
memory: weights, gradients, two Adam states (rules 8 and 9)."""
BACKWARD_FLOPS_RATIO = 2.0
"""A backward without a timing costs this many forwards (rule 1's FLOP fallback)."""
RING_PASSES = 2
"""A ring all-reduce is a reduce-scatter then an all-gather: two passes over the ring."""


def compute_s(fixed_s: Quantity, per_sample_s: Quantity, samples: Quantity) -> Quantity:
    """Rule 1: a layer's (or a run of layers') time for ``samples``: ``fixed + n x per_sample``."""
    return fixed_s + samples * per_sample_s


def replica_samples(samples: Quantity, replicas: Quantity, k: int) -> Quantity:
    """Rule 2i: the samples replica ``k`` (of ``replicas``, in the stage's device order)
    computes of an op of ``samples``: ``samples // replicas``, one more for the first
    ``samples % replicas`` replicas. The executor cuts an op's samples into contiguous
    shares so (:func:`executor.microbatch.replica_shares`): 4 samples on 3 replicas are
    2, 1 and 1, not 4/3 each."""
    return samples // replicas + (k < samples % replicas)


def replica_share(samples: Quantity, replicas: Quantity) -> Quantity:
    """Rule 2i: the largest replica share, ``ceil(samples / replicas)`` (replica 0's,
    :func:`replica_samples`): the activations rule 9 holds per microbatch on a device, and
    the busiest replica's compute where the replicas are of one type."""
    return -(-samples // replicas)


def flops_forward_s(flops: Quantity, device_flops: Quantity) -> Quantity:
    """Rule 1's fallback for a layer without a timing on a type: per-sample forward seconds
    ``flops / device flops`` (the backward is :data:`BACKWARD_FLOPS_RATIO` times this)."""
    return flops / device_flops


def update_s(params_bytes: Quantity, memory_bandwidth_gbps: Quantity) -> Quantity:
    """Rule 8: the optimizer step streams :data:`OPTIMIZER_COPIES` x the stage's parameter
    bytes through the (slowest replica's) memory."""
    return OPTIMIZER_COPIES * params_bytes / (memory_bandwidth_gbps * GB)


def recompute_backward_s(forward_s: Quantity, backward_s: Quantity) -> Quantity:
    """Rule 2r: a recomputing stage's backward first runs the forward again (with autograd),
    so one replica's backward of a share lasts its forward plus its backward of that share
    (call overheads included); the stage's Bk_s is the maximum of that over its replicas,
    and rule 2b's accumulation is added after."""
    return forward_s + backward_s


def accumulation_s(update: Quantity, microbatches: Quantity) -> Quantity:
    """Rule 2b: each of a stage's ``M`` backwards carries ``(M - 1) / M`` of an update,
    for adding into the step's gradients on every microbatch but the first."""
    return (microbatches - 1) / microbatches * update


def allreduce_s(
    params_bytes: Quantity, replicas: Quantity, bytes_per_s: Quantity, latency_s: Quantity
) -> Quantity:
    """Rule 8: a ring all-reduce of the stage's gradients over its ``r`` replicas,
    ``2 (r-1)/r x params / bandwidth + 2 (r-1) x latency`` (0 for one replica)."""
    r = replicas
    return (
        RING_PASSES * (r - 1) / r * params_bytes / bytes_per_s + RING_PASSES * (r - 1) * latency_s
    )


def bytes_per_s(bandwidth_gbps: Quantity) -> Quantity:
    """Rule 4: a link's bandwidth in bytes per second."""
    return bandwidth_gbps * GB / BITS_PER_BYTE


def latency_s(latency_us: Quantity) -> Quantity:
    """Rule 4: a link's latency in seconds."""
    return latency_us * US


def transfer_s(nbytes: Quantity, bytes_per_s: Quantity, latency_s: Quantity) -> Quantity:
    """Rule 4: one transfer of ``nbytes`` over a link: ``latency + bytes / bandwidth``."""
    return latency_s + nbytes / bytes_per_s


def in_flight(schedule: Schedule, microbatches: Quantity, stages_from_here: Quantity) -> Quantity:
    """Rule 9: microbatches whose activations a stage holds at once: all ``M`` of them for
    GPipe; for 1F1B ``min(S - s, M)`` (``stages_from_here = S - s``)."""
    if schedule is Schedule.GPIPE:
        return microbatches
    return np.minimum(stages_from_here, microbatches)


def held_microbatches(
    schedule: Schedule, microbatch: Quantity, global_batch: Quantity, warmup: Quantity
) -> Quantity:
    """Rule 9 with remainders and unequal 1F1B: the samples a stage holds at its peak,
    ``H_s``, in units of its microbatch (``H_s / b_s``; exact when ``b_s`` divides ``B``).

    GPipe holds every sample: ``H = B``. 1F1B holds its first ``min(w_s + 1, M_s)``
    microbatches after the last warm-up forward (:func:`core.schedules.one_f_one_b_warmups`):
    ``H = min((w_s + 1) b_s, B)``. With equal divisors this is :func:`in_flight`."""
    if schedule is Schedule.GPIPE:
        return global_batch / microbatch
    return np.minimum((warmup + 1) * microbatch, global_batch) / microbatch


def memory_bytes(
    params_bytes: Quantity, activation_bytes: Quantity, share: Quantity, held: Quantity
) -> Quantity:
    """Rule 9: memory per device of a stage: :data:`OPTIMIZER_COPIES` x its parameters plus
    ``held`` microbatches (:func:`in_flight`, :func:`held_microbatches`) of ``share``
    samples of its activations (:func:`replica_share` of ``b`` over ``r``, rule 2i)."""
    return OPTIMIZER_COPIES * params_bytes + held * share * activation_bytes


def recompute_memory_bytes(
    params_bytes: Quantity,
    input_bytes: Quantity,
    activation_bytes: Quantity,
    share: Quantity,
    held: Quantity,
) -> Quantity:
    """Rule 9r: memory per device of a recomputing stage: :data:`OPTIMIZER_COPIES` x its
    parameters, ``held`` microbatches of ``share`` samples of its *inputs* only
    (``input_bytes`` per sample, rule 3's bytes at its first cut; 0 for the first stage,
    whose model input rule 9 does not count either), and one microbatch of ``share``
    samples of all its activations, rebuilt while it recomputes for a backward."""
    return OPTIMIZER_COPIES * params_bytes + held * share * input_bytes + share * activation_bytes


def capacity_bytes(memory_gb: Quantity) -> Quantity:
    """Rule 9: a device type's memory in bytes."""
    return memory_gb * GB
