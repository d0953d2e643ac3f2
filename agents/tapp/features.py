"""What TAPP's networks read: one planning problem as tensors and the features of its layers,
groups and devices.

- A **layer** (partition network) is its TAPP encoding (:mod:`envs.encoding`) plus the
  model's size and the device count; sampling adds the FLOP share of the open group so far,
  the number of groups open and what a cut before the layer would cost (:func:`cut_cost`).
- A **group** (allocation query) is the mean of its layers' encodings, a one-hot of the
  groups it feeds, its share of parameters/FLOPs/activations, its size and position, and the
  FLOP shares of the next and of the largest later group with the cost of the cut after it
  (:func:`group_inputs`).
- A **device** (allocation key) is its speed, memory and price (:attr:`PlanContext.
  device_static`), plus per group whether it shares a node with the previous group's
  device, whether the group fits in its memory and the group's compute time on it
  (:func:`allocation_inputs`); a **left-over device** choosing a group to join as a replica
  sees each group's shares, primary device, stage time before and after the join, replicas,
  node sharing, memory fit and the all-reduce the join adds (:func:`replica_keys`).
- A **stage's microbatch size** (per-stage head, UMPIPE's unequal data partition) is scored
  per allowed size from the stage's busy time over the whole batch at that size (its
  microbatches' compute plus rule 2b's gradient accumulation) against its best size and
  against the busiest stage at the shared size, with the size itself and the stage's place
  (:func:`stage_size_inputs`).

Every width is fixed (independent of the model and the cluster), so one policy can plan any
model on any cluster. Times are relative to :func:`reference_time`. Memory, compute and
transfer use the contract's rules (:mod:`core.rules`); float tables that decide memory fit
and time features are float64 (exact comparisons with the cost model), network inputs
float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec, DeviceType
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.core.tables import INTER, INTRA, CostTables
from pipeplan.envs.encoding import (
    ACTIVATION_SLICE,
    FLOPS_SLICE,
    PARAMS_SLICE,
    WIDTH,
    encode_profile,
)

FEEDS = 8
"""Width of a group's "groups it feeds" one-hot: slot k = feeds group g+1+k (relative)."""
LAYER_IN = WIDTH + 2  # encoding + (log model size, device count)
PARTITION_IN = LAYER_IN + 3  # + FLOP share of the open group, groups open, cost of a cut
GROUP_IN = WIDTH + FEEDS + 3 + 3 + 3  # mean encoding, feeds, shares, where, what follows
DEVICE_STATIC = 3  # speed, memory (log, relative to the model), price
QUERY_IN = GROUP_IN + DEVICE_STATIC + 1  # + previous group's device, has-previous flag
KEY_IN = DEVICE_STATIC + 3  # + same node as previous, group fits, group time on it
REPLICA_QUERY_IN = DEVICE_STATIC + 2  # the device's features, groups open, devices left
REPLICA_KEY_IN = 3 + DEVICE_STATIC + 7 + 1  # shares, primary device, join features, idle flag
MICROBATCH_IN = 4  # log2 M, log2 b, log model size, device count
STAGE_SIZE_IN = 7  # size, shared-size flag, busy vs best size and vs busiest, place (3)
SHARES = slice(WIDTH + FEEDS, WIDTH + FEEDS + 3)
"""Where a group vector holds its shares of parameters, FLOPs and activations."""


# --- the problem as tensors ----------------------------------------------------------------


@dataclass(frozen=True)
class PlanContext:
    """One profile on one cluster for one batch/schedule: what the networks read."""

    profile: ModelProfile
    cluster: ClusterSpec
    global_batch: int
    schedule: Schedule
    sizes: tuple[int, ...]  # allowed microbatch sizes
    max_groups: int
    unequal: bool  # each stage samples its own microbatch size (else every stage the shared)
    layer_inputs: Tensor  # (L, LAYER_IN)
    successor: Tensor  # (L, L) float: [l, m] = 1 when m is a successor of l
    shares: Tensor  # (L, 3) share of params, FLOPs, activations
    params: Tensor  # (L,) bytes, float64
    acts: Tensor  # (L,) bytes per sample, float64
    fixed: Tensor  # (D, L) seconds per call, fwd + bwd, float64
    per_sample: Tensor  # (D, L) seconds per sample, fwd + bwd, float64
    capacity: Tensor  # (D,) bytes, float64
    memory_bandwidth: Tensor  # (D,) memory_bandwidth_gbps of each device, float64
    node: Tensor  # (D,) node index
    device_static: Tensor  # (D, DEVICE_STATIC)
    microbatch_inputs: Tensor  # (K, MICROBATCH_IN)
    cut: Tensor  # (L+1,) bytes per sample crossing a cut before layer l, float64
    link_latency: float  # seconds: the link a cut is priced on (inter-node when there is one)
    link_bytes_per_s: float
    intra_latency: float  # seconds: the link of replicas on one node
    intra_bytes_per_s: float
    ring_latency: float  # seconds per ring round (rule 8) of replicas on several nodes
    ring_bytes_per_s: float
    intra_ring_latency: float  # and of replicas on one node
    intra_ring_bytes_per_s: float
    partition_prior: float

    @property
    def n_layers(self) -> int:
        return len(self.profile)

    @property
    def n_devices(self) -> int:
        return int(self.capacity.shape[0])


def make_context(
    profile: ModelProfile,
    cluster: ClusterSpec,
    global_batch: int,
    sizes: Sequence[int],
    schedule: Schedule = Schedule.GPIPE,
    max_groups: int | None = None,
    unequal: bool = True,
) -> PlanContext:
    """Precompute the tensors of one planning problem (``unequal``: each stage chooses its
    own microbatch size among ``sizes``)."""
    L, ids = len(profile), cluster.device_ids
    D = len(ids)
    G = min(D, L, max_groups or D)
    enc = torch.from_numpy(encode_profile(profile))
    size_in = [math.log2(L + 1) / 10.0, D / 16.0]
    succ = torch.zeros(L, L)
    for i, layer in enumerate(profile.layers):
        succ[i, list(layer.successors)] = 1.0
    cols = [PARAMS_SLICE.start + 1, FLOPS_SLICE.start + 1, ACTIVATION_SLICE.start + 1]
    types = [cluster.device_type(d) for d in ids]
    tb = CostTables.of(profile, cluster)
    fixed = tb.fwd_fixed[tb.dev_type] + tb.bwd_fixed[tb.dev_type]
    per_sample = tb.fwd_per_sample[tb.dev_type] + tb.bwd_per_sample[tb.dev_type]
    params = np.array([x.params_bytes for x in profile.layers], dtype=np.float64)
    link = INTER if len(cluster.nodes) > 1 else INTRA
    return PlanContext(
        profile=profile,
        cluster=cluster,
        global_batch=global_batch,
        schedule=Schedule(schedule),
        sizes=tuple(sizes),
        max_groups=G,
        unequal=unequal and len(sizes) > 1,
        layer_inputs=torch.cat([enc, torch.tensor(size_in).expand(L, 2)], dim=1),
        successor=succ,
        shares=enc[:, cols],
        params=torch.from_numpy(params),
        acts=torch.tensor([float(x.activation_bytes) for x in profile.layers], dtype=torch.float64),
        fixed=torch.from_numpy(fixed),
        per_sample=torch.from_numpy(per_sample),
        capacity=torch.from_numpy(tb.dev_capacity),
        memory_bandwidth=torch.from_numpy(tb.dev_membw),
        node=torch.from_numpy(tb.dev_node),
        device_static=torch.tensor(_device_static(types, params), dtype=torch.float32),
        microbatch_inputs=_microbatch_inputs(global_batch, sizes, size_in),
        cut=torch.from_numpy(tb.cuts),
        link_latency=float(tb.link_lat[link]),
        link_bytes_per_s=float(tb.link_bps[link]),
        intra_latency=float(tb.link_lat[INTRA]),
        intra_bytes_per_s=float(tb.link_bps[INTRA]),
        ring_latency=float(tb.ring_lat[link]),
        ring_bytes_per_s=float(tb.ring_bps[link]),
        intra_ring_latency=float(tb.ring_lat[INTRA]),
        intra_ring_bytes_per_s=float(tb.ring_bps[INTRA]),
        partition_prior=_partition_prior(G, L),
    )


def _microbatch_inputs(global_batch: int, sizes: Sequence[int], size_in: list[float]) -> Tensor:
    """(K, MICROBATCH_IN): per allowed size ``b``, ``log2 M`` and ``log2 b`` over ``log2 B``,
    then the model's size and the device count."""
    log_b = math.log2(global_batch) if global_batch > 1 else 1.0
    rows = [[math.log2(global_batch // b) / log_b, math.log2(b) / log_b, *size_in] for b in sizes]
    return torch.tensor(rows, dtype=torch.float32)


def _partition_prior(groups: int, layers: int) -> float:
    """``logit(p0)`` with ``p0 = (G - 1) / (2 (L - 1))``: the policy starts at about half the
    devices in use, whatever the model's size."""
    p0 = (groups - 1) / (2.0 * (layers - 1)) if layers > 1 else 0.5
    p0 = min(max(p0, 1e-3), 0.5)
    return math.log(p0 / (1.0 - p0))


def _device_static(types: Sequence[DeviceType], params: np.ndarray) -> np.ndarray:
    """(D, DEVICE_STATIC): speed over the fastest, memory against the whole model's training
    state (log10, clipped to +-3, over 3), price over the dearest."""
    fastest, dearest = max(t.flops for t in types), max(t.price_per_hour for t in types)
    need = rules.OPTIMIZER_COPIES * params.sum() + 1.0
    return np.array(
        [
            [
                t.flops / fastest,
                np.clip(np.log10(t.memory_bytes / need), -3.0, 3.0) / 3.0,
                t.price_per_hour / dearest if dearest > 0 else 0.0,
            ]
            for t in types
        ]
    )


def reference_time(ctx: PlanContext, b: Tensor) -> Tensor:
    """(P,) seconds: the whole model's forward + backward of one microbatch on the fastest
    device (the scale of every time feature)."""
    t = rules.compute_s(ctx.fixed.sum(1)[None], ctx.per_sample.sum(1)[None], b[:, None])
    out: Tensor = t.min(-1).values.clamp(min=1e-30)
    return out


def cut_cost(ctx: PlanContext, b: Tensor) -> Tensor:
    """(P, L+1) float32: one transfer across a cut before layer l, relative to a balanced
    stage's compute (the whole model's per microbatch on the fastest device / max_groups),
    as ``log1p(ratio) / 4``: how much a cut there costs for this model on this cluster.
    It tells a tiny model, where any transfer outweighs the compute, from a large one, so
    that rules such as "cut where it is cheap" transfer to unseen models."""
    transfer = rules.transfer_s(
        ctx.cut[None, :] * b[:, None], ctx.link_bytes_per_s, ctx.link_latency
    )
    ratio = ctx.max_groups * transfer / reference_time(ctx, b)[:, None]
    return (torch.log1p(ratio) / 4.0).float()


# --- the sampled partition's groups ----------------------------------------------------------


@dataclass(frozen=True)
class GroupTables:
    """The sampled partition's groups as tensors, for both attention heads."""

    n_groups: Tensor  # (P,)
    inputs: Tensor  # (P, G, GROUP_IN) group vectors
    params: Tensor  # (P, G) bytes, float64
    acts: Tensor  # (P, G) activation bytes per sample, float64
    fixed: Tensor  # (P, G, D) seconds per call on each device, fwd + bwd, float64
    per_sample: Tensor  # (P, G, D) seconds per sample on each device, float64
    b: Tensor  # (P,) microbatch size, float64
    t_ref: Tensor  # (P,) seconds (:func:`reference_time`)
    in_flight: Tensor  # (P, G) microbatches whose activations a stage holds (rule 9)


def group_tables(ctx: PlanContext, opens: Tensor, b: Tensor, cuts: Tensor) -> GroupTables:
    """The groups of the partitions ``opens`` ((P, L) bool: layer l opens a group) for
    microbatch sizes ``b``; ``cuts`` is :func:`cut_cost`."""
    G = ctx.max_groups
    gid = torch.cumsum(opens.long(), -1) - 1  # (P, L)
    n_groups = gid[:, -1] + 1
    member = F.one_hot(gid, G).float()  # (P, L, G)
    m64 = member.double()
    micro = ctx.global_batch / b  # (P,) microbatch count M
    if ctx.schedule is Schedule.GPIPE:
        in_flight = micro[:, None].expand(-1, G)
    else:  # rule 9's min(S - s, M) (core.rules.in_flight), on tensors
        left = (n_groups[:, None] - torch.arange(G)[None]).double()
        in_flight = torch.minimum(left, micro[:, None])
    return GroupTables(
        n_groups=n_groups,
        inputs=group_inputs(ctx, member, n_groups, cuts),
        params=m64.transpose(1, 2) @ ctx.params,
        acts=m64.transpose(1, 2) @ ctx.acts,
        fixed=torch.einsum("plg,dl->pgd", m64, ctx.fixed),
        per_sample=torch.einsum("plg,dl->pgd", m64, ctx.per_sample),
        b=b,
        t_ref=reference_time(ctx, b),
        in_flight=in_flight,
    )


def group_inputs(ctx: PlanContext, member: Tensor, n_groups: Tensor, cuts: Tensor) -> Tensor:
    """(P, G, GROUP_IN) group vectors from the (P, L, G) membership one-hot."""
    P, L, G = member.shape
    count = member.sum(1)  # (P, G)
    mean = member.transpose(1, 2) @ ctx.layer_inputs[:, :WIDTH] / count.clamp(min=1)[..., None]
    feeds_all = (member.transpose(1, 2) @ ctx.successor @ member) > 0  # (P, G, G)
    feeds = torch.zeros(P, G, FEEDS)
    for k in range(FEEDS):
        if k + 1 < G:
            diag = torch.diagonal(feeds_all, offset=k + 1, dim1=1, dim2=2)  # (P, G-k-1)
            feeds[:, : G - k - 1, k] = diag.float()
    shares = member.transpose(1, 2) @ ctx.shares  # (P, G, 3)
    g = torch.arange(G, dtype=torch.float32)
    last = (n_groups - 1).clamp(min=1).float()[:, None]
    where = torch.stack(
        [count / L, g / last, (g == (n_groups - 1)[:, None]).float()], dim=-1
    )  # (P, G, 3)
    flops = shares[..., 1]  # (P, G)
    after = torch.zeros(P, G, 3)
    if G > 1:
        after[:, :-1, 0] = flops[:, 1:]  # the next group's FLOP share
        later = torch.flip(torch.cummax(torch.flip(flops, [1]), 1).values, [1])
        after[:, :-1, 1] = later[:, 1:]  # the largest later group's
        ends = torch.cumsum(count, 1).long()[:, :-1]  # (P, G-1) first layer after group g
        out = cuts.gather(1, ends.clamp(max=L))
        after[:, :-1, 2] = torch.where(ends < L, out, torch.zeros(()))  # its outgoing cut
    return torch.cat([mean, feeds, shares, where, after], dim=-1)


def stage_time(groups: GroupTables, member: Tensor) -> Tensor:
    """(P, G) seconds per microbatch of each stage on its replicas (``member``: (P, G, D)
    bool), the slowest replica's share ``ceil(b / r)`` (rules 2 and 2i); 0 for a stage with no
    device."""
    r = member.sum(-1).clamp(min=1).double()
    share = rules.replica_share(groups.b[:, None], r)[..., None]
    t = rules.compute_s(groups.fixed, groups.per_sample, share)
    return torch.where(member, t, torch.zeros(())).amax(-1)


def group_time_feature(groups: GroupTables, n_devices: int) -> Tensor:
    """(P, G, D) float32: each group's time per microbatch on each device, as
    ``log1p(D t / t_ref)``."""
    t = rules.compute_s(groups.fixed, groups.per_sample, groups.b[:, None, None])
    return torch.log1p(n_devices * t / groups.t_ref[:, None, None]).float()


def allocation_inputs(
    ctx: PlanContext, groups: GroupTables, g: int, prev: Tensor, time_feature: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Group ``g``'s query (its vector and the device ``prev`` chosen for group ``g - 1``),
    every device's key, and whether the group fits each device's memory:
    (P, QUERY_IN), (P, D, KEY_IN), (P, D) bool."""
    n = groups.b.shape[0]
    memory = rules.memory_bytes(
        groups.params[:, g], groups.acts[:, g], groups.b, groups.in_flight[:, g]
    )
    fits = memory[:, None] <= ctx.capacity[None, :]  # (P, D)
    has_prev = torch.full((n, 1), float(g > 0))
    query = torch.cat([groups.inputs[:, g], ctx.device_static[prev] * has_prev, has_prev], -1)
    same_node = (ctx.node[None, :] == ctx.node[prev][:, None]).float() * has_prev
    keys = torch.cat(
        [
            ctx.device_static.expand(n, -1, -1),
            same_node[..., None],
            fits.float()[..., None],
            time_feature[:, g, :, None],
        ],
        dim=-1,
    )
    return query, keys, fits


def replica_keys(
    ctx: PlanContext, groups: GroupTables, devices: Tensor, member: Tensor, k: int
) -> Tensor:
    """(P, G+1, REPLICA_KEY_IN): what device ``k`` sees of each group it may join (``member``:
    (P, G, D) bool, the devices serving each group so far; ``devices``: (P, G) primaries),
    then the idle slot (a flag)."""
    n, D, G = groups.b.shape[0], ctx.n_devices, ctx.max_groups
    r = member.sum(-1).double()  # (P, G)
    now = stage_time(groups, member)
    joined = member.clone()
    joined[:, :, k] = torch.arange(G)[None] < groups.n_groups[:, None]
    after = stage_time(groups, joined)
    slowest = now.amax(-1, keepdim=True).clamp(min=1e-30)
    share = rules.replica_share(groups.b[:, None], r + 1)
    memory = rules.memory_bytes(groups.params, groups.acts, share, groups.in_flight)
    on_node = (ctx.node == ctx.node[k])[None, None, :]
    same = (member & on_node).sum(-1).double() / r.clamp(min=1)
    bw = torch.where(same >= 1.0, ctx.intra_ring_bytes_per_s, ctx.ring_bytes_per_s)
    lat = torch.where(same >= 1.0, ctx.intra_ring_latency, ctx.ring_latency)
    all_reduce = rules.allreduce_s(groups.params, r + 1, bw, lat)
    t_ref, micro = groups.t_ref[:, None], (ctx.global_batch / groups.b)[:, None]
    join = torch.stack(
        [
            torch.log1p(D * now / t_ref),
            torch.log1p(D * after / t_ref),
            now / slowest,
            r / D,
            same,
            (memory <= ctx.capacity[k]).double(),
            torch.log1p(D * all_reduce / (micro * t_ref)),
        ],
        dim=-1,
    ).float()  # (P, G, 7)
    primary = devices >= 0
    primary_static = ctx.device_static[devices.clamp(min=0)] * primary[..., None]  # (P, G, 3)
    shares = groups.inputs[..., SHARES]
    keys = torch.cat([shares, primary_static, join, torch.zeros(n, G, 1)], dim=-1)
    idle = torch.zeros(n, 1, REPLICA_KEY_IN)
    idle[..., -1] = 1.0
    return torch.cat([keys, idle], dim=1)


def stage_size_inputs(
    ctx: PlanContext, groups: GroupTables, member: Tensor, shared: Tensor
) -> Tensor:
    """(P, G, K, STAGE_SIZE_IN) float32: what each stage sees of each allowed microbatch size
    ``b_k`` (``member``: (P, G, D) bool, the devices serving each group; ``shared``: (P,) the
    index of the size the plan sampled first). Per size: ``log2 b_k / log2 B``, whether it is
    the shared size, ``log`` of the stage's busy time over the batch at ``b_k`` over its least
    busy time at any size, ``log1p`` of that busy time over the busiest stage's at the shared
    size, then the stage's place (position, first, last). Busy time is ``ceil(B / b_k)``
    microbatches of the slowest replica's compute (rules 1-2) plus its gradient accumulation
    (rule 2b) on that replica's memory."""
    P, G, D = member.shape
    sizes = torch.tensor([float(b) for b in ctx.sizes], dtype=torch.float64)  # (K,)
    K = sizes.shape[0]
    r = member.sum(-1).clamp(min=1).double()  # (P, G)
    share = rules.replica_share(sizes[None, None, :], r[..., None])  # (P, G, K)
    t = rules.compute_s(
        groups.fixed[..., None], groups.per_sample[..., None], share[:, :, None, :]
    )  # (P, G, D, K)
    micro = torch.ceil(ctx.global_batch / sizes)  # (K,)
    update = rules.update_s(groups.params[..., None], ctx.memory_bandwidth[None, None, :])
    accumulate = rules.accumulation_s(update[..., None], micro) * micro  # (P, G, D, K)
    busy = torch.where(member[..., None], micro * t + accumulate, torch.zeros(()))
    busy = busy.amax(2)  # (P, G, K): the slowest replica
    stage = torch.arange(G)[None, :] < groups.n_groups[:, None]  # (P, G)
    tiny = 1e-30
    vs_best = torch.log(busy.clamp(min=tiny) / busy.amin(-1, keepdim=True).clamp(min=tiny))
    at_shared = busy.gather(2, shared[:, None, None].expand(P, G, 1)).squeeze(-1)  # (P, G)
    busiest = torch.where(stage, at_shared, torch.zeros(())).amax(-1).clamp(min=tiny)
    vs_busiest = torch.log1p(busy / busiest[:, None, None])
    log_b = math.log2(ctx.global_batch) if ctx.global_batch > 1 else 1.0
    size = (torch.log2(sizes) / log_b).expand(P, G, K)
    is_shared = F.one_hot(shared, K).double()[:, None, :].expand(P, G, K)
    g = torch.arange(G, dtype=torch.float64)
    last = (groups.n_groups - 1).clamp(min=1).double()[:, None]
    place = torch.stack(
        [g / last, (g == 0).double().expand(P, G), (g[None] == last).double()], -1
    )  # (P, G, 3)
    out = torch.cat(
        [
            torch.stack([size, is_shared, vs_best.clamp(max=5.0), vs_busiest], -1),
            place[:, :, None, :].expand(P, G, K, 3),
        ],
        -1,
    )
    return out.float()
