"""core.bounds: no plan beats the lower bound (random plans through the cost model, and every
planner's answer on random small problems, brute's exact one included), the bound is reached
where nothing but compute costs, and memory that cannot hold any plan is named."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.agents import Budget, InfeasibleError, Problem, ProblemError, make_planner
from pipeplan.core.bounds import lower_bound
from pipeplan.core.calibration import Calibration
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PipeplanError
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from tests.core.strategies import TYPES, calibrations, clusters, plans, profiles

REL = 1e-12
"""The bound and the simulation sum the same terms in other orders."""
SOME = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chain(
    *layers: tuple[int, float, int], timings: dict[str, LayerTiming] | None = None
) -> ModelProfile:
    """(params bytes, flops, activation bytes) layers in a chain."""
    n = len(layers)
    return ModelProfile(
        "chain",
        (8,),
        tuple(
            LayerProfile(f"l{i}", "fc", p, f, a, (i + 1,) if i + 1 < n else (), timings or {})
            for i, (p, f, a) in enumerate(layers)
        ),
    )


def one_type(count: int, flops: float = 1e12, memory_gb: float = 16.0) -> ClusterSpec:
    return ClusterSpec("one", {"g": DeviceType("g", flops, memory_gb)}, (Node("n0", {"g": count}),))


@given(profiles(max_layers=6), clusters(), st.data())
@SOME
def test_no_plan_beats_the_bound(
    profile: ModelProfile, cluster: ClusterSpec, data: st.DataObject
) -> None:
    schedule = data.draw(st.sampled_from(list(Schedule)))
    batch = data.draw(st.integers(1, 16))
    stages = data.draw(st.integers(1, min(len(profile), len(cluster.device_ids))))
    recompute = data.draw(st.booleans())  # recomputing stages hold less (rule 9r)
    plan = data.draw(plans(profile, cluster, stages, schedule, batch, recompute))
    est = simulate(plan, profile, cluster)
    bound = lower_bound(profile, cluster, batch, schedule)
    assert est.batch_time_s >= bound.batch_time_s * (1 - REL)
    assert bound.ratio(est.batch_time_s) >= 1 - REL
    if est.fits:  # the memory test is necessary: a plan that fits passes it
        assert bound.fits, bound.reasons()


@st.composite
def small_clusters(draw: st.DrawFn) -> ClusterSpec:
    """Two or three devices of up to three types on one or two nodes, maybe calibrated."""
    types = {
        t: DeviceType(t, draw(st.floats(1e10, 1e13)), draw(st.floats(0.3, 20)),
                      draw(st.floats(10, 1000)))
        for t in TYPES
    }  # fmt: skip
    devices = draw(st.lists(st.sampled_from(TYPES), min_size=2, max_size=3))
    nodes: list[dict[str, int]] = [{}, {}]
    for t in devices:
        k = draw(st.integers(0, 1))
        nodes[k][t] = nodes[k].get(t, 0) + 1
    node_list = tuple(Node(f"n{k}", c) for k, c in enumerate(nodes) if c)
    return ClusterSpec("small", types, node_list, calibration=draw(calibrations()))


@pytest.mark.slow
@given(profiles(min_layers=1, max_layers=4), small_clusters(), st.sampled_from(list(Schedule)),
       st.sampled_from([4, 6, 8]))  # fmt: skip
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_no_planner_beats_the_bound(
    profile: ModelProfile, cluster: ClusterSpec, schedule: Schedule, batch: int
) -> None:
    budget = Budget(evaluations=150, seconds=10)
    problem = Problem(
        profile, cluster, global_batch=batch, schedule=schedule, seed=1, budget=budget
    )
    bound = lower_bound(profile, cluster, batch, schedule)
    for name in ("brute", "dp", "greedy", "pipedream_dp", "genetic"):
        try:
            result = make_planner(name).plan(problem)
        except (InfeasibleError, ProblemError):  # nothing fits, or not this planner's problem
            continue
        assert result.estimate.batch_time_s >= bound.batch_time_s * (1 - REL), name
        assert bound.fits, name


def test_the_bound_is_reached_where_only_compute_costs() -> None:
    profile = chain((0, 2e9, 0), (0, 5e9, 0), (0, 1e9, 0))
    cluster = one_type(1, flops=4e12)
    plan = Plan(32, (Stage((0, 3), ("n0/g:0",), 32),))
    est = simulate(plan, profile, cluster)
    bound = lower_bound(profile, cluster, 32)
    assert bound.compute_s == pytest.approx(3 * 8e9 * 32 / 4e12, rel=REL)
    assert est.batch_time_s == pytest.approx(bound.batch_time_s, rel=REL)
    assert bound.ratio(est.batch_time_s) == pytest.approx(1.0, rel=REL)


def test_analytic_profiles_bound_total_compute_over_total_flops() -> None:
    profile = chain((10, 3e9, 100), (10, 1e9, 100))
    types = {"a": DeviceType("a", 1e12, 8), "b": DeviceType("b", 3e12, 8)}
    cluster = ClusterSpec("ab", types, (Node("n0", {"a": 2}), Node("n1", {"b": 1})))
    bound = lower_bound(profile, cluster, 10)
    assert bound.total_flops == 5e12
    assert bound.compute_s == pytest.approx(3 * 4e9 * 10 / 5e12, rel=REL)


def test_timings_count_each_layer_on_the_type_that_does_it_cheapest() -> None:
    # type a (1 TFLOP/s) runs the layer in 1 ms per sample forward and backward: 1e9
    # FLOP-seconds; b (2 TFLOP/s) needs 2 ms: 4e9. The bound takes a's work on both.
    timings = {"a": LayerTiming(4e-4, 6e-4), "b": LayerTiming(1e-3, 1e-3)}
    profile = chain((0, 1.0, 0), timings=timings)
    types = {"a": DeviceType("a", 1e12, 8), "b": DeviceType("b", 2e12, 8)}
    cluster = ClusterSpec("ab", types, (Node("n0", {"a": 1, "b": 1}),))
    bound = lower_bound(profile, cluster, 6)
    assert bound.compute_s == pytest.approx(6 * 1e9 / 3e12, rel=REL)


def test_a_calibrations_step_overhead_is_part_of_the_bound() -> None:
    cluster = one_type(1).calibrated(Calibration(step_overhead_s=0.25))
    bound = lower_bound(chain((0, 1e9, 0)), cluster, 4)
    assert bound.step_overhead_s == 0.25
    assert bound.batch_time_s == pytest.approx(bound.compute_s + 0.25, rel=REL)


def test_a_layer_no_device_holds_is_named_with_tensor_parallelism() -> None:
    profile = chain((100, 1e9, 0), (1_500_000_000, 1e9, 4_000_000), (100, 1e9, 0))
    bound = lower_bound(profile, one_type(4, memory_gb=4), 8)
    assert not bound.fits
    (big,) = bound.oversized
    assert (big.index, big.name, big.largest_type) == (1, "l1", "g")
    assert big.needs_bytes == 4 * 1_500_000_000 + 4_000_000
    assert bound.reasons() == [
        "layers[1] ('l1') needs 6.0 GB on one device (4 x its parameters + one sample's "
        "activations, even at microbatch 1 with recompute), the largest device type (g) holds "
        "4.0 GB: it needs tensor parallelism, which pipeplan does not plan; describe a "
        "tensor-parallel group as one device type (its devices' memory and FLOP/s summed) to "
        "plan the pipeline over such groups"
    ]


def test_a_model_larger_than_the_cluster_is_named() -> None:
    profile = chain(*[(500_000_000, 1e9, 1_000_000)] * 6)  # 12 GB of state, 2 GB per layer
    bound = lower_bound(profile, one_type(4, memory_gb=2.5), 8, Schedule.ONE_F_ONE_B)
    assert not bound.oversized and not bound.fits
    assert bound.min_memory_bytes == 12e9 + 6e6
    assert bound.reasons() == [
        "the model needs at least 12.0 GB (4 x parameters + the fewest activations), the "
        "cluster holds 10.0 GB in all"
    ]


def test_gpipe_recomputing_at_microbatch_one_holds_one_sample_of_activations() -> None:
    """GPipe without recomputation would hold 64 samples, 128 GB of activations; one stage
    recomputing at microbatch 1 holds 2 GB, and that plan is what the bound allows for."""
    profile = chain((0, 1e9, 1_000_000_000), (0, 1e9, 1_000_000_000))
    cluster = one_type(2, memory_gb=40)
    for schedule in Schedule:
        bound = lower_bound(profile, cluster, 64, schedule)
        assert bound.min_memory_bytes == 2e9 and bound.fits
    plan = Plan(64, (Stage((0, 2), (cluster.device_ids[0],), 1, recompute=True),))
    est = simulate(plan, profile, cluster)
    assert est.fits and est.stages[0].memory_bytes == 2e9
    plain = simulate(Plan(64, (Stage((0, 2), (cluster.device_ids[0],), 1),)), profile, cluster)
    assert plain.stages[0].memory_bytes == 128e9 and not plain.fits


@pytest.mark.parametrize("batch", [0, -3, 2.5, True])
def test_a_bad_batch_is_named(batch: object) -> None:
    with pytest.raises(
        PipeplanError, match=rf"global_batch: must be an integer >= 1, got {batch!r}"
    ):
        lower_bound(chain((0, 1e9, 0)), one_type(1), batch)  # type: ignore[arg-type]


def test_the_document_carries_the_bound_and_the_memory() -> None:
    doc = lower_bound(chain((4, 1e9, 8)), one_type(2), 4).to_dict()
    assert doc["lower_bound_s"] == doc["compute_s"] and doc["fits"] is True
    assert doc["capacity_bytes"] == 32e9 and doc["min_memory_bytes"] == 16 + 8  # 1 sample
    assert doc["reasons"] == []
