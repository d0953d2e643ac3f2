"""An independent, deliberately plain reading of DESIGN.md's cost-model contract.

Written from the ten rules (and the defaults paragraph) alone, without looking at
``core/costmodel.py`` or ``core/batch_eval.py``, so that the property tests in
``test_costmodel_reference.py`` can hold the real implementation against it. It favours
obviousness over speed: every operation and every send is an explicit record, and the
simulation runs stage by stage, op by op, until nothing is left.

How the rules were read where the text leaves room (each marked "reading" below):

- Rule 1: the "no timing" fallback is decided per layer (a layer without an entry for the
  device type falls back to FLOPs, even if other layers have one). The fixed cost is paid
  once per operation call, whatever the share of samples.
- Rule 2: replica k (in the stage's device order) computes n // r_s samples, plus one when
  k < n % r_s (rule 2i, issue #18: the executor's split; it was the fraction ``n / r_s``);
  rule 9 holds the largest share, ceil(b_s / r_s), per held microbatch; F_s and Bk_s are
  maxima taken separately (the slowest forward replica need not be the slowest backward one). Every
  Bk_s also carries ``(M_s - 1) / M_s`` times rule 8's update time: the replica adds into the
  step's gradients on every microbatch but its first (added to the contract by issue #5).
- Rule 4/7: a transfer always carries the whole microbatch ``b_s`` (not a replica's share).
  "One link" is the connection between two adjacent stages, one per direction; a link is
  used by exactly one sender, so its queue is that sender's op order.
- Rule 6/7: stage s < S-1 sends forward after every forward op; stage s > 0 sends a gradient
  after every backward op. The last stage sends no forward, the first no gradient. Stage 0's
  forwards wait for nothing (the input transfer is not costed); the last stage's backward j
  waits only for its own forward j.
- Rule 8: "slowest replica" for the update is the one with the lowest memory bandwidth; the
  all-reduce ``bw`` is the link class's bytes per second (``gbps * 1e9 / 8``), its latency in
  seconds; the link class is intra-node when every replica is on one node.
- Rule 1c (calibration, issue #18): with a ``calibration`` block, every layer time of type t
  is multiplied by ``compute_scale[t]`` (default 1) and by ``model_scale[profile.model_key]``
  (default 1), and each replica's forward / backward
  op adds ``call_overhead[t].fwd_s`` / ``.bwd_s`` once (so F_s and Bk_s include it); rule 4's
  link classes are the calibration's fitted ones where it has them (``network`` for the
  sends, ``all_reduce`` for rule 8r's ring rounds); rule 8c adds
  ``step_overhead_s`` to the batch time (after the max over stages); rule 8u: rule 8's update
  (and so rule 2b's accumulation) uses ``memory_bandwidth_gbps[t]`` for a type the
  calibration has one for, the spec's elsewhere.
- Rule 9: ``s`` is 0-based, so 1F1B's stage 0 holds ``min(S, M_0)`` microbatches (equal
  divisors); in general the samples of its first ``min(w_s + 1, M_s)`` microbatches.
- Rules 5-7 with remainders (issue #16): ``M_s = ceil(B / b_s)``; microbatch j holds
  ``min(b_s, B - j b_s)`` samples, and its ops and sends are costed for that count; rule 6's
  neighbour microbatch is the one holding sample ``min((j+1) b_s, B) - 1``. 1F1B's warm-up
  ``w_s`` is the rule 5 recurrence, computed here from the last stage up, plainly.
- Rule 10: "total forward and backward op time" is the sum of the op durations (M_s x
  (F_s + Bk_s) per stage, not multiplied by replicas); "total transfer time" is the sum of
  every send's duration (latency included). When both are zero the fraction is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeplan.core.cluster import ClusterSpec, DeviceType, Link
from pipeplan.core.plan import Plan, Schedule
from pipeplan.core.profile import LayerProfile, ModelProfile

Op = tuple[str, int]  # ("F" | "B", microbatch index)


@dataclass(frozen=True)
class RefEstimate:
    """What the reference computes for one plan."""

    batch_time: float
    throughput: float
    cost_per_hour: float
    cost_per_batch: float
    comm_fraction: float
    fits: bool
    memory: tuple[float, ...]
    """Memory per device of each stage, bytes."""
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    stage_end: tuple[float, ...]
    """Last backward end + update + all-reduce, per stage."""
    op_times: dict[tuple[int, str, int], tuple[float, float]]
    """(stage, "F"/"B", microbatch) -> (start, end)."""
    send_times: dict[tuple[int, str, int], tuple[float, float]]
    """(sending stage, "send"/"grad", microbatch) -> (start, end = delivered)."""
    transfer: float
    """Total transfer time, both directions."""


# --- rule 1 and 2: compute ------------------------------------------------------------------


def layer_forward(layer: LayerProfile, dtype: DeviceType, n: float) -> float:
    timing = layer.timings.get(dtype.name)
    if timing is None:
        return n * layer.flops / dtype.flops
    return timing.fwd_fixed_s + n * timing.fwd_s


def layer_backward(layer: LayerProfile, dtype: DeviceType, n: float) -> float:
    timing = layer.timings.get(dtype.name)
    if timing is None:
        return 2.0 * n * layer.flops / dtype.flops
    return timing.bwd_fixed_s + n * timing.bwd_s


def stage_compute(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, s: int, n: int
) -> tuple[float, float]:
    """(F_s, Bk_s): the slowest replica's forward and backward for its share of n samples."""
    stage = plan.stages[s]
    r = len(stage.devices)
    layers = profile.layers[stage.start : stage.end]
    fwd = []
    bwd = []
    cal = cluster.calibration
    for k, device in enumerate(stage.devices):
        share = n // r + (1 if k < n % r else 0)
        dtype = cluster.device_types[cluster.device(device).type]
        scale = (
            cal.compute_scale.get(dtype.name, 1.0) * cal.model_scale.get(profile.model_key, 1.0)
            if cal
            else 1.0
        )
        call = cal.call_overhead.get(dtype.name) if cal else None
        f = scale * sum(layer_forward(layer, dtype, share) for layer in layers)
        b = scale * sum(layer_backward(layer, dtype, share) for layer in layers)
        fwd.append(f + (call.fwd_s if call else 0.0))
        bwd.append(b + (call.bwd_s if call else 0.0))
    return max(fwd), max(bwd)


def link_class(cluster: ClusterSpec, name: str) -> Link:
    """A link class, with the calibration's fitted send numbers and fitted ring round where it
    has them (rules 4 and 8r, rule 1c); what it does not fit stays the spec's."""
    spec = getattr(cluster.network, name)
    cal = cluster.calibration
    bandwidth, latency = spec.bandwidth_gbps, spec.latency_us
    ring_bandwidth, ring_latency = spec.ring_bandwidth_gbps, spec.ring_latency_us
    if cal is not None and name in cal.network:
        bandwidth, latency = cal.network[name]
    if cal is not None and name in cal.all_reduce:
        ring_bandwidth, ring_latency = cal.all_reduce[name]
    return Link(bandwidth, latency, ring_bandwidth, ring_latency)


def ring_rate(link: Link) -> tuple[float, float]:
    """Rule 8's (bytes/s, seconds) of a ring round: the link's ``all_reduce`` if it has one."""
    if link.ring_bandwidth_gbps is not None and link.ring_latency_us is not None:
        return link.ring_bandwidth_gbps * 1e9 / 8, link.ring_latency_us * 1e-6
    return link.bandwidth_gbps * 1e9 / 8, link.latency_us * 1e-6


# --- rules 3 and 4: boundaries and links ----------------------------------------------------


def boundary_bytes(plan: Plan, profile: ModelProfile, s: int) -> float:
    """X_s: per-sample bytes of every layer before stage s's end feeding a layer after it."""
    cut = plan.stages[s].end
    total = 0.0
    for i in range(cut):
        layer = profile.layers[i]
        if any(j >= cut for j in layer.successors):
            total += layer.activation_bytes
    return total


def link_between(cluster: ClusterSpec, a: tuple[str, ...], b: tuple[str, ...]) -> Link:
    crosses = any(cluster.device(x).node != cluster.device(y).node for x in a for y in b)
    return link_class(cluster, "inter_node" if crosses else "intra_node")


def transfer_time(link: Link, per_sample_bytes: float, n: float) -> float:
    return link.latency_us * 1e-6 + per_sample_bytes * n / (link.bandwidth_gbps * 1e9 / 8)


# --- rule 5: op orders ----------------------------------------------------------------------


def op_order(
    schedule: Schedule, num_stages: int, s: int, m: int, warmup: int | None = None
) -> list[Op]:
    """The order in which stage ``s`` of ``num_stages`` runs its ``m`` microbatches (1F1B:
    ``warmup`` forwards first, by default the equal-microbatch ``S - s - 1``)."""
    if schedule is Schedule.GPIPE:
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if warmup is None:
        warmup = num_stages - s - 1
    warmup = min(warmup, m)
    ops: list[Op] = [("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        ops.append(("F", warmup + i))
        ops.append(("B", i))
    ops += [("B", j) for j in range(m - warmup, m)]
    return ops


# --- rules 6 and 7: the simulation ----------------------------------------------------------


def upstream_microbatch(j: int, b_s: int, b_other: int, batch: int | None = None) -> int:
    """The neighbour's microbatch holding the last sample of j: sample
    ``min((j+1) b_s, B) - 1`` lies in microbatch ``floor(sample / b_other)``."""
    last = (j + 1) * b_s - 1 if batch is None else min((j + 1) * b_s, batch) - 1
    return last // b_other


def warmups(b: list[int], batch: int) -> list[int]:
    """Rule 5's 1F1B warm-up forwards of every stage, from the last stage up."""
    S = len(b)
    w = [0] * S
    for s in reversed(range(S - 1)):
        m = math.ceil(batch / b[s])
        candidates = [math.ceil(sum(b[s + 1 :]) / b[s])]
        for i in range(m):
            k = upstream_microbatch(i, b[s], b[s + 1], batch)
            forwarded = min((w[s + 1] + k + 1) * b[s + 1], batch)
            candidates.append(math.ceil(forwarded / b[s]) - i - 1)
        w[s] = min(m, max(candidates))
    return w


def accumulation(plan: Plan, profile: ModelProfile, cluster: ClusterSpec, s: int, m: int) -> float:
    """Added to every Bk_s: the replica's gradient accumulation, rule 8's update time once for
    each of the stage's microbatches but the first, spread over its m backward ops."""
    stage = plan.stages[s]
    params = sum(layer.params_bytes for layer in profile.layers[stage.start : stage.end])
    update = max(4.0 * params / (update_bandwidth(cluster, d) * 1e9) for d in stage.devices)
    return (m - 1) * update / m


def update_bandwidth(cluster: ClusterSpec, device: str) -> float:
    """Rule 8's memory bandwidth (GB/s) on a device: the calibration's fitted one for its type
    where it has one (rule 8u), else the spec's."""
    name = cluster.device(device).type
    cal = cluster.calibration
    if cal is not None and name in cal.memory_bandwidth_gbps:
        return cal.memory_bandwidth_gbps[name]
    return cluster.device_types[name].memory_bandwidth_gbps


def reference_simulate(plan: Plan, profile: ModelProfile, cluster: ClusterSpec) -> RefEstimate:
    S = plan.num_stages
    b = [st.microbatch for st in plan.stages]
    batch = plan.global_batch
    M = [math.ceil(batch / bs) for bs in b]

    def samples(s: int, j: int) -> int:
        return min(b[s], batch - j * b[s])

    compute = {
        (s, j): stage_compute(plan, profile, cluster, s, samples(s, j))
        for s in range(S)
        for j in range(M[s])
    }
    F = {key: c[0] for key, c in compute.items()}
    Bk = {
        (s, j): c[1] + accumulation(plan, profile, cluster, s, M[s])
        for (s, j), c in compute.items()
    }
    X = [boundary_bytes(plan, profile, s) for s in range(S)]
    links = [
        link_between(cluster, plan.stages[s].devices, plan.stages[s + 1].devices)
        for s in range(S - 1)
    ]
    w = warmups(b, batch)
    orders = [op_order(plan.schedule, S, s, M[s], w[s]) for s in range(S)]

    op_times: dict[tuple[int, str, int], tuple[float, float]] = {}
    send_times: dict[tuple[int, str, int], tuple[float, float]] = {}
    fwd_delivered: list[dict[int, float]] = [{} for _ in range(S)]  # s -> s+1, by j
    grad_delivered: list[dict[int, float]] = [{} for _ in range(S)]  # s -> s-1, by j
    fwd_link_free = [0.0] * S
    grad_link_free = [0.0] * S
    stage_free = [0.0] * S
    next_op = [0] * S
    total_transfer = 0.0

    def ready_time(s: int, op: Op) -> float | None:
        kind, j = op
        deps = [stage_free[s]]
        if kind == "F":
            if s > 0:
                k = upstream_microbatch(j, b[s], b[s - 1], batch)
                if k not in fwd_delivered[s - 1]:
                    return None
                deps.append(fwd_delivered[s - 1][k])
        else:
            if (s, "F", j) not in op_times:
                return None
            deps.append(op_times[(s, "F", j)][1])
            if s < S - 1:
                k = upstream_microbatch(j, b[s], b[s + 1], batch)
                if k not in grad_delivered[s + 1]:
                    return None
                deps.append(grad_delivered[s + 1][k])
        return max(deps)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(S):
            while next_op[s] < len(orders[s]):
                op = orders[s][next_op[s]]
                start = ready_time(s, op)
                if start is None:
                    break
                kind, j = op
                end = start + (F[(s, j)] if kind == "F" else Bk[(s, j)])
                op_times[(s, kind, j)] = (start, end)
                stage_free[s] = end
                if kind == "F" and s < S - 1:
                    dur = transfer_time(links[s], X[s], samples(s, j))
                    send_start = max(end, fwd_link_free[s])
                    fwd_link_free[s] = send_start + dur
                    fwd_delivered[s][j] = send_start + dur
                    send_times[(s, "send", j)] = (send_start, send_start + dur)
                    total_transfer += dur
                if kind == "B" and s > 0:
                    dur = transfer_time(links[s - 1], X[s - 1], samples(s, j))
                    send_start = max(end, grad_link_free[s])
                    grad_link_free[s] = send_start + dur
                    grad_delivered[s][j] = send_start + dur
                    send_times[(s, "grad", j)] = (send_start, send_start + dur)
                    total_transfer += dur
                next_op[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"reference simulation deadlocked at ops {next_op}")

    # --- rule 8: update and all-reduce --------------------------------------------------------
    stage_end = []
    for s, stage in enumerate(plan.stages):
        params = sum(layer.params_bytes for layer in profile.layers[stage.start : stage.end])
        update = max(4.0 * params / (update_bandwidth(cluster, d) * 1e9) for d in stage.devices)
        r = len(stage.devices)
        allreduce = 0.0
        if r > 1:
            nodes = {cluster.device(d).node for d in stage.devices}
            link = link_class(cluster, "intra_node" if len(nodes) == 1 else "inter_node")
            bw, lat = ring_rate(link)
            allreduce = 2 * (r - 1) / r * params / bw + 2 * (r - 1) * lat
        last_backward_end = max(op_times[(s, "B", j)][1] for j in range(M[s]))
        stage_end.append(last_backward_end + update + allreduce)
    batch_time = max(stage_end) + (
        cluster.calibration.step_overhead_s if cluster.calibration else 0
    )

    # --- rule 9: memory -----------------------------------------------------------------------
    memory = []
    fits = True
    for s, stage in enumerate(plan.stages):
        params = sum(layer.params_bytes for layer in profile.layers[stage.start : stage.end])
        acts = sum(layer.activation_bytes for layer in profile.layers[stage.start : stage.end])
        # samples held at the peak: all of them (GPipe), or 1F1B's first w_s + 1 microbatches
        held = batch if plan.schedule is Schedule.GPIPE else min((w[s] + 1) * b[s], batch)
        # each held microbatch puts its busiest replica's share on a device (rule 2i)
        mem = 4.0 * params + held / b[s] * math.ceil(b[s] / len(stage.devices)) * acts
        memory.append(mem)
        for d in stage.devices:
            if mem > cluster.device_types[cluster.device(d).type].memory_gb * 1e9:
                fits = False

    # --- rule 10: money and the communication share -------------------------------------------
    price = sum(cluster.device_types[cluster.device(d).type].price_per_hour for d in plan.devices)
    total_compute = sum(F[key] + Bk[key] for key in F)
    denominator = total_transfer + total_compute
    comm_fraction = total_transfer / denominator if denominator > 0 else 0.0
    return RefEstimate(
        batch_time=batch_time,
        throughput=plan.global_batch / batch_time if batch_time > 0 else math.inf,
        cost_per_hour=price,
        cost_per_batch=price * batch_time / 3600,
        comm_fraction=comm_fraction,
        fits=fits,
        memory=tuple(memory),
        forward=tuple(F[(s, 0)] for s in range(S)),
        backward=tuple(Bk[(s, 0)] for s in range(S)),
        stage_end=tuple(stage_end),
        op_times=op_times,
        send_times=send_times,
        transfer=total_transfer,
    )
