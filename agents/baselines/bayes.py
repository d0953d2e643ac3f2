"""``bayes``: Bayesian optimisation over the ``genetic`` encoding with Optuna's GP sampler.

The search space has one fixed shape for every stage count, so that the Gaussian process sees
the same parameters in every trial, and every parameter is a float in ``[0, 1)`` read as one
of ``n`` equal slots (a continuous relaxation: Optuna's local search over integer parameters
is far slower per trial than over continuous ones):

- ``stages``: the stage count ``S`` in ``[min_stages, max_stages]``;
- ``cut_k`` (``k < max_stages - 1``): fractions of the layer count; the first ``S - 1``,
  sorted, are the stage boundaries;
- ``device_d`` (one per device): one of ``S + 1`` slots, "unused" or stage ``0..S-1``;
- ``mb_s`` (one per stage, or a single ``mb`` when microbatches must be equal): an index into
  the allowed microbatch sizes.

A trial is decoded and repaired exactly like a ``genetic`` individual (sorted distinct cuts,
a device for every stage) and costed through ``search.evaluate`` as a population of one. The
GP models ``log(value)``; infeasible trials (memory, throughput target) get a penalty above
the worst feasible value seen (and above their own unconstrained value, re-costed), growing
with how far they miss. The first trials are ``genetic``'s most promising structure by its
cheap proxy (balanced boundaries for the best device assignment; not costed beforehand) for
``seeds`` stage counts spread over the range, then ``n_startup_trials`` random ones, then GP
proposals. Torch (the GP's backend) runs on one thread while it searches: its matrices are
tiny, and threads only contend.

Optuna is imported with this module, which only the planner registry imports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
import torch
from optuna.distributions import FloatDistribution

from pipeplan.agents.baselines.genetic.context import Context, GeneticConfig, violation
from pipeplan.agents.baselines.genetic.genome import Genomes, decode
from pipeplan.agents.baselines.genetic.islands import stage_range
from pipeplan.agents.baselines.genetic.operators import repair
from pipeplan.agents.baselines.genetic.seeds import candidates
from pipeplan.agents.problem import Objective, Problem, ProblemError
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.objective import COST_TIE_WEIGHT


@dataclass(frozen=True)
class BayesConfig:
    """Options of the ``bayes`` planner."""

    n_trials: int = 60
    """Trials, one evaluation each (each GP proposal costs a fraction of a second)."""
    n_startup_trials: int = 16
    """Random trials before the GP takes over (after the seeds)."""
    seeds: int = 6
    """Sensible first trials (``genetic``'s seeds, spread over the stage counts)."""
    unequal: bool = True
    """Unequal per-stage microbatches (GPipe, free microbatch count only)."""
    min_stages: int = 1
    """Fewest stages tried."""
    max_stages: int | None = None
    """Most stages tried; None: as many as devices (and layers)."""

    def __post_init__(self) -> None:
        for key, ok in (
            ("n_trials", self.n_trials >= 1),
            ("n_startup_trials", self.n_startup_trials >= 0),
            ("seeds", self.seeds >= 0),
            ("min_stages", self.min_stages >= 1),
            ("max_stages", self.max_stages is None or self.max_stages >= self.min_stages),
        ):
            if not ok:
                raise ProblemError(f"bayes.{key}: out of range, got {getattr(self, key)!r}")


class BayesPlanner(Planner):
    name = "bayes"
    Config = BayesConfig

    def search(self, problem: Problem, search: Search) -> None:
        c: BayesConfig = self.config
        stages = stage_range(problem, c.min_stages, c.max_stages)
        ga = GeneticConfig(unequal=c.unequal)
        ctx = Context(problem, search, ga, np.random.default_rng(problem.seed))
        space = _Space(ctx, stages.start, stages.stop - 1)
        verbosity, threads = optuna.logging.get_verbosity(), torch.get_num_threads()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        torch.set_num_threads(1)  # Optuna's GP computes with torch: tiny matrices
        try:
            sampler = optuna.samplers.GPSampler(
                seed=problem.seed,
                n_startup_trials=c.n_startup_trials + c.seeds,
                warn_independent_sampling=False,
            )
            study = optuna.create_study(direction="minimize", sampler=sampler)
            for params in space.seed_params(c.seeds, search):
                study.enqueue_trial(params)
            self._run(study, space, search, c.n_trials)
        finally:
            optuna.logging.set_verbosity(verbosity)
            torch.set_num_threads(threads)

    def _run(self, study: Any, space: _Space, search: Search, n_trials: int) -> None:
        worst = -math.inf  # worst feasible log-value so far: infeasible trials go above it
        for _ in range(n_trials):
            if search.exhausted() and search.evaluations:  # the first trial always runs
                return
            trial = study.ask(space.distributions())
            g = space.genome(trial.params)
            batch = decode(g, space.ctx.sizes, space.ctx.n_layers)
            value = float(search.evaluate(batch)[0])
            if math.isfinite(value) and value > 0:
                told = math.log(value)
                worst = max(worst, told)
            else:
                told = max(_raw_log_value(search, batch), worst) + 1.0
                told += math.log1p(float(violation(space.ctx, batch)[0]))
            study.tell(trial, told)


def _raw_log_value(search: Search, batch: PlanBatch) -> float:
    """log of the objective an infeasible plan would have if it were allowed (re-costed)."""
    p = search.problem
    res = search.evaluator.evaluate(batch, p.global_batch, p.schedule)
    t = float(res.batch_time_s[0])
    if p.objective is Objective.COST:
        return math.log(max(float(res.cost_per_sample[0]), 1e-300) + COST_TIE_WEIGHT * t)
    return math.log(t)


class _Space:
    """The fixed-shape Optuna search space and its mapping to and from :class:`Genomes`."""

    def __init__(self, ctx: Context, lo: int, hi: int) -> None:
        self.ctx, self.lo, self.hi = ctx, lo, hi
        self.n_devices = ctx.n_devices

    def distributions(self) -> dict[str, Any]:
        unit = FloatDistribution(0.0, 1.0)
        names = ["stages"] + [f"cut_{k}" for k in range(self.hi - 1)]
        names += [f"device_{d}" for d in range(self.n_devices)]
        names += ["mb"] if self.ctx.equal else [f"mb_{s}" for s in range(self.hi)]
        return dict.fromkeys(names, unit)

    def genome(self, params: dict[str, Any]) -> Genomes:
        S = self._slot(params["stages"], self.hi - self.lo + 1) + self.lo
        L, K = self.ctx.n_layers, len(self.ctx.sizes)
        fracs = sorted(float(params[f"cut_{k}"]) for k in range(S - 1))
        cuts = np.array([[round(f * L) for f in fracs]], dtype=np.int64).reshape(1, S - 1)
        slots = [self._slot(params[f"device_{d}"], S + 1) - 1 for d in range(self.n_devices)]
        mb = [self._slot(params["mb" if self.ctx.equal else f"mb_{s}"], K) for s in range(S)]
        g = Genomes(cuts, np.array([slots], dtype=np.int64), np.array([mb], dtype=np.int64))
        return repair(self.ctx, g)

    @staticmethod
    def _slot(x: float, n: int) -> int:
        """A unit-interval parameter read as one of ``n`` equal slots."""
        return min(int(float(x) * n), n - 1)

    @staticmethod
    def _centre(i: int, n: int) -> float:
        return (i + 0.5) / n

    def seed_params(self, n: int, search: Search) -> list[dict[str, Any]]:
        """Parameters of ``genetic``'s best uncosted candidate, for stage counts spread over
        the range (costing more candidates would spend evaluations outside the trials); no
        more once the time budget is spent (ranking candidates is O(S L^2) per assignment:
        slow on models of hundreds of layers)."""
        out: list[dict[str, Any]] = []
        counts = np.unique(np.linspace(self.lo, self.hi, num=max(n, 1)).round().astype(int))
        for S in counts[:n]:
            if out and search.exhausted():
                break
            out.append(self._params(candidates(self.ctx, int(S), 1), int(S)))
        return out

    def _params(self, g: Genomes, S: int) -> dict[str, Any]:
        L = self.ctx.n_layers
        K = len(self.ctx.sizes)
        p: dict[str, Any] = {"stages": self._centre(S - self.lo, self.hi - self.lo + 1)}
        cuts = list(g.cuts[0] / L) + [1.0] * (self.hi - S)
        p |= {f"cut_{k}": float(cuts[k]) for k in range(self.hi - 1)}
        p |= {f"device_{d}": self._centre(int(s) + 1, S + 1) for d, s in enumerate(g.assign[0])}
        if self.ctx.equal:
            p["mb"] = self._centre(int(g.mb[0, 0]), K)
        else:
            p |= {f"mb_{s}": self._centre(int(g.mb[0, min(s, S - 1)]), K) for s in range(self.hi)}
        return p
