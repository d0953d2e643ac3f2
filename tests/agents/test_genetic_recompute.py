"""``genetic`` where only activation recomputation fits: blocks of a wide inner layer and a
narrow output, GPipe holding the whole batch. Seeds and repairs count a stage as fitting
when it fits recomputing, a decoded plan recomputes on exactly those stages, and the answer
fits by the cost model's own simulation."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pipeplan.agents import Budget, InfeasibleError, Problem, make_planner
from pipeplan.agents.baselines.genetic.context import (
    Context,
    GeneticConfig,
    memory_ratio,
    with_recompute,
)
from pipeplan.agents.baselines.genetic.feasible import fits, group_seeds
from pipeplan.agents.baselines.genetic.genome import Genomes, decode
from pipeplan.agents.search import Search
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.profile import LayerProfile, ModelProfile

GB = 1e9


def blocks(n: int = 4) -> ModelProfile:
    """``n`` blocks of two layers, 100 MB of parameters each (0.4 GB of state): a wide one
    of 2 GB of activations per sample, then its output of 10 MB, which is all a cut after
    the block carries. Eight samples held of one wide layer are 16 GB, over the 8 GB
    devices; recomputing, a block holds 0.8 GB of state, its 8 inputs and one sample of
    activations: under 3 GB."""
    layers = []
    for i in range(2 * n):
        act = int(2 * GB) if i % 2 == 0 else 10_000_000
        succ = (i + 1,) if i < 2 * n - 1 else ()
        layers.append(LayerProfile(f"l{i}", "fc", 100_000_000, 1e9, act, succ))
    return ModelProfile("blocks", (8,), tuple(layers))


def problem(evaluations: int = 400) -> Problem:
    types = {"g": DeviceType("g", 1e13, 8, 300)}
    cluster = ClusterSpec("four", types, (Node("n0", {"g": 4}),))
    budget = Budget(evaluations=evaluations, seconds=None)
    return Problem(blocks(), cluster, global_batch=8, budget=budget)


def context(p: Problem) -> Context:
    return Context(p, Search(p, "genetic", {}), GeneticConfig(), np.random.default_rng(0))


def test_only_recomputation_fits_and_the_seeds_use_it() -> None:
    ctx = context(problem())
    seeds = Genomes.concat([g for g in group_seeds(ctx) if g.stages == 4])
    assert seeds.size >= 1 and fits(ctx, seeds).all()
    batch = decode(seeds, ctx.sizes, ctx.n_layers)
    assert (memory_ratio(ctx, batch) > 1).any(-1).all()  # none fits without recomputing
    again = with_recompute(ctx, batch)
    assert again.recompute is not None
    assert (again.recompute == (memory_ratio(ctx, batch) > 1)).all()
    p = ctx.problem
    for i in range(again.size):
        plan = again.plan(i, p.cluster, p.global_batch, p.schedule)
        assert plan.recomputing and simulate(plan, p.profile, p.cluster).fits


def test_a_plan_that_fits_is_left_as_it_is() -> None:
    """Recomputation costs a forward per microbatch: a stage that fits without it does not
    get it."""
    p = Problem(blocks(), problem().cluster, global_batch=1, budget=problem().budget)
    ctx = context(p)
    seeds = group_seeds(ctx)
    assert seeds and all(fits(ctx, g)[0] for g in seeds)
    for g in seeds:
        assert with_recompute(ctx, decode(g, ctx.sizes, ctx.n_layers)).recompute is None


def test_genetic_answers_with_recomputing_stages() -> None:
    p = problem(evaluations=120)
    result = make_planner("genetic", population=8, generations=3).plan(p)
    assert result.estimate.fits and result.plan.recomputing
    assert simulate(result.plan, p.profile, p.cluster).fits


def test_a_planner_without_recomputation_says_it_would_fit() -> None:
    """greedy does not recompute: its refusal says that recomputing would fit, and where to
    turn. The hint is part of a search's checkpoint, and an older one without it loads."""
    with pytest.raises(InfeasibleError) as refused:
        make_planner("greedy").plan(problem())
    message = str(refused.value)
    assert re.search(r"no plan fits in memory .* the smallest needs \d\.\d\dx", message)
    assert re.search(
        r"recompute: true on the stages over memory would make one fit \(0\.\d\dx a device's "
        r"memory\): the genetic planner recomputes where it must",
        message,
    )
    ctx, search = context(problem()), Search(problem(), "greedy", {})
    search.evaluate(decode(group_seeds(ctx)[0], ctx.sizes, ctx.n_layers))  # none recomputing
    state = search.state_dict()
    assert 0 < state["min_recompute_ratio"] < 1 < state["min_memory_ratio"]
    del state["min_recompute_ratio"]
    again = Search(problem(), "greedy", {})
    again.load_state_dict(state)
    assert "recompute" not in again.why_infeasible()
