"""``tapp`` at production scale: the kind-level TAPP of the provisioning planners, with the
batch time as its objective, on a cluster whose nodes are given with counts.

A cluster written with ``count: N`` entries (``examples/clusters/scale/``: 64 to 1,024
devices) has interchangeable nodes. The device-level TAPP of :mod:`agents.tapp` allocates
every device and, on such clusters, samples almost only plans that do not fit in memory; the
kind-level one of :mod:`agents.provision.tapp_kinds` decides stage boundaries, each stage's
option (a device type on a node kind) and the microbatch size, and chooses the node counts
exactly for the structure's bottleneck (:func:`~agents.provision.counts.best_counts`), which
is what the batch time needs too (a cost objective's price factor left out). This module
reuses it, with four things the time objective on a large owned cluster needs:

- **Feasible seeds first.** Random boundaries on a 13B-70B model mostly leave a stage that
  fits on no node, so before the policy samples the search values the balanced kind-level
  splits (:func:`agents.provision.scale.balanced_seeds`: stages filled node by node under the
  least busy-time cap, memory included), each as it comes; only when none fits, the
  kind-level genetic search's seeds too
  (:meth:`~agents.provision.genetic_kinds.KindGenetic.seeds`, whose recounts take tens of
  seconds on 1,024 devices). The best is polished by steepest descent: the answer is never
  worse than the best seed.
- **Self-imitation.** Every update replays the ``elite`` best plans valued so far beside the
  samples, their decisions scored by the current policy (as the device-level TAPP's elite),
  so the policy learns the feasible region from the seeds instead of from its own rare hits.
- **More microbatches.** The sizes searched split the batch into up to
  :data:`agents.provision.scale.MAX_MICROBATCHES` microbatches, twice the catalogue
  searches' cap: deep pipelines over hundreds of devices need them to fill.
- **A stage count memory allows.** The partition network's initial boundary logit is set so
  that a sample has, in expectation, the fewest stages whose weights and optimiser state fit
  on the devices of the largest memory (:func:`stages_for_memory`), rather than one stage per
  eight layers: a 70B model needs thirteen stages of 80 GB devices before any plan fits.

Everything else -- the networks, REINFORCE with a moving baseline, the entropy bonus, the
polish of the best plan at the end -- is the provisioning TAPP's
(:class:`~agents.provision.tapp_kinds.TAPPKinds`). When no plan fits, the search says which
constraint binds, as every planner does (:meth:`~agents.search.Search.why_infeasible`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from pipeplan.agents.problem import InfeasibleError, Problem
from pipeplan.agents.provision.genetic_kinds import KindPlan
from pipeplan.agents.provision.scale import at_scale, balanced_seeds, sizes_at_scale
from pipeplan.agents.provision.tapp_kinds import KindPolicy, TAPPKinds
from pipeplan.agents.provision.tapp_kinds import TAPPPlanner as CatalogueTAPPPlanner
from pipeplan.agents.search import Search
from pipeplan.agents.tapp.trainer import TAPPConfig
from pipeplan.core import rules


def stages_for_memory(problem: Problem) -> int:
    """The fewest stages whose share of the model's state (``4 x params``, rule 9) fits on
    one device of the largest memory, at least 1: where a sampled partition should start."""
    params = sum(layer.params_bytes for layer in problem.profile.layers)
    largest = max(t.memory_bytes for t in problem.cluster.device_types.values())
    return max(1, math.ceil(rules.OPTIMIZER_COPIES * params / largest))


def cut_logit(stages: int, layers: int) -> float:
    """The boundary logit after each of ``layers - 1`` gaps that gives ``stages`` stages in
    expectation (clipped to a probability in [1/64, 1/2])."""
    gaps = max(layers - 1, 1)
    p = min(max((stages - 1) / gaps, 1 / 64), 0.5)
    return float(np.log(p / (1 - p)))


class ScaleTAPP(TAPPKinds):
    """The kind-level TAPP for the batch time (module docstring)."""

    def __init__(self, problem: Problem, search: Search, config: TAPPConfig):
        super().__init__(problem, search, config)
        self.space.sizes = sizes_at_scale(problem)
        want = min(stages_for_memory(problem), self.max_stages)
        self.cut_bias = cut_logit(want, self.L)

    def sample(
        self, policy: KindPolicy, layers: Tensor, opts: Tensor, n: int, gen: torch.Generator
    ) -> tuple[list[KindPlan | None], Tensor, Tensor]:
        """The provisioning TAPP's ``n - elite`` samples, then the ``elite`` best distinct
        plans seen, their decisions scored by the current policy: their cached values enter
        the update beside the samples' (self-imitation, as the device-level TAPP's elite)."""
        elite = self.elite()
        plans, logp, ent = super().sample(policy, layers, opts, max(n - len(elite), 1), gen)
        if not elite:
            return plans, logp, ent
        return [*plans, *elite], torch.cat([logp, self.log_prob(policy, layers, opts, elite)]), ent

    def elite(self) -> list[KindPlan]:
        """The ``config.elite`` best feasible plans valued so far, best first."""
        cache = self.space.cache
        feasible = [p for p in cache if np.isfinite(cache[p][0])]
        return sorted(feasible, key=lambda p: cache[p][0])[: self.config.elite]

    def log_prob(
        self, policy: KindPolicy, layers: Tensor, opts: Tensor, plans: list[KindPlan]
    ) -> Tensor:
        """Log-probability of each plan's decisions under ``policy`` at the sampling
        temperature: its boundaries, each stage's option, its microbatch size and the first
        slack (the time objective has no target to slacken)."""
        temp = self.config.temperature
        logit = policy.partition(layers[:-1])[:, 0] / temp
        cut = torch.zeros(len(plans), self.L - 1)
        for r, p in enumerate(plans):
            cut[r, [b - 1 for b in p.bounds[1:-1]]] = 1.0
        logp = torch.distributions.Bernoulli(logits=logit).log_prob(cut).sum(1)
        alloc, owner = self.allocation(policy, layers, opts, [p.bounds for p in plans])
        chosen = torch.tensor([o for p in plans for o, _ in p.stages])
        logp = logp.index_add(0, torch.as_tensor(owner), alloc.log_prob(chosen))
        size = torch.tensor([self.space.sizes.index(p.microbatch) for p in plans])
        logp = logp + torch.distributions.Categorical(logits=policy.size / temp).log_prob(size)
        slack = torch.distributions.Categorical(logits=policy.slack / temp)
        return logp + slack.log_prob(torch.zeros(len(plans), dtype=torch.int64))

    def run(self) -> None:
        space = self.space
        for plan in balanced_seeds(space):  # each valued as it comes: the likeliest first
            if self.search.exhausted():
                break
            space.fitness([plan])
        if not self.elite() and not self.search.exhausted():  # costly at scale: a fallback
            space.fitness(space.seeds(self.config.batch_size))
        if self.elite() and not self.search.exhausted():
            space.polish(self.elite()[0])
        super().run()
        if self.search.best_plan is None and self.search.evaluations:
            raise InfeasibleError(self.why_infeasible())

    def why_infeasible(self) -> str:
        """The search's reason, and what binds in the kind-level space: a stage takes whole
        nodes, so there are at most as many stages as nodes, against the stages the
        weights and optimiser state alone need on the largest devices."""
        p = self.problem
        state = rules.OPTIMIZER_COPIES * sum(x.params_bytes for x in p.profile.layers)
        largest = max(p.cluster.device_types.values(), key=lambda t: t.memory_bytes)
        return (
            f"{self.search.why_infeasible()}; by kinds and counts a stage takes whole nodes, "
            f"so at most {self.max_stages} stages on the {len(p.cluster.nodes)} nodes, and "
            f"the weights and optimiser state ({state / rules.GB:,.0f} GB) need at least "
            f"{stages_for_memory(p)} stages of {largest.name}'s {largest.memory_gb:g} GB"
        )


class TAPPPlanner(CatalogueTAPPPlanner):
    """``tapp``: the kind-level TAPP for the batch time on clusters given with counts
    (:func:`at_scale`), the provisioning TAPP on catalogues under the cost objective, the
    device-level TAPP of :mod:`agents.tapp` everywhere else (unchanged). A pretrained or
    frozen policy is device-level: it keeps the device-level TAPP."""

    def search(self, problem: Problem, search: Search) -> None:
        config: TAPPConfig = self.config
        device_policy = self.policy is not None or config.pretrained is not None or config.frozen
        if at_scale(problem) and not device_policy:
            ScaleTAPP(problem, search, config).run()
            return
        super().search(problem, search)
