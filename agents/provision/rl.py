"""``heterps_rl``: HeterPS's RL layer scheduler on a catalogue -- layers to device kinds by a
policy trained with REINFORCE, then counts.

1. **Schedule** (the policy): a small network reads each layer's features (log FLOPs,
   parameters, activation bytes, the bytes crossing the cut after it, its position; the
   quantities that make a layer compute- or data-intensive) and gives it a distribution over
   the catalogue's options (device type on a node kind). A sample assigns every layer an
   option; consecutive layers of one option form a stage (HeterPS's merge).
2. **Provision**: each schedule's counts and microbatch size are chosen exactly for its
   bottleneck (:func:`~agents.provision.counts.best_counts`), and the plan is valued by the
   search's reward (the cost model by default).
3. **Learn**: reward ``-log(value)`` (a fixed penalty when infeasible), advantage against a
   moving baseline, one Adam step on the REINFORCE loss per batch of schedules.

Seeded: torch's generator and numpy's are seeded from the problem's seed; the same seed gives
the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeplan.agents.problem import Objective, Problem
from pipeplan.agents.provision.counts import best_counts
from pipeplan.agents.provision.exact import Found, found_batch
from pipeplan.agents.provision.kinds import Catalogue, StageCosts
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search

STAY_INIT = 3.0
"""Initial pull of a layer towards the previous layer's option (learned)."""
INFEASIBLE_PENALTY = 10.0
"""Added to the worst finite -reward of a batch for a schedule without feasible counts."""


@dataclass(frozen=True)
class HeterPSRLConfig:
    """Options of ``heterps_rl``."""

    iterations: int = 40
    """Policy updates."""
    batch: int = 32
    """Schedules sampled per update."""
    hidden: int = 32
    """Width of the policy's hidden layer."""
    lr: float = 0.05
    """Adam's learning rate."""
    baseline_decay: float = 0.8
    """Weight of the old moving baseline at each update."""
    max_sizes: int = 3
    """Microbatch sizes tried per schedule (the largest ones, fewest overheads)."""

    def __post_init__(self) -> None:
        for key in ("iterations", "batch", "hidden", "max_sizes"):
            if getattr(self, key) < 1:
                raise TypeError(f"{key}: must be >= 1, got {getattr(self, key)!r}")
        if not self.lr > 0:
            raise TypeError(f"lr: must be > 0, got {self.lr!r}")
        if not 0 <= self.baseline_decay < 1:
            raise TypeError(f"baseline_decay: must be in [0, 1), got {self.baseline_decay!r}")


def layer_features(problem: Problem, cuts: np.ndarray) -> torch.Tensor:
    """(L, 5): standardised log FLOPs, parameters, activation bytes, cut bytes after, position."""
    layers = problem.profile.layers
    L = len(layers)
    raw = np.array(
        [
            [
                np.log1p(x.flops),
                np.log1p(x.params_bytes),
                np.log1p(x.activation_bytes),
                np.log1p(cuts[i + 1]),
                i / max(L - 1, 1),
            ]
            for i, x in enumerate(layers)
        ]
    )
    raw = (raw - raw.mean(0)) / (raw.std(0) + 1e-9)
    return torch.as_tensor(raw, dtype=torch.float32)


def sample(
    logits: torch.Tensor, stay: torch.Tensor, n: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` schedules, layer by layer: layer ``i``'s logits plus ``stay`` on the option of
    layer ``i - 1`` (HeterPS merges runs of one type into a stage; a learned pull towards
    the same option keeps stages long). (n, L) options and (n,) log-probabilities."""
    L, n_opt = logits.shape
    acts = torch.zeros((n, L), dtype=torch.int64)
    logp = torch.zeros(n)
    for i in range(L):
        z = logits[i].expand(n, n_opt)
        if i > 0:
            z = z + stay * nn.functional.one_hot(acts[:, i - 1], n_opt)
        dist = torch.distributions.Categorical(logits=z)
        a = torch.multinomial(dist.probs.detach(), 1, generator=gen)[:, 0]
        acts[:, i] = a
        logp = logp + dist.log_prob(a)
    return acts, logp


def structure(assign: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Consecutive layers of one option merged: (stage bounds, option per stage)."""
    bounds, options = [0], [int(assign[0])]
    for i in range(1, len(assign)):
        if assign[i] != assign[i - 1]:
            bounds.append(i)
            options.append(int(assign[i]))
    bounds.append(len(assign))
    return tuple(bounds), tuple(options)


class HeterPSRLPlanner(Planner):
    """HeterPS's RL scheduler: layers to node kinds by REINFORCE, then counts."""

    name = "heterps_rl"
    Config = HeterPSRLConfig
    config: HeterPSRLConfig

    def search(self, problem: Problem, search: Search) -> None:
        cfg = self.config
        tables = search.evaluator.tables
        catalogue = Catalogue.of(problem.cluster, tables)
        sizes = sorted(problem.microbatch_sizes(), reverse=True)[: cfg.max_sizes]
        costs = [StageCosts(problem, tables, catalogue, b) for b in sizes]
        tp = problem.min_throughput if problem.objective is Objective.COST else None
        t_max = problem.global_batch / tp if tp else float("inf")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(problem.seed)
            feats = layer_features(problem, tables.cuts)
            policy = nn.Sequential(
                nn.Linear(feats.shape[1], cfg.hidden), nn.Tanh(),
                nn.Linear(cfg.hidden, len(catalogue.options)),
            )  # fmt: skip
            stay = nn.Parameter(torch.tensor(STAY_INIT))
            opt = torch.optim.Adam([*policy.parameters(), stay], lr=cfg.lr)
            gen = torch.Generator().manual_seed(problem.seed)
            baseline: float | None = None
            memo: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
            for _ in range(cfg.iterations):
                if search.exhausted():
                    break
                acts, logp = sample(policy(feats), stay, cfg.batch, gen)
                rewards = self._rewards(
                    acts.numpy(), problem, catalogue, costs, t_max, memo, search
                )
                baseline = (
                    float(rewards.mean())
                    if baseline is None
                    else cfg.baseline_decay * baseline
                    + (1 - cfg.baseline_decay) * float(rewards.mean())
                )
                adv = torch.as_tensor(rewards - baseline, dtype=torch.float32)
                loss = -(adv * logp).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()

    def _rewards(
        self,
        acts: np.ndarray,
        problem: Problem,
        catalogue: Catalogue,
        costs: list[StageCosts],
        t_max: float,
        memo: dict[tuple[tuple[int, ...], tuple[int, ...]], float],
        search: Search,
    ) -> np.ndarray:
        """Each sampled schedule provisioned and valued by the search's reward (each distinct
        schedule once); ``-log(value)``, or a penalty below the batch's worst."""
        keys = [structure(a) for a in acts]
        fresh: dict[int, list[tuple[tuple[tuple[int, ...], tuple[int, ...]], Found]]] = {}
        for key in dict.fromkeys(keys):
            if key in memo:
                continue
            cands = [best_counts(problem, catalogue, c, *key, t_max) for c in costs]
            ok = [f for f in cands if f is not None]
            if not ok:
                memo[key] = np.inf
                continue
            f = min(ok, key=lambda f: f.value)
            fresh.setdefault(len(f.stages), []).append((key, f))
        for group in fresh.values():
            if search.exhausted():
                for key, _ in group:
                    memo.setdefault(key, np.inf)
                continue
            values = search.evaluate(found_batch(catalogue, [f for _, f in group]))
            for (key, _), v in zip(group, values, strict=True):
                memo[key] = float(v)
        vals = np.array([memo.get(k, np.inf) for k in keys])
        ok = np.isfinite(vals) & (vals > 0)
        r = np.where(ok, -np.log(np.where(ok, vals, 1.0)), 0.0)
        floor = (r[ok].min() if ok.any() else 0.0) - INFEASIBLE_PENALTY
        return np.where(ok, r, floor)
