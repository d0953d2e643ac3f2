"""``genetic`` where memory binds: seeds that fit, operators that keep children fitting, and
an answer no worse than greedy's."""

from __future__ import annotations

import numpy as np
import pytest

from pipeplan.agents import Budget, InfeasibleError, Problem, make_planner
from pipeplan.agents.baselines.genetic.context import Context, GeneticConfig, with_recompute
from pipeplan.agents.baselines.genetic.feasible import (
    fits,
    greedy_seeds,
    group_seeds,
    repair_memory,
)
from pipeplan.agents.baselines.genetic.genome import Genomes, decode
from pipeplan.agents.baselines.genetic.operators import crossover, mutate
from pipeplan.agents.search import Search
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import LayerProfile, ModelProfile

GB = 1e9


def heavy_chain(n: int = 12) -> ModelProfile:
    """``n`` layers of 1 GB of parameters (4 GB of training state) and 10 MB of activations
    per sample: a 16 GB device holds three of them, an 8 GB one a single layer."""
    layers = [
        LayerProfile(f"l{i}", "fc", int(GB), 2e9, 10_000_000, (i + 1,) if i < n - 1 else (), {})
        for i in range(n)
    ]
    return ModelProfile("heavy", (8,), tuple(layers))


def tight_cluster() -> ClusterSpec:
    """Two fast 16 GB devices and eight slower 8 GB ones on two nodes: 14 layer slots for
    the 12 layers, so most random plans are over memory."""
    types = {
        "big": DeviceType("big", 4e13, 16, 900),
        "small": DeviceType("small", 1e13, 8, 300),
    }
    return ClusterSpec("tight", types, (Node("n0", {"big": 2}), Node("n1", {"small": 8})))


def problem(schedule: Schedule = Schedule.GPIPE, evaluations: int = 3000) -> Problem:
    budget = Budget(evaluations=evaluations, seconds=None)
    return Problem(heavy_chain(), tight_cluster(), global_batch=32, schedule=schedule,
                   budget=budget)  # fmt: skip


def context(p: Problem) -> Context:
    return Context(p, Search(p, "genetic", {}), GeneticConfig(), np.random.default_rng(0))


def plans_fit(ctx: Context, g: Genomes) -> list[bool]:
    """Whether each individual fits by the cost model's simulation (the judge), as the
    fitness decodes it (recomputing on the stages that fit only so)."""
    p, batch = ctx.problem, with_recompute(ctx, decode(g, ctx.sizes, ctx.n_layers))
    return [
        simulate(batch.plan(i, p.cluster, p.global_batch, p.schedule), p.profile, p.cluster).fits
        for i in range(batch.size)
    ]


def test_most_random_plans_are_over_memory() -> None:
    """The instance is memory-bound: the test below would be vacuous otherwise."""
    from pipeplan.agents.baselines.genetic.seeds import random_genomes

    ctx = context(problem())
    g = random_genomes(ctx, 200, 6)
    assert fits(ctx, g).mean() < 0.2


@pytest.mark.parametrize("schedule", list(Schedule))
def test_group_seeds_fit_in_memory(schedule: Schedule) -> None:
    ctx = context(problem(schedule))
    seeds = group_seeds(ctx)
    assert len(seeds) >= 3
    for g in seeds:
        assert fits(ctx, g).all()
        assert all(plans_fit(ctx, g))


def test_greedy_seeds_are_greedy_plans_at_every_microbatch() -> None:
    p = problem()
    ctx = context(p)
    g = greedy_seeds(ctx)
    assert g is not None and g.size == len(ctx.sizes)
    greedy = make_planner("greedy").plan(p)
    batch = decode(g, ctx.sizes, ctx.n_layers)
    layers = [s.layers for s in greedy.plan.stages]
    for i in range(g.size):
        plan = batch.plan(i, p.cluster, p.global_batch, p.schedule)
        assert [s.layers for s in plan.stages] == layers


@pytest.mark.parametrize("schedule", list(Schedule))
def test_mutated_children_are_repaired_to_fit(schedule: Schedule) -> None:
    """Children of fitting parents, crossed and mutated, come out of the repair fitting
    (each repaired or replaced by a fitting parent), and most of them repaired rather than
    replaced."""
    ctx = context(problem(schedule))
    by_stages: dict[int, list[Genomes]] = {}
    for g in group_seeds(ctx):
        by_stages.setdefault(g.stages, []).append(g)
    parts = max(by_stages.values(), key=len)
    parents = Genomes.concat(parts)
    pick = ctx.rng.integers(0, parents.size, size=(2, 60))
    children = mutate(ctx, crossover(parents.take(pick[0]), parents.take(pick[1]), 0.9, ctx.rng))
    assert not fits(ctx, children).all()  # the operators alone break memory
    repaired = repair_memory(ctx, children, parents)
    assert fits(ctx, repaired).all()
    assert all(plans_fit(ctx, repaired))
    parent_keys = set(parents.keys())
    children_keys = repaired.keys()
    fixed = [k not in parent_keys for k in children_keys]
    assert np.mean(fixed) > 0.5


def test_a_stage_over_memory_is_repaired_not_rejected() -> None:
    """Eight stages (the fewest that fit: 3 + 3 layers on the big devices, one on each of
    six small ones), the last five layers on one small device: the repair moves the
    boundaries instead of falling back."""
    ctx = context(problem())
    assign = np.full((1, ctx.n_devices), -1, dtype=np.int64)
    assign[0, :8] = np.arange(8)
    g = Genomes(np.arange(1, 8)[None], assign, np.full((1, 8), 2, dtype=np.int64))
    assert not fits(ctx, g)[0]
    out = repair_memory(ctx, g, Genomes(g.cuts[:0], g.assign[:0], g.mb[:0]))
    assert fits(ctx, out)[0] and plans_fit(ctx, out) == [True]
    assert out.cuts.tolist() == [[3, 6, 7, 8, 9, 10, 11]]


def test_without_a_fitting_plan_an_individual_is_kept_not_dropped() -> None:
    """No repair and no fitting fallback: the child stays (ranked by its violation)."""
    ctx = context(problem())
    assign = np.full((1, ctx.n_devices), -1, dtype=np.int64)
    assign[0, 2] = 0  # every layer on one small device, the others unused
    g = Genomes(np.zeros((1, 0), dtype=np.int64), assign, np.zeros((1, 1), dtype=np.int64))
    out = repair_memory(ctx, g, Genomes(g.cuts[:0], g.assign[:0], g.mb[:0]))
    assert out.keys() == g.keys()
    assert not fits(ctx, out)[0] and plans_fit(ctx, out) == [False]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(Schedule))
def test_genetic_fits_and_is_no_worse_than_greedy(schedule: Schedule) -> None:
    p = problem(schedule, evaluations=800)
    ours = make_planner("genetic").plan(p)
    greedy = make_planner("greedy").plan(p)
    assert ours.estimate.fits
    assert ours.estimate.batch_time_s <= greedy.estimate.batch_time_s * (1 + 1e-9)


def test_when_nothing_fits_the_message_names_memory() -> None:
    """Memory for 12 layers on 8 slots: no plan fits, and the message says by how much."""
    types = {"small": DeviceType("small", 1e13, 8, 300)}
    cluster = ClusterSpec("too-small", types, (Node("n0", {"small": 8}),))
    budget = Budget(evaluations=400, seconds=None)
    p = Problem(heavy_chain(), cluster, global_batch=32, budget=budget)
    with pytest.raises(InfeasibleError, match=r"no plan fits in memory .* needs \d+\.\d+x"):
        make_planner("genetic", population=16, generations=5).plan(p)
