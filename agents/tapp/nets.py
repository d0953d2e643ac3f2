"""TAPP's networks: a partition network and an attention allocation network, sampled together.

A sampled plan is three decisions, in this order:

1. **microbatch**: one size for every stage, from the allowed ones (a small head scoring each
   candidate from its size and the model/cluster size);
2. **partition** (a feed-forward network applied layer by layer): layer 0 opens group 0;
   every later layer ``l`` opens the next group with probability ``sigmoid(f(x_l) + prior)``,
   else it stays in its predecessor's group, so groups are contiguous by construction; once
   ``max_groups`` groups are open the rest stay. ``x_l`` is the layer's TAPP encoding
   (:mod:`envs.encoding`) plus the model's size and the device count, and - beyond the paper
   - the FLOP share of the open group so far, the number of groups open and what a cut
   before this layer would cost (one transfer of its boundary activations for the sampled
   microbatch, relative to a balanced stage's compute). The first two are the only state a
   contiguous cut needs and let identical layers (repeated blocks) decide differently (it
   halved the evaluations to reach 1% of exact on AlexNet); the cut cost tells a tiny model,
   where any transfer outweighs the compute, from a large one, so that rules such as "cut
   where it is cheap, when the group holds about 1/S of the work" transfer to unseen models.
   ``prior = logit(p0)`` with ``p0 = (G - 1) / (2 (L - 1))`` starts the policy at about half
   the devices in use, whatever the model's size;
3. **allocation** (attention): group ``g``, in order, attends over the devices; its query is
   the group vector (mean of its layers' encodings, one-hot of the groups it feeds, its
   share of parameters/FLOPs/activations, size and position) with the features of the
   device chosen for group ``g-1``; each device's key comes from its speed, memory, price,
   whether it shares a node with that device, whether the group fits in its memory and the
   group's compute time on it. Used devices are masked (no device twice) and so are devices
   the group does not fit (unless none fits). The group vector also holds the FLOP shares of
   the next and of the largest later group, so a small group can leave a fast device to a
   bigger one behind it, and the cost of the cut after it;
4. **replicas** (attention, beyond the paper, so that the space holds brute's optimum): every
   device left over, in device order, attends over the groups plus an "idle" slot and joins
   the group it picks as a data-parallel replica (the stage's microbatch is shared among its
   replicas, DESIGN.md rule 2) or stays unused. Its query is the device's features; a
   group's key comes from its shares of parameters/FLOPs/activations, its primary device,
   its stage time now and with this device joined (and relative to the slowest stage), its
   replica count, whether the device shares a node with the group, whether the group fits
   in the device's memory and the all-reduce the join would add; the idle slot's key is a
   flag. The idle slot starts at probability 1/2 (``log(groups)`` added to its score), so
   the ``cost`` objective can keep devices idle and ``time`` can use them all. Only devices
   no group holds can join (no device twice); the cost model decides memory fit.

Every width is fixed (independent of the model and the cluster), so one policy can plan any
model on any cluster. Sampling is batched over ``n`` plans and returns the log-probability
and the entropy of each plan for REINFORCE; the entropy is the sum over the three heads of
the mean entropy per decision (so an entropy weight means the same for 20 or 300 layers).
``sample_plans(..., given=sample)`` replays the decisions of earlier plans instead of drawing
them: their log-probabilities and entropies under the current policy (the trainer's elite).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from core.cluster import ClusterSpec
from core.costmodel import cut_bytes, layer_costs
from core.plan import Plan, Schedule, Stage
from core.profile import ModelProfile
from envs.encoding import ACTIVATION_SLICE, FLOPS_SLICE, PARAMS_SLICE, WIDTH, encode_profile

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


# --- the problem as tensors ----------------------------------------------------------------


@dataclass(frozen=True)
class PlanContext:
    """One profile on one cluster for one batch/schedule: what the networks read.

    Float tables that decide memory fit and time features are float64 (exact comparisons
    with the cost model); network inputs are float32.
    """

    profile: ModelProfile
    cluster: ClusterSpec
    global_batch: int
    schedule: Schedule
    sizes: tuple[int, ...]  # allowed microbatch sizes
    max_groups: int
    layer_inputs: Tensor  # (L, LAYER_IN)
    successor: Tensor  # (L, L) float: [l, m] = 1 when m is a successor of l
    shares: Tensor  # (L, 3) share of params, FLOPs, activations
    params: Tensor  # (L,) bytes, float64
    acts: Tensor  # (L,) bytes per sample, float64
    fixed: Tensor  # (D, L) seconds per call, fwd + bwd, float64
    per_sample: Tensor  # (D, L) seconds per sample, fwd + bwd, float64
    capacity: Tensor  # (D,) bytes, float64
    node: Tensor  # (D,) node index
    device_static: Tensor  # (D, DEVICE_STATIC)
    microbatch_inputs: Tensor  # (K, MICROBATCH_IN)
    cut: Tensor  # (L+1,) bytes per sample crossing a cut before layer l, float64
    link_latency: float  # seconds: the link a cut is priced on (inter-node when there is one)
    link_bytes_per_s: float
    intra_latency: float  # seconds: the link of replicas on one node
    intra_bytes_per_s: float
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
) -> PlanContext:
    """Precompute the tensors of one planning problem."""
    L, ids = len(profile), cluster.device_ids
    D = len(ids)
    G = min(D, L, max_groups or D)
    enc = torch.from_numpy(encode_profile(profile))
    size_in = [math.log2(L + 1) / 10.0, D / 16.0]
    layer_inputs = torch.cat([enc, torch.tensor(size_in).expand(L, 2)], dim=1)
    succ = torch.zeros(L, L)
    for i, layer in enumerate(profile.layers):
        succ[i, list(layer.successors)] = 1.0
    cols = [PARAMS_SLICE.start + 1, FLOPS_SLICE.start + 1, ACTIVATION_SLICE.start + 1]
    types = [cluster.device_type(d) for d in ids]
    costs = {t.name: layer_costs(profile, t) for t in types}
    fixed = np.stack([costs[t.name].fwd_fixed + costs[t.name].bwd_fixed for t in types])
    per_sample = np.stack(
        [costs[t.name].fwd_per_sample + costs[t.name].bwd_per_sample for t in types]
    )
    params = np.array([x.params_bytes for x in profile.layers], dtype=np.float64)
    capacity = np.array([t.memory_bytes for t in types])
    fastest, dearest = max(t.flops for t in types), max(t.price_per_hour for t in types)
    need = 4.0 * params.sum() + 1.0
    static = np.array(
        [
            [
                t.flops / fastest,
                np.clip(np.log10(t.memory_bytes / need), -3.0, 3.0) / 3.0,
                t.price_per_hour / dearest if dearest > 0 else 0.0,
            ]
            for t in types
        ]
    )
    nodes = {n.name: i for i, n in enumerate(cluster.nodes)}
    log_b = math.log2(global_batch) if global_batch > 1 else 1.0
    mb_in = [[math.log2(global_batch // b) / log_b, math.log2(b) / log_b, *size_in] for b in sizes]
    net = cluster.network
    link = net.inter_node if len(cluster.nodes) > 1 else net.intra_node
    p0 = (G - 1) / (2.0 * (L - 1)) if L > 1 else 0.5
    p0 = min(max(p0, 1e-3), 0.5)
    return PlanContext(
        profile=profile,
        cluster=cluster,
        global_batch=global_batch,
        schedule=Schedule(schedule),
        sizes=tuple(sizes),
        max_groups=G,
        layer_inputs=layer_inputs,
        successor=succ,
        shares=enc[:, cols],
        params=torch.from_numpy(params),
        acts=torch.tensor([float(x.activation_bytes) for x in profile.layers], dtype=torch.float64),
        fixed=torch.from_numpy(fixed),
        per_sample=torch.from_numpy(per_sample),
        capacity=torch.from_numpy(capacity),
        node=torch.tensor([nodes[cluster.device(d).node] for d in ids]),
        device_static=torch.tensor(static, dtype=torch.float32),
        microbatch_inputs=torch.tensor(mb_in, dtype=torch.float32),
        cut=torch.from_numpy(cut_bytes(profile)),
        link_latency=link.latency_s,
        link_bytes_per_s=link.bytes_per_s,
        intra_latency=net.intra_node.latency_s,
        intra_bytes_per_s=net.intra_node.bytes_per_s,
        partition_prior=math.log(p0 / (1.0 - p0)),
    )


# --- the networks --------------------------------------------------------------------------


def _mlp(n_in: int, hidden: int, n_out: int, last_std: float = 0.0) -> nn.Sequential:
    """Two tanh hidden layers. The output layer starts with zero bias and small weights
    (``last_std``, or 1% of PyTorch's default when 0): outputs near the prior / uniform."""
    last = nn.Linear(hidden, n_out)
    nn.init.zeros_(last.bias)
    if last_std > 0:
        nn.init.normal_(last.weight, std=last_std)
    else:
        last.weight.data.mul_(0.01)
    return nn.Sequential(
        nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), last
    )


class PartitionNet(nn.Module):
    """(..., PARTITION_IN) -> (...,) logit of "open the next group" (before the prior)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = _mlp(PARTITION_IN, hidden, 1)

    def forward(self, layers: Tensor) -> Tensor:
        out: Tensor = self.net(layers).squeeze(-1)
        return out


class AllocationNet(nn.Module):
    """Scaled dot-product attention of one query over a set of keys: a group over the
    devices (primary allocation) or a left-over device over the groups and "idle"."""

    def __init__(
        self, hidden: int, dim: int, query_in: int = QUERY_IN, key_in: int = KEY_IN
    ) -> None:
        super().__init__()
        self.query = _mlp(query_in, hidden, dim, last_std=0.1)
        self.key = _mlp(key_in, hidden, dim, last_std=0.1)
        self.dim = dim

    def forward(self, query_in: Tensor, key_in: Tensor) -> Tensor:
        """(P, query_in), (P, K, key_in) -> (P, K) scores."""
        q, k = self.query(query_in), self.key(key_in)
        scores: Tensor = (k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.dim)
        return scores


class TAPPPolicy(nn.Module):
    """The four heads of a TAPP plan: microbatch, partition, allocation, replicas."""

    def __init__(self, hidden: int = 64, attention_dim: int = 32) -> None:
        super().__init__()
        self.hidden, self.attention_dim = hidden, attention_dim
        self.microbatch = _mlp(MICROBATCH_IN, hidden, 1)
        self.partition = PartitionNet(hidden)
        self.allocation = AllocationNet(hidden, attention_dim)
        self.replica = AllocationNet(hidden, attention_dim, REPLICA_QUERY_IN, REPLICA_KEY_IN)

    def save(self, path: str | Path) -> None:
        torch.save(
            {
                "hidden": self.hidden,
                "attention_dim": self.attention_dim,
                "state": self.state_dict(),
            },
            path,
        )

    @classmethod
    def load(cls, path: str | Path) -> TAPPPolicy:
        doc = torch.load(path, weights_only=True)
        policy = cls(int(doc["hidden"]), int(doc["attention_dim"]))
        policy.load_state_dict(doc["state"])
        return policy


# --- sampling ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """``n`` sampled plans as arrays, with the log-probability and entropy of each."""

    size_index: np.ndarray  # (n,) index into context.sizes
    opens: np.ndarray  # (n, L) bool: layer l opens a group
    devices: np.ndarray  # (n, G) primary device index of each group, -1 past the last group
    replica_of: np.ndarray  # (n, D) group a device joins as a replica, -1: primary or idle
    log_prob: Tensor  # (n,)
    entropy: Tensor  # (n,)

    @property
    def n(self) -> int:
        return len(self.size_index)

    def group_of(self, i: int) -> np.ndarray:
        """(D,) the group each device of plan ``i`` serves (primary or replica), -1 idle."""
        out = self.replica_of[i].copy()
        primaries = self.devices[i][self.devices[i] >= 0]
        out[primaries] = np.flatnonzero(self.devices[i] >= 0)
        return out

    def key(self, i: int) -> bytes:
        """A hashable identity of plan ``i`` (equal plans, equal keys; which of a group's
        devices is its primary does not matter)."""
        return (
            self.size_index[i].tobytes() + np.packbits(self.opens[i]).tobytes()
            + self.group_of(i).tobytes()
        )  # fmt: skip

    def plan(self, i: int, ctx: PlanContext) -> Plan:
        ids = ctx.cluster.device_ids
        starts = np.flatnonzero(self.opens[i]).tolist()
        ends = [*starts[1:], ctx.n_layers]
        b = ctx.sizes[int(self.size_index[i])]
        group = self.group_of(i)
        stages = tuple(
            Stage((s, e), tuple(ids[d] for d in np.flatnonzero(group == g)), b)
            for g, (s, e) in enumerate(zip(starts, ends, strict=True))
        )
        return Plan(ctx.global_batch, stages, ctx.schedule)

    def take(self, rows: Sequence[int]) -> Sample:
        """The plans at ``rows`` (decisions only: log-probability and entropy detached)."""
        idx = np.asarray(rows, dtype=np.int64)
        t = torch.from_numpy(idx)
        return Sample(
            self.size_index[idx], self.opens[idx], self.devices[idx], self.replica_of[idx],
            self.log_prob.detach()[t], self.entropy.detach()[t],
        )  # fmt: skip

    @staticmethod
    def concat(parts: Sequence[Sample]) -> Sample:
        return Sample(
            np.concatenate([p.size_index for p in parts]),
            np.concatenate([p.opens for p in parts]),
            np.concatenate([p.devices for p in parts]),
            np.concatenate([p.replica_of for p in parts]),
            torch.cat([p.log_prob for p in parts]),
            torch.cat([p.entropy for p in parts]),
        )


@dataclass(frozen=True)
class Draw:
    """How decisions are made: drawn from a seeded generator at a temperature (every logit
    is divided by it; the log-probabilities are those of the tempered policy), greedily, or
    replayed from ``given`` (earlier plans: their log-probabilities under this policy)."""

    generator: torch.Generator
    temperature: float = 1.0
    greedy: bool = False
    given: Sample | None = None

    def choose(self, logits: Tensor, given: np.ndarray | None = None) -> Tensor:
        if given is not None:
            return torch.from_numpy(np.asarray(given, dtype=np.int64))
        if self.greedy:
            return logits.argmax(-1)
        return torch.multinomial(F.softmax(logits, -1), 1, generator=self.generator).squeeze(-1)


def sample_plans(
    policy: TAPPPolicy,
    ctx: PlanContext,
    n: int,
    generator: torch.Generator,
    greedy: bool = False,
    temperature: float = 1.0,
    given: Sample | None = None,
) -> Sample:
    """Sample ``n`` plans (``greedy``: the most likely decision at every step; ``given``:
    replay its ``n`` plans' decisions)."""
    if given is not None and given.n != n:
        raise ValueError(f"given: holds {given.n} plans, n is {n}")
    draw = Draw(generator, temperature, greedy, given)
    lp_mb, ent_mb, size_index = _sample_microbatch(policy, ctx, n, draw)
    b = torch.tensor([float(ctx.sizes[k]) for k in size_index.tolist()], dtype=torch.float64)
    cut_cost = _cut_cost(ctx, b)
    lp_part, ent_part, opens = _sample_partition(policy, ctx, cut_cost, draw)
    groups = _group_tables(ctx, opens, b, cut_cost)
    lp_alloc, ent_alloc, devices = _sample_allocation(policy, ctx, groups, draw)
    lp_rep, ent_rep, replica_of = _sample_replicas(policy, ctx, groups, devices, draw)
    return Sample(
        size_index=size_index.numpy(),
        opens=opens.numpy(),
        devices=devices.numpy(),
        replica_of=replica_of.numpy(),
        log_prob=lp_mb + lp_part + lp_alloc + lp_rep,
        entropy=ent_mb + ent_part + ent_alloc + ent_rep,
    )


def _sample_microbatch(
    policy: TAPPPolicy, ctx: PlanContext, n: int, draw: Draw
) -> tuple[Tensor, Tensor, Tensor]:
    logits = policy.microbatch(ctx.microbatch_inputs).squeeze(-1).expand(n, -1)
    logits = logits / draw.temperature
    choice = draw.choose(logits.detach(), None if draw.given is None else draw.given.size_index)
    logp = F.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, choice[:, None]).squeeze(-1), ent, choice


def _cut_cost(ctx: PlanContext, b: Tensor) -> Tensor:
    """(P, L+1) float32: one transfer across a cut before layer l, relative to a balanced
    stage's compute (the whole model's per microbatch on the fastest device / max_groups),
    as ``log1p(ratio) / 4``: how much a cut there costs for this model on this cluster."""
    transfer = ctx.link_latency + ctx.cut[None, :] * b[:, None] / ctx.link_bytes_per_s
    ratio = ctx.max_groups * transfer / _reference_time(ctx, b)[:, None]
    return (torch.log1p(ratio) / 4.0).float()


def _reference_time(ctx: PlanContext, b: Tensor) -> Tensor:
    """(P,) seconds: the whole model's forward + backward of one microbatch on the fastest
    device (the scale of every time feature)."""
    t = (ctx.fixed.sum(1)[None] + b[:, None] * ctx.per_sample.sum(1)[None]).min(-1).values
    return t.clamp(min=1e-30)


def _sample_partition(
    policy: TAPPPolicy, ctx: PlanContext, cut_cost: Tensor, draw: Draw
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer 0 opens group 0; layer l opens the next group with probability p_l while fewer
    than max_groups are open. Entropy is the mean over the real (unforced) decisions."""
    n, (L, G) = cut_cost.shape[0], (ctx.n_layers, ctx.max_groups)
    flops = ctx.shares[:, 1]
    fill = flops[0].expand(n)  # FLOP share of the open group so far
    count = torch.ones(n)  # groups open
    opens = [torch.ones(n, dtype=torch.bool)]
    logp, ent, decisions = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    zero = torch.zeros(())
    for layer in range(1, L):
        state = torch.stack([fill, count / G, cut_cost[:, layer]], -1)
        x = torch.cat([ctx.layer_inputs[layer].expand(n, -1), state], -1)
        logit = (policy.partition(x) + ctx.partition_prior) / draw.temperature
        p = torch.sigmoid(logit).detach()
        if draw.given is not None:
            raw = torch.from_numpy(draw.given.opens[:, layer].copy())
        elif draw.greedy:
            raw = p > 0.5
        else:
            raw = torch.rand(n, generator=draw.generator) < p
        free = count < G  # a real decision (else forced to stay)
        opened = raw & free
        lp = torch.where(opened, F.logsigmoid(logit), F.logsigmoid(-logit))
        h = F.binary_cross_entropy_with_logits(logit, torch.sigmoid(logit), reduction="none")
        logp = logp + torch.where(free, lp, zero)
        ent = ent + torch.where(free, h, zero)
        decisions = decisions + free.float()
        count = count + opened.float()
        fill = torch.where(opened, flops[layer], fill + flops[layer])
        opens.append(opened)
    return logp, ent / decisions.clamp(min=1), torch.stack(opens, 1)


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
    t_ref: Tensor  # (P,) seconds (:func:`_reference_time`)
    in_flight: Tensor  # (P, G) microbatches whose activations a stage holds (rule 9)


def _group_tables(ctx: PlanContext, opens: Tensor, b: Tensor, cut_cost: Tensor) -> GroupTables:
    G = ctx.max_groups
    gid = torch.cumsum(opens.long(), -1) - 1  # (P, L)
    n_groups = gid[:, -1] + 1
    member = F.one_hot(gid, G).float()  # (P, L, G)
    m64 = member.double()
    micro = ctx.global_batch / b  # (P,) microbatch count M
    if ctx.schedule is Schedule.GPIPE:
        in_flight = micro[:, None].expand(-1, G)
    else:
        left = (n_groups[:, None] - torch.arange(G)[None]).double()
        in_flight = torch.minimum(left, micro[:, None])
    return GroupTables(
        n_groups=n_groups,
        inputs=_group_inputs(ctx, member, n_groups, cut_cost),
        params=m64.transpose(1, 2) @ ctx.params,
        acts=m64.transpose(1, 2) @ ctx.acts,
        fixed=torch.einsum("plg,dl->pgd", m64, ctx.fixed),
        per_sample=torch.einsum("plg,dl->pgd", m64, ctx.per_sample),
        b=b,
        t_ref=_reference_time(ctx, b),
        in_flight=in_flight,
    )


def _group_inputs(ctx: PlanContext, member: Tensor, n_groups: Tensor, cut_cost: Tensor) -> Tensor:
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
        out = cut_cost.gather(1, ends.clamp(max=L))
        after[:, :-1, 2] = torch.where(ends < L, out, torch.zeros(()))  # its outgoing cut
    return torch.cat([mean, feeds, shares, where, after], dim=-1)


def _sample_allocation(
    policy: TAPPPolicy, ctx: PlanContext, groups: GroupTables, draw: Draw
) -> tuple[Tensor, Tensor, Tensor]:
    """Groups in order choose unused devices by attention; (logp, entropy, devices)."""
    n, D, G = groups.b.shape[0], ctx.n_devices, ctx.max_groups
    n_groups, b = groups.n_groups, groups.b
    t = groups.fixed + b[:, None, None] * groups.per_sample  # (P, G, D) s per microbatch
    time_feature = torch.log1p(D * t / groups.t_ref[:, None, None]).float()
    used = torch.zeros(n, D, dtype=torch.bool)
    devices = torch.full((n, G), -1, dtype=torch.long)
    prev = torch.zeros(n, dtype=torch.long)
    logp, ent = torch.zeros(n), torch.zeros(n)
    rows = torch.arange(n)
    zero = torch.zeros(())
    for g in range(G):
        active = n_groups > g
        memory = 4.0 * groups.params[:, g] + groups.in_flight[:, g] * b * groups.acts[:, g]
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
        scores = policy.allocation(query, keys) / draw.temperature
        free = ~used
        allowed = free & fits
        allowed = torch.where(allowed.any(-1, keepdim=True), allowed, free)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        given = None if draw.given is None else draw.given.devices[:, g].clip(min=0)
        choice = draw.choose(scores.detach(), given)
        lsm = F.log_softmax(scores, -1)
        logp = logp + torch.where(active, lsm[rows, choice], zero)
        ent = ent + torch.where(active, -(lsm.exp() * lsm).sum(-1), zero)
        choice = torch.where(active, choice, torch.full_like(choice, -1))
        devices[:, g] = choice
        used = used | (F.one_hot(choice.clamp(min=0), D).bool() & active[:, None])
        prev = choice.clamp(min=0)
    return logp, ent / n_groups, devices


def _stage_time(groups: GroupTables, member: Tensor) -> Tensor:
    """(P, G) seconds per microbatch of each stage on its replicas (``member``: (P, G, D)
    bool), the slowest replica's share ``b / r`` (rule 2); 0 for a stage with no device."""
    r = member.sum(-1).clamp(min=1).double()
    t = groups.fixed + (groups.b[:, None] / r)[..., None] * groups.per_sample
    return torch.where(member, t, torch.zeros(())).amax(-1)


def _sample_replicas(
    policy: TAPPPolicy, ctx: PlanContext, groups: GroupTables, devices: Tensor, draw: Draw
) -> tuple[Tensor, Tensor, Tensor]:
    """Every device no group holds, in device order, attends over the groups and an idle
    slot (slot ``G``) and joins the group it picks as a replica; (logp, entropy, replica_of)."""
    n, D, G = groups.b.shape[0], ctx.n_devices, ctx.max_groups
    n_groups, b = groups.n_groups, groups.b
    primary = devices >= 0
    member = torch.zeros(n, G, D, dtype=torch.bool)  # devices serving each group
    member[primary] = F.one_hot(devices[primary], D).bool()
    is_primary = member.any(1)  # (P, D)
    open_group = torch.arange(G)[None] < n_groups[:, None]  # (P, G)
    primary_static = ctx.device_static[devices.clamp(min=0)] * primary[..., None]  # (P, G, 3)
    shares = groups.inputs[..., WIDTH + FEEDS : WIDTH + FEEDS + 3]  # (P, G, 3)
    t_ref = groups.t_ref[:, None]
    micro = (ctx.global_batch / b)[:, None]
    idle_key = torch.zeros(n, 1, REPLICA_KEY_IN)
    idle_key[..., -1] = 1.0
    idle_prior = torch.log(n_groups.float())  # p(idle) = 1/2 at a uniform start
    replica_of = torch.full((n, D), -1, dtype=torch.long)
    logp, ent, decisions = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    rows = torch.arange(n)
    zero = torch.zeros(())
    for k in range(D):
        active = ~is_primary[:, k]
        r = member.sum(-1).double()  # (P, G)
        now = _stage_time(groups, member)
        joined = member.clone()
        joined[:, :, k] = open_group
        after = _stage_time(groups, joined)
        slowest = now.amax(-1, keepdim=True).clamp(min=1e-30)
        memory = 4.0 * groups.params + groups.in_flight * (b[:, None] / (r + 1)) * groups.acts
        fits = memory <= ctx.capacity[k]
        on_node = (ctx.node == ctx.node[k])[None, None, :]
        same = (member & on_node).sum(-1).double() / r.clamp(min=1)
        bw = torch.where(same >= 1.0, ctx.intra_bytes_per_s, ctx.link_bytes_per_s)
        lat = torch.where(same >= 1.0, ctx.intra_latency, ctx.link_latency)
        all_reduce = 2.0 * r / (r + 1) * groups.params / bw + 2.0 * r * lat
        join = torch.stack(
            [
                torch.log1p(D * now / t_ref),
                torch.log1p(D * after / t_ref),
                now / slowest,
                r / D,
                same,
                fits.double(),
                torch.log1p(D * all_reduce / (micro * t_ref)),
            ],
            dim=-1,
        ).float()  # (P, G, 7)
        keys = torch.cat([shares, primary_static, join, torch.zeros(n, G, 1)], dim=-1)
        keys = torch.cat([keys, idle_key], dim=1)  # (P, G+1, REPLICA_KEY_IN)
        left = torch.full((n, 1), (D - k) / D)
        query = torch.cat(
            [ctx.device_static[k].expand(n, -1), n_groups[:, None].float() / D, left], -1
        )
        scores = policy.replica(query, keys)
        scores = torch.cat([scores[:, :G], scores[:, G:] + idle_prior[:, None]], -1)
        scores = scores / draw.temperature
        allowed = torch.cat([open_group, torch.ones(n, 1, dtype=torch.bool)], -1)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        given = None
        if draw.given is not None:
            g_of = draw.given.replica_of[:, k]
            given = np.where(g_of >= 0, g_of, G)
        choice = draw.choose(scores.detach(), given)
        lsm = F.log_softmax(scores, -1)
        logp = logp + torch.where(active, lsm[rows, choice], zero)
        ent = ent + torch.where(active, -(lsm.exp() * lsm).sum(-1), zero)
        decisions = decisions + active.float()
        joins = active & (choice < G)
        replica_of[:, k] = torch.where(joins, choice, torch.full_like(choice, -1))
        member[rows[joins], choice[joins], k] = True
    return logp, ent / decisions.clamp(min=1), replica_of
