"""``tapp`` on a catalogue: TAPP's partition and attention allocation networks deciding at the
level of node kinds, trained by REINFORCE.

The device-level TAPP of :mod:`agents.tapp` allocates every device of the cluster (112 on
``cloud-catalogue``) and misses most throughput targets there (``bench/provisioning.py``).
Here one sample is a kind-level plan (:class:`~agents.provision.genetic_kinds.KindPlan`),
made concrete on the first free nodes of each kind, so plans equal up to renaming identical
nodes are one plan:

1. **Partition**: an MLP reads each layer's features (:func:`agents.provision.rl.
   layer_features`) and gives the probability of a stage boundary after it.
2. **Allocation** (attention): each stage's query (its layers' mean features, its position)
   against each option's key (log FLOP/s, memory, memory bandwidth, node price, devices per
   node, nodes of the kind; :mod:`agents.provision.kinds`) gives the stage's option.
3. **Counts**: a head picks a slack on the throughput target and the microbatch size; the
   counts are then chosen exactly for the structure's bottleneck at the slackened target
   (:func:`~agents.provision.counts.best_counts`).

Reward ``-log(value)`` (an infeasible plan sits ``infeasible_penalty x (1 + violation)``
below the worst feasible reward seen; a structure whose bound misses the target is costed
with its cheapest counts, so that it still tells how far it misses), a moving baseline,
normalised advantages, an entropy bonus and clipped Adam steps
(:class:`~agents.tapp.TAPPConfig`'s ``batch_size``, ``learning_rate``, ``hidden``,
``attention_dim``, ``baseline_decay``, ``normalize_advantages``, ``entropy_coef``,
``max_grad_norm``, ``infeasible_penalty``, ``max_groups``, ``iterations``, ``patience`` and
``temperature`` apply). As the device-level TAPP ends, the best plan is polished by local
search (one-step moves of counts, options, boundaries and size). Seeded: torch from the
problem's seed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from pipeplan.agents.baselines.genetic import GeneticConfig
from pipeplan.agents.problem import Problem
from pipeplan.agents.provision.genetic_kinds import KindGenetic, KindPlan, is_catalogue
from pipeplan.agents.provision.rl import layer_features
from pipeplan.agents.search import Search
from pipeplan.agents.tapp import TAPPConfig
from pipeplan.agents.tapp import TAPPPlanner as DeviceTAPPPlanner

SLACKS = (1.0, 1.1, 1.25, 1.5)
"""Factors on the throughput target the counts are chosen for (the bound leaves out fill)."""
CUT_BIAS = -2.0
"""Initial logit of a boundary after a layer (about one stage per eight layers)."""


def option_features(space: KindGenetic) -> Tensor:
    """(O, 6) standardised: log FLOP/s, memory, bandwidth, node price, per node, nodes."""
    cat, types = space.cat, space.problem.cluster.device_types
    raw = np.array(
        [
            [
                math.log(types[o.type].flops),
                math.log(types[o.type].memory_gb),
                math.log(types[o.type].memory_bandwidth_gbps),
                math.log(max(o.node_price, 1e-6)),
                math.log(o.per_node),
                math.log(cat.available[o.kind]),
            ]
            for o in cat.options
        ]
    )
    raw = (raw - raw.mean(0)) / (raw.std(0) + 1e-9)
    return torch.as_tensor(raw, dtype=torch.float32)


class KindPolicy(nn.Module):
    """Partition MLP, attention allocation over options, slack and microbatch heads."""

    def __init__(
        self,
        n_layer_feats: int,
        n_opt_feats: int,
        n_sizes: int,
        config: TAPPConfig,
        cut_bias: float = CUT_BIAS,
    ):
        super().__init__()
        h, d = config.hidden, config.attention_dim
        last = nn.Linear(h, 1)
        nn.init.zeros_(last.weight)
        nn.init.constant_(last.bias, cut_bias)
        self.partition = nn.Sequential(nn.Linear(n_layer_feats, h), nn.Tanh(), last)
        self.query = nn.Sequential(nn.Linear(n_layer_feats + 1, h), nn.Tanh(), nn.Linear(h, d))
        self.key = nn.Sequential(nn.Linear(n_opt_feats, h), nn.Tanh(), nn.Linear(h, d))
        self.slack = nn.Parameter(torch.zeros(len(SLACKS)))
        self.size = nn.Parameter(torch.zeros(n_sizes))
        self.d = d


class TAPPKinds:
    """The kind-level TAPP of one problem (see the module docstring)."""

    def __init__(self, problem: Problem, search: Search, config: TAPPConfig):
        self.problem, self.search, self.config = problem, search, config
        self.space = KindGenetic(problem, search, GeneticConfig())
        self.L = self.space.L
        cap = self.space.max_stages
        self.max_stages = cap if config.max_groups is None else min(cap, config.max_groups)
        self.cut_bias = CUT_BIAS
        """The partition network's initial boundary logit."""

    def sample(
        self, policy: KindPolicy, layers: Tensor, opts: Tensor, n: int, gen: torch.Generator
    ) -> tuple[list[KindPlan | None], Tensor, Tensor]:
        """``n`` plans (None where no counts reach the target), their log-probabilities and
        the mean entropy of the decisions; the networks run once per batch."""
        temp, L = self.config.temperature, self.L
        logit = policy.partition(layers[:-1])[:, 0] / temp  # boundary after layers 0..L-2
        p_cut = torch.sigmoid(logit).detach().expand(n, L - 1)
        cut = torch.bernoulli(p_cut, generator=gen).bool()
        over = cut.sum(1) > self.max_stages - 1
        for r in torch.nonzero(over)[:, 0].tolist():  # keep the likeliest boundaries
            keep = torch.topk(torch.where(cut[r], p_cut[r], -1.0), self.max_stages - 1).indices
            cut[r] = False
            cut[r, keep] = True
        bern = torch.distributions.Bernoulli(logits=logit)
        logp = bern.log_prob(cut.float()).sum(1)
        ent = bern.entropy().mean()
        bounds = [(0, *(int(i) + 1 for i in torch.nonzero(row)[:, 0]), L) for row in cut]
        alloc, owner = self.allocation(policy, layers, opts, bounds)
        options = torch.multinomial(alloc.probs.detach(), 1, generator=gen)[:, 0]
        who = torch.as_tensor(owner)
        logp = logp.index_add(0, who, alloc.log_prob(options))
        ent = ent + alloc.entropy().mean()
        heads = []
        for logits in (policy.slack / temp, policy.size / temp):
            dist = torch.distributions.Categorical(logits=logits)
            a = torch.multinomial(dist.probs.detach(), n, replacement=True, generator=gen)
            logp, ent = logp + dist.log_prob(a), ent + dist.entropy()
            heads.append(a.tolist())
        plans: list[KindPlan | None] = []
        opt_list, target = options.tolist(), self.space.target
        for r, bd in enumerate(bounds):
            mine = tuple(int(o) for o, w in zip(opt_list, owner, strict=True) if w == r)
            self.space.target = target * SLACKS[heads[0][r]]
            try:
                got = self.space.recount(bd, mine, self.space.sizes[heads[1][r]])
                if got is None:  # no counts reach the target: the cheapest, to learn from
                    self.space.target = 0.0
                    got = self.space.recount(bd, mine, self.space.sizes[heads[1][r]])
            finally:
                self.space.target = target
            plans.append(got)
        return plans, logp, ent

    def allocation(
        self, policy: KindPolicy, layers: Tensor, opts: Tensor, bounds: list[tuple[int, ...]]
    ) -> tuple[torch.distributions.Categorical, list[int]]:
        """The allocation network's distribution over options for every stage of every
        partition (stages in order, partitions after each other), and each stage's
        partition."""
        pool, pos, owner = [], [], []
        for r, bd in enumerate(bounds):
            S = len(bd) - 1
            for k in range(S):
                w = np.zeros(self.L, dtype=np.float32)
                w[bd[k] : bd[k + 1]] = 1.0 / (bd[k + 1] - bd[k])
                pool.append(w)
                pos.append(k / S)
                owner.append(r)
        q_in = torch.cat(
            [torch.as_tensor(np.array(pool)) @ layers, torch.tensor(pos)[:, None]], dim=1
        )
        temp = self.config.temperature
        scores = policy.query(q_in) @ policy.key(opts).T / math.sqrt(policy.d) / temp
        return torch.distributions.Categorical(logits=scores), owner

    def run(self) -> None:
        c, space = self.config, self.space
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.problem.seed)
            cuts = self.search.evaluator.tables.cuts
            layers = layer_features(self.problem, cuts)
            opts = option_features(space)
            policy = KindPolicy(layers.shape[1], opts.shape[1], len(space.sizes), c, self.cut_bias)
            optim = torch.optim.Adam(policy.parameters(), lr=c.learning_rate)
            gen = torch.Generator().manual_seed(self.problem.seed)
            baseline: float | None = None
            best, since, it = math.inf, 0, 0
            worst: float | None = None
            while not self.search.exhausted():
                if c.iterations is not None and it >= c.iterations:
                    break
                it += 1
                plans, logp, ent = self.sample(policy, layers, opts, c.batch_size, gen)
                found = [p for p in plans if p is not None]
                value, viol = space.fitness(found) if found else (np.zeros(0), np.zeros(0))
                got = {p: (float(a), float(w)) for p, a, w in zip(found, value, viol, strict=True)}
                v = np.array([got[p][0] if p is not None else np.inf for p in plans])
                miss = np.array([min(got[p][1], 10.0) if p is not None else 10.0 for p in plans])
                ok = np.isfinite(v) & (v > 0)
                r = np.where(ok, -np.log(np.where(ok, v, 1.0)), 0.0)
                if ok.any():  # the worst feasible reward seen
                    low = float(r[ok].min())
                    worst = low if worst is None else min(worst, low)
                r = np.where(ok, r, (worst or 0.0) - c.infeasible_penalty * (1 + miss))
                mean = float(r.mean())
                baseline = mean if baseline is None else (
                    c.baseline_decay * baseline + (1 - c.baseline_decay) * mean
                )  # fmt: skip
                adv = r - baseline
                if c.normalize_advantages and r.std() > 1e-9:
                    adv = adv / r.std()
                loss = -(torch.as_tensor(adv, dtype=torch.float32) * logp).mean()
                loss = loss - c.entropy_coef * ent
                optim.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(policy.parameters(), c.max_grad_norm)
                optim.step()
                now = float(v.min(initial=np.inf))
                best, since = (now, 0) if now < best * (1 - 1e-12) else (best, since + 1)
                if c.patience is not None and since >= c.patience:
                    break
        if space.cache:
            top = min(space.cache, key=lambda p: (space.cache[p][1], space.cache[p][0]))
            space.polish(top)


class TAPPPlanner(DeviceTAPPPlanner):
    """``tapp``: the kind-level TAPP on a catalogue under the cost objective
    (:func:`~agents.provision.genetic_kinds.is_catalogue`) when no pretrained policy is
    given (a pretrained policy is device-level: it keeps the device-level TAPP); the
    device-level one of :mod:`agents.tapp` everywhere else (unchanged)."""

    def search(self, problem: Problem, search: Search) -> None:
        config: TAPPConfig = self.config
        if (
            not is_catalogue(problem)
            or self.policy is not None
            or config.pretrained is not None
            or config.frozen
        ):
            super().search(problem, search)
            return
        TAPPKinds(problem, search, config).run()
