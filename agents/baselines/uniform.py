"""``uniform``: equal layer counts per stage, one device per stage (GPipe's default split,
TAPP's "Pipe-Torch" baseline). It tries every stage count on the fastest devices and every
allowed microbatch size, and keeps the best for the objective."""

from __future__ import annotations

from pipeplan.agents.baselines.common import devices_fastest_first, population
from pipeplan.agents.problem import Problem
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core.plan import uniform_stages


class UniformPlanner(Planner):
    name = "uniform"

    def search(self, problem: Problem, search: Search) -> None:
        order = devices_fastest_first(problem.cluster)
        n_layers = len(problem.profile)
        for S in range(1, min(len(order), n_layers) + 1):
            ranges = uniform_stages(n_layers, S)
            bounds = [[0] + [end for _, end in ranges]]
            devices = [[[order[s]] for s in range(S)]]
            search.evaluate(population(bounds, devices, problem.microbatch_sizes()))
            if search.exhausted():
                return
