"""``genetic``: UMPIPE's DGAP, a dual-chromosome genetic algorithm, with TiDGAP's fitness.

- :mod:`~agents.baselines.genetic.genome`: the two chromosomes (structure: stage boundaries
  and each device's stage; data partition: each stage's microbatch size) and their decoding
  to a :class:`~core.batch_eval.PlanBatch`;
- :mod:`~agents.baselines.genetic.context`: the options, the problem's tables and TiDGAP's
  population-at-once fitness with its cache and the violation of infeasible plans;
- :mod:`~agents.baselines.genetic.balance`: min-max balanced boundaries for given devices;
- :mod:`~agents.baselines.genetic.operators`: repair, selection, crossover, mutation and the
  neighbourhood;
- :mod:`~agents.baselines.genetic.seeds`: seeded and random initial populations;
- :mod:`~agents.baselines.genetic.feasible`: seeds that fit in memory by construction (group
  splits, greedy's plan) and the repair that keeps children within memory;
- :mod:`~agents.baselines.genetic.islands`: one island per stage count, restarts, polish and
  the planner's two phases (equal microbatches, then unequal ones).

Quality against ``brute`` and ``dp``, search time and evaluations: ``bench/plan_quality.py``
(results in ``bench/results/plan_quality/``).
"""

from pipeplan.agents.baselines.genetic.context import GeneticConfig
from pipeplan.agents.baselines.genetic.islands import GeneticPlanner

__all__ = ["GeneticConfig", "GeneticPlanner"]
