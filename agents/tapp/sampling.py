"""Sampling plans from TAPP's policy, in batches of ``n``, with each plan's log-probability
and entropy for REINFORCE.

A sampled plan is five decisions, in this order:

1. **microbatch**: one shared size, from the allowed ones (a small head scoring each
   candidate from its size and the model/cluster size); the partition and allocation
   features are priced at it, and it is every stage's size unless step 5 changes it;
2. **partition** (the partition network, layer by layer): layer 0 opens group 0; every later
   layer ``l`` opens the next group with probability ``sigmoid(f(x_l) + prior)``, else it
   stays in its predecessor's group, so groups are contiguous by construction; once
   ``max_groups`` groups are open the rest stay. Beyond the paper, ``x_l`` holds the FLOP
   share of the open group so far and the number of groups open (the only state a
   contiguous cut needs: identical layers of repeated blocks can decide differently) and the
   cost of a cut before the layer (:mod:`agents.tapp.features`);
3. **allocation** (attention): group ``g``, in order, attends over the devices. Used devices
   are masked (no device twice) and so are devices the group does not fit (unless none
   fits);
4. **replicas** (attention, beyond the paper, so that the space holds brute's optimum): every
   device left over, in device order, attends over the groups plus an "idle" slot and joins
   the group it picks as a data-parallel replica (the stage's microbatch is shared among its
   replicas, DESIGN.md rule 2) or stays unused. The idle slot starts at probability 1/2
   (``log(groups)`` added to its score), so the ``cost`` objective can keep devices idle and
   ``time`` can use them all. Only devices no group holds can join (no device twice); the
   cost model decides memory fit;
5. **stage microbatches** (beyond the paper: UMPIPE's unequal data partition, when the
   context allows it): every stage, independently, scores each allowed size from its busy
   time at that size (:func:`~agents.tapp.features.stage_size_inputs`) and samples its own.
   The shared size gets ``log(KEEP_SHARED (K - 1) / (1 - KEEP_SHARED))`` added to its score
   (K allowed sizes), so a fresh policy keeps it with probability :data:`KEEP_SHARED` and
   spreads the rest over the other sizes: early search looks like the paper's equal sizes.

The entropy of a plan is the sum over the heads of the mean entropy per decision (so an
entropy weight means the same for 20 or 300 layers). ``sample_plans(..., given=sample)``
replays the decisions of earlier plans instead of drawing them: their log-probabilities and
entropies under the current policy (the trainer's elite). How many evaluations these
features save is measured by ``bench/rl_quality.py`` (bench/results/rl_quality/).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from pipeplan.agents.tapp.features import (
    GroupTables,
    PlanContext,
    allocation_inputs,
    cut_cost,
    group_tables,
    group_time_feature,
    replica_keys,
    stage_size_inputs,
)
from pipeplan.agents.tapp.nets import TAPPPolicy
from pipeplan.core.plan import Plan, Stage

KEEP_SHARED = 0.9
"""A fresh policy's probability that a stage keeps the shared microbatch size."""


@dataclass(frozen=True)
class Sample:
    """``n`` sampled plans as arrays, with the log-probability and entropy of each."""

    size_index: np.ndarray  # (n,) index into context.sizes: the shared size
    opens: np.ndarray  # (n, L) bool: layer l opens a group
    devices: np.ndarray  # (n, G) primary device index of each group, -1 past the last group
    replica_of: np.ndarray  # (n, D) group a device joins as a replica, -1: primary or idle
    stage_size: np.ndarray  # (n, G) index into context.sizes per group, -1 past the last group
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
            np.packbits(self.opens[i]).tobytes() + self.group_of(i).tobytes()
            + self.stage_size[i].tobytes()
        )  # fmt: skip

    def plan(self, i: int, ctx: PlanContext) -> Plan:
        ids = ctx.cluster.device_ids
        starts = np.flatnonzero(self.opens[i]).tolist()
        ends = [*starts[1:], ctx.n_layers]
        group = self.group_of(i)
        stages = tuple(
            Stage(
                (s, e),
                tuple(ids[d] for d in np.flatnonzero(group == g)),
                ctx.sizes[int(self.stage_size[i, g])],
            )
            for g, (s, e) in enumerate(zip(starts, ends, strict=True))
        )
        return Plan(ctx.global_batch, stages, ctx.schedule)

    def take(self, rows: Sequence[int]) -> Sample:
        """The plans at ``rows`` (decisions only: log-probability and entropy detached)."""
        idx = np.asarray(rows, dtype=np.int64)
        t = torch.from_numpy(idx)
        return Sample(
            self.size_index[idx], self.opens[idx], self.devices[idx], self.replica_of[idx],
            self.stage_size[idx], self.log_prob.detach()[t], self.entropy.detach()[t],
        )  # fmt: skip

    @staticmethod
    def concat(parts: Sequence[Sample]) -> Sample:
        return Sample(
            np.concatenate([p.size_index for p in parts]),
            np.concatenate([p.opens for p in parts]),
            np.concatenate([p.devices for p in parts]),
            np.concatenate([p.replica_of for p in parts]),
            np.concatenate([p.stage_size for p in parts]),
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
    cuts = cut_cost(ctx, b)
    lp_part, ent_part, opens = _sample_partition(policy, ctx, cuts, draw)
    groups = group_tables(ctx, opens, b, cuts)
    lp_alloc, ent_alloc, devices = _sample_allocation(policy, ctx, groups, draw)
    lp_rep, ent_rep, replica_of = _sample_replicas(policy, ctx, groups, devices, draw)
    lp_st, ent_st, stage_size = _sample_stage_sizes(
        policy, ctx, groups, devices, replica_of, size_index, draw
    )
    return Sample(
        size_index=size_index.numpy(),
        opens=opens.numpy(),
        devices=devices.numpy(),
        replica_of=replica_of.numpy(),
        stage_size=stage_size.numpy(),
        log_prob=lp_mb + lp_part + lp_alloc + lp_rep + lp_st,
        entropy=ent_mb + ent_part + ent_alloc + ent_rep + ent_st,
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


def _sample_partition(
    policy: TAPPPolicy, ctx: PlanContext, cuts: Tensor, draw: Draw
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer 0 opens group 0; layer l opens the next group with probability p_l while fewer
    than max_groups are open. The decisions are drawn layer by layer without autograd
    (:func:`_draw_partition`), then scored in one batched pass (:func:`_score_partition`):
    the state a decision reads is a function of the decisions before it, so the
    log-probability of a whole partition needs no sequential graph."""
    if draw.given is not None:
        opens = torch.from_numpy(draw.given.opens.copy())
    else:
        with torch.no_grad():
            opens = _draw_partition(policy, ctx, cuts, draw)
    logp, ent = _score_partition(policy, ctx, cuts, opens, draw.temperature)
    return logp, ent, opens


def _partition_logit(
    policy: TAPPPolicy, ctx: PlanContext, layer_part: Tensor, state: Tensor, temperature: float
) -> Tensor:
    """The partition network's tempered logit, prior added, from the layer's precomputed
    share of its first linear layer (``layer_part``, :meth:`PartitionNet.layer_part`) and the
    decision's state (FLOP share of the open group, groups open, cost of the cut)."""
    logit = policy.partition.from_layer_part(layer_part, state)
    return (logit + ctx.partition_prior) / temperature


def _draw_partition(policy: TAPPPolicy, ctx: PlanContext, cuts: Tensor, draw: Draw) -> Tensor:
    """(n, L) bool: the drawn partition (``opens[:, l]``: layer l opens a group)."""
    n, L, G = cuts.shape[0], ctx.n_layers, ctx.max_groups
    flops = ctx.shares[:, 1]
    layer_part = policy.partition.layer_part(ctx.layer_inputs)
    fill = flops[0].expand(n)  # FLOP share of the open group so far
    count = torch.ones(n)  # groups open
    opens = [torch.ones(n, dtype=torch.bool)]
    for layer in range(1, L):
        state = torch.stack([fill, count / G, cuts[:, layer]], -1)
        logit = _partition_logit(policy, ctx, layer_part[layer], state, draw.temperature)
        if draw.greedy:
            raw = logit > 0.0
        else:
            raw = torch.rand(n, generator=draw.generator) < torch.sigmoid(logit)
        opened = raw & (count < G)  # once G groups are open the rest stay (forced)
        count = count + opened.float()
        fill = torch.where(opened, flops[layer], fill + flops[layer])
        opens.append(opened)
    return torch.stack(opens, 1)


def _score_partition(
    policy: TAPPPolicy, ctx: PlanContext, cuts: Tensor, opens: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """(log-probability, entropy) of the partitions ``opens`` under the policy, every layer
    at once. The state of layer l's decision: groups open before it (the cumulative count of
    opens), the FLOP share of the open group (layers since the last open, by prefix sums)
    and the cut's cost. Entropy is the mean over the real (unforced) decisions."""
    n, L, G = opens.shape[0], ctx.n_layers, ctx.max_groups
    if L < 2:
        return torch.zeros(n), torch.zeros(n)
    flops = ctx.shares[:, 1].double()
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(flops, 0)])  # (L+1,)
    count = torch.cumsum(opens.long(), 1)[:, :-1].float()  # (n, L-1) open before layer l
    index = torch.arange(L)[None].expand(n, -1)
    start = torch.cummax(torch.where(opens, index, torch.zeros_like(index)), 1).values[:, :-1]
    fill = (prefix[1:L][None] - prefix[start]).float()  # layers start..l-1
    state = torch.stack([fill, count / G, cuts[:, 1:L]], -1)  # (n, L-1, 3)
    logit = _partition_logit(
        policy, ctx, policy.partition.layer_part(ctx.layer_inputs[1:]), state, temperature
    )
    free = count < G  # a real decision (else forced to stay)
    opened = opens[:, 1:]
    lp = torch.where(opened, F.logsigmoid(logit), F.logsigmoid(-logit))
    h = F.binary_cross_entropy_with_logits(logit, torch.sigmoid(logit), reduction="none")
    zero = torch.zeros(())
    logp = torch.where(free, lp, zero).sum(-1)
    ent = torch.where(free, h, zero).sum(-1)
    return logp, ent / free.sum(-1).clamp(min=1)


def _sample_allocation(
    policy: TAPPPolicy, ctx: PlanContext, groups: GroupTables, draw: Draw
) -> tuple[Tensor, Tensor, Tensor]:
    """Groups in order choose unused devices by attention; (logp, entropy, devices)."""
    n, D, G = groups.b.shape[0], ctx.n_devices, ctx.max_groups
    n_groups = groups.n_groups
    time_feature = group_time_feature(groups, D)
    used = torch.zeros(n, D, dtype=torch.bool)
    devices = torch.full((n, G), -1, dtype=torch.long)
    prev = torch.zeros(n, dtype=torch.long)
    logp, ent = torch.zeros(n), torch.zeros(n)
    rows = torch.arange(n)
    zero = torch.zeros(())
    for g in range(G):
        active = n_groups > g
        query, keys, fits = allocation_inputs(ctx, groups, g, prev, time_feature)
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


def _sample_replicas(
    policy: TAPPPolicy, ctx: PlanContext, groups: GroupTables, devices: Tensor, draw: Draw
) -> tuple[Tensor, Tensor, Tensor]:
    """Every device no group holds, in device order, attends over the groups and an idle
    slot (slot ``G``) and joins the group it picks as a replica; (logp, entropy, replica_of)."""
    n, D, G = groups.b.shape[0], ctx.n_devices, ctx.max_groups
    n_groups = groups.n_groups
    primary = devices >= 0
    member = torch.zeros(n, G, D, dtype=torch.bool)  # devices serving each group
    member[primary] = F.one_hot(devices[primary], D).bool()
    is_primary = member.any(1)  # (P, D)
    open_group = torch.arange(G)[None] < n_groups[:, None]  # (P, G)
    idle_prior = torch.log(n_groups.float())  # p(idle) = 1/2 at a uniform start
    replica_of = torch.full((n, D), -1, dtype=torch.long)
    logp, ent, decisions = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    rows = torch.arange(n)
    zero = torch.zeros(())
    for k in range(D):
        active = ~is_primary[:, k]
        keys = replica_keys(ctx, groups, devices, member, k)
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


def _sample_stage_sizes(
    policy: TAPPPolicy,
    ctx: PlanContext,
    groups: GroupTables,
    devices: Tensor,
    replica_of: Tensor,
    shared: Tensor,
    draw: Draw,
) -> tuple[Tensor, Tensor, Tensor]:
    """Every stage samples its own microbatch size (all at once: the choices are independent
    given the plan so far); without ``ctx.unequal`` every stage takes the shared size at no
    log-probability. (logp, entropy: mean over the stages, stage_size)."""
    n, D, G = groups.b.shape[0], ctx.n_devices, ctx.max_groups
    stage = torch.arange(G)[None, :] < groups.n_groups[:, None]  # (n, G)
    none = torch.full((n, G), -1, dtype=torch.long)
    if not ctx.unequal:
        return torch.zeros(n), torch.zeros(n), torch.where(stage, shared[:, None], none)
    member = replica_of[:, None, :] == torch.arange(G)[None, :, None]  # (n, G, D)
    primary = devices >= 0
    member[primary] |= F.one_hot(devices[primary], D).bool()
    x = stage_size_inputs(ctx, groups, member, shared)  # (n, G, K, STAGE_SIZE_IN)
    K = x.shape[2]
    bonus = math.log(KEEP_SHARED * (K - 1) / (1.0 - KEEP_SHARED))
    keep = F.one_hot(shared, K).float()[:, None, :] * bonus
    logits = (policy.stage_microbatch(x).squeeze(-1) + keep) / draw.temperature  # (n, G, K)
    given = None
    if draw.given is not None:
        given = draw.given.stage_size.clip(min=0).reshape(-1)
    choice = draw.choose(logits.detach().reshape(n * G, K), given).reshape(n, G)
    lsm = F.log_softmax(logits, -1)
    zero = torch.zeros(())
    lp = torch.where(stage, lsm.gather(-1, choice[..., None]).squeeze(-1), zero).sum(-1)
    h = torch.where(stage, -(lsm.exp() * lsm).sum(-1), zero).sum(-1)
    return lp, h / groups.n_groups, torch.where(stage, choice, none)
