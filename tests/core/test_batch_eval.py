"""batch_eval agrees with simulate on random plans, profiles and clusters."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Plan, Schedule, Stage

from .strategies import clusters, plans, profiles


@st.composite
def populations(draw: st.DrawFn) -> tuple:
    profile = draw(profiles())
    cluster = draw(clusters())
    S = draw(st.integers(1, min(len(profile), len(cluster.device_ids), 4)))
    schedule = draw(st.sampled_from(list(Schedule)))
    batch = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 7, 10]))
    recompute = draw(st.booleans())  # some populations with recomputing stages (rules 2r, 9r)
    pop = draw(
        st.lists(plans(profile, cluster, S, schedule, batch, recompute), min_size=1, max_size=6)
    )
    return profile, cluster, schedule, batch, pop


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(populations())
def test_batch_eval_matches_simulate(case: tuple) -> None:
    profile, cluster, schedule, batch, pop = case
    result = BatchEvaluator(profile, cluster).evaluate(
        PlanBatch.from_plans(pop, cluster), batch, schedule
    )
    for i, plan in enumerate(pop):
        est = simulate(plan, profile, cluster)
        assert result.batch_time_s[i] == pytest.approx(est.batch_time_s, rel=1e-9, abs=1e-300)
        assert bool(result.fits[i]) == est.fits
        assert result.cost_per_hour[i] == pytest.approx(est.cost_per_hour, rel=1e-12)
        worst = max(st.memory_bytes / st.memory_capacity_bytes for st in est.stages)
        assert result.memory_ratio[i] == pytest.approx(worst, rel=1e-9)
        # recomputing or not, whichever holds less, stage by stage (rules 9 and 9r)
        plain, again = (simulate(recomputing(plan, f), profile, cluster).stages for f in (0, 1))
        least = max(
            min(a.memory_bytes, b.memory_bytes) / a.memory_capacity_bytes
            for a, b in zip(plain, again, strict=True)
        )
        assert result.recompute_ratio is not None
        assert result.recompute_ratio[i] == pytest.approx(least, rel=1e-9)


def recomputing(plan: Plan, on: int) -> Plan:
    """``plan`` with every stage recomputing (``on``) or none."""
    stages = tuple(dataclasses.replace(s, recompute=bool(on)) for s in plan.stages)
    return Plan(plan.global_batch, stages, plan.schedule)


def test_plan_batch_round_trips_plans(tmp_path: object) -> None:
    from pipeplan.core.cluster import ClusterSpec, DeviceType, Node

    c = ClusterSpec("c", {"a": DeviceType("a", 1e9, 1)}, (Node("n0", {"a": 3}),))
    p = Plan(8, (Stage((0, 2), ("n0/a:2",), 4), Stage((2, 5), ("n0/a:0", "n0/a:1"), 8)))
    batch = PlanBatch.from_plans([p], c)
    assert batch.plan(0, c, 8) == p
    assert batch.recompute is None  # no stage recomputes: the arrays are as before
    again = Plan(8, (p.stages[0], Stage((2, 5), ("n0/a:0", "n0/a:1"), 8, recompute=True)))
    batch = PlanBatch.from_plans([p, again], c)
    assert batch.recompute is not None and batch.recompute.tolist() == [[0, 0], [0, 1]]
    assert batch.plan(1, c, 8) == again and batch.rows(slice(1, 2)).plan(0, c, 8) == again


def test_recompute_flags_of_another_shape_are_refused() -> None:
    from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
    from pipeplan.core.profile import LayerProfile, ModelProfile

    c = ClusterSpec("c", {"a": DeviceType("a", 1e9, 1)}, (Node("n0", {"a": 1}),))
    layers = (LayerProfile("l0", "fc", 10, 1e6, 10, (1,)), LayerProfile("l1", "fc", 10, 1e6, 10))
    bad = PlanBatch(np.array([[0, 2]]), np.array([[2]]), np.array([[[0]]]), np.ones((1, 2), bool))
    with pytest.raises(PlanError, match=r"population.recompute: shape \(1, 2\), expected \(1, 1\)"):
        BatchEvaluator(ModelProfile("m", (1,), layers), c).evaluate(bad, 4)


def test_population_must_share_the_stage_count() -> None:
    from pipeplan.core.cluster import ClusterSpec, DeviceType, Node

    c = ClusterSpec("c", {"a": DeviceType("a", 1e9, 1)}, (Node("n0", {"a": 2}),))
    one = Plan(2, (Stage((0, 2), ("n0/a:0",), 2),))
    two = Plan(2, (Stage((0, 1), ("n0/a:0",), 2), Stage((1, 2), ("n0/a:1",), 2)))
    with pytest.raises(PlanError, match=r"one stage count, got \[1, 2\]"):
        PlanBatch.from_plans([one, two], c)


def test_bad_population_arrays_are_refused() -> None:
    from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
    from pipeplan.core.profile import LayerProfile, ModelProfile

    c = ClusterSpec("c", {"a": DeviceType("a", 1e9, 1)}, (Node("n0", {"a": 2}),))
    prof = ModelProfile("m", (1,), tuple(LayerProfile(f"l{i}", "fc", 1, 1.0, 1) for i in range(3)))
    ev = BatchEvaluator(prof, c)
    bad = PlanBatch(np.array([[0, 2]]), np.array([[3]]), np.array([[[0]]]))
    with pytest.raises(PlanError, match="from 0 to 3 layers"):
        ev.evaluate(bad, 6)
    bad = PlanBatch(np.array([[0, 3]]), np.array([[7]]), np.array([[[0]]]))
    with pytest.raises(PlanError, match=r"must be in \[1, global_batch 6\]"):
        ev.evaluate(bad, 6)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_chunks_and_both_gpipe_paths_agree_with_simulate(schedule: Schedule) -> None:
    """A population over several chunks, with remainders and unequal sizes: the evaluator
    vectorised over microbatches, the one walking them, and ``simulate`` agree."""
    from pipeplan.core.batch_eval import CHUNK
    from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
    from pipeplan.core.profile import LayerProfile, ModelProfile

    rng = np.random.default_rng(5)
    n, S, B, P = 12, 3, 10, CHUNK * 2 + 37
    layers = tuple(
        LayerProfile(f"l{i}", "fc", int(rng.integers(0, 10**6)), float(rng.uniform(1e6, 1e8)),
                     int(rng.integers(1, 10**5)), (i + 1,) if i < n - 1 else ())
        for i in range(n)
    )  # fmt: skip
    prof = ModelProfile("m", (1,), layers)
    types = {"a": DeviceType("a", 1e10, 8), "b": DeviceType("b", 3e10, 8)}
    cluster = ClusterSpec("c", types, (Node("n0", {"a": 2, "b": 1}), Node("n1", {"b": 2})))
    cuts = np.sort(
        np.stack([rng.choice(np.arange(1, n), S - 1, replace=False) for _ in range(P)]), 1
    )
    bounds = np.concatenate([np.zeros((P, 1), int), cuts, np.full((P, 1), n)], axis=1)
    devices = np.full((P, S, 2), -1)
    perm = np.argsort(rng.random((P, 5)), axis=1)
    devices[:, :, 0] = perm[:, :S]
    two = rng.random(P) < 0.5
    devices[two, 0, 1] = perm[two, S]
    mb = rng.integers(1, B + 1, size=(P, S))
    mb[::3] = mb[::3, :1]  # a third with equal sizes
    pop = PlanBatch(bounds, mb, devices)
    scan = BatchEvaluator(prof, cluster).evaluate(pop, B, schedule)
    loop = BatchEvaluator(prof, cluster, over_microbatches=False).evaluate(pop, B, schedule)
    np.testing.assert_allclose(scan.batch_time_s, loop.batch_time_s, rtol=1e-9)
    np.testing.assert_array_equal(scan.fits, loop.fits)
    for i in range(0, P, 97):
        est = simulate(pop.plan(i, cluster, B, schedule), prof, cluster)
        assert scan.batch_time_s[i] == pytest.approx(est.batch_time_s, rel=1e-9)
        worst = max(st.memory_bytes / st.memory_capacity_bytes for st in est.stages)
        assert scan.memory_ratio[i] == pytest.approx(worst, rel=1e-9)
