"""A cluster's calibration: its format, its errors and its terms in the cost model (rule 1c)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.calibration import Calibration, CallOverhead
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import FormatError
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import LayerTiming, ModelProfile

from .test_costmodel import chain, cluster

CALIBRATION = Calibration(
    compute_scale={"a": 2.0},
    call_overhead={"a": CallOverhead(1e-3, 2e-3)},
    network={"inter_node": (8.0, 1000.0)},
    all_reduce={"intra_node": (8.0, 3000.0)},
    step_overhead_s=5e-3,
    fit={"runs": 3},
    memory_bandwidth_gbps={"b": 5.0},
    model_scale={"m@1:00000000": 1.2},
)


def calibrated() -> ClusterSpec:
    return cluster().calibrated(CALIBRATION)


def test_one_stage_on_paper() -> None:
    """B=4, b=2 (M=2) on n0/a:0, 4 layers of 1e6 FLOPs at 1e9 FLOP/s: F = 8 ms, backward
    16 ms; scale 2 -> 16 and 32 ms; + call overheads 1 and 2 ms -> 17 and 34 ms. Update
    4 x 4000 / 1e11 = 0.16 us, accumulation (M-1)/M of it on each backward (0.08 us).
    Batch: 2 x 17 + 2 x (34 ms + 0.08 us) + 0.16 us + step 5 ms."""
    plan = Plan(4, (Stage((0, 4), ("n0/a:0",), 2),))
    est = simulate(plan, chain(4), calibrated())
    assert est.stages[0].forward_s == pytest.approx(0.017, rel=1e-12)
    assert est.stages[0].backward_s == pytest.approx(0.034 + 8e-8, rel=1e-12)
    assert est.batch_time_s == pytest.approx(0.034 + 0.068 + 16e-8 + 16e-8 + 0.005, rel=1e-12)
    plain = simulate(plan, chain(4), cluster())
    assert plain.batch_time_s == pytest.approx(0.016 + 0.032 + 32e-8, rel=1e-12)


def test_fitted_link_replaces_the_spec_network() -> None:
    """Two stages across nodes: each send is 1 ms + 100 B x 2 / 1e9 B/s (8 Gbit/s)."""
    spec = calibrated()
    assert spec.link(["n0/a:0"], ["n1/a:0"]).latency_us == 1000.0
    intra = spec.link(["n0/a:0"], ["n0/a:1"])  # its sends not fitted: the spec's
    assert (intra.bandwidth_gbps, intra.latency_us) == (100.0, 5.0)
    assert spec.link(["n0/a:0"], ["n1/a:0"]).ring_latency_us is None  # ring not fitted
    plan = Plan(4, (Stage((0, 2), ("n0/a:0",), 2), Stage((2, 4), ("n1/a:0",), 2)))
    est = simulate(plan, chain(4), spec)
    assert est.stages[0].transfer_s == pytest.approx(2 * (1e-3 + 200 / 1e9), rel=1e-12)


def test_fitted_ring_round_prices_the_all_reduce() -> None:
    """One stage on n0's two devices: rule 8r's ring over 2 replicas of 4 x 1000 B is
    2 (r-1)/r x 4000 B / 1e9 B/s (8 Gbit/s) + 2 (r-1) x 3 ms; the sends' numbers are not used."""
    plan = Plan(4, (Stage((0, 4), ("n0/a:0", "n0/a:1"), 4),))
    est = simulate(plan, chain(4), calibrated())
    assert est.stages[0].allreduce_s == pytest.approx(4000 / 1e9 + 2 * 3e-3, rel=1e-12)
    plain = simulate(plan, chain(4), cluster())
    link = cluster().network.intra_node  # uncalibrated: the link's own numbers
    assert plain.stages[0].allreduce_s == pytest.approx(
        4000 / link.bytes_per_s + 2 * link.latency_s, rel=1e-12
    )


def test_fitted_memory_bandwidth_prices_the_update() -> None:
    """Rule 8u: one stage on n1's a and b replicas (spec 100 and 50 GB/s; b fitted to 5): the
    update is 4 x 4000 B / 5e9 B/s, set by b, and rule 2b's accumulation ((M-1)/M of it on
    each backward) follows it; a stage on a alone keeps the spec's 100 GB/s."""
    spec = cluster().calibrated(Calibration(memory_bandwidth_gbps={"b": 5.0}))
    assert spec.memory_bandwidth_gbps("b") == 5.0 and spec.memory_bandwidth_gbps("a") == 100.0
    assert cluster().memory_bandwidth_gbps("b") == 50.0
    plan = Plan(4, (Stage((0, 4), ("n1/a:0", "n1/b:0"), 2),))
    est, plain = simulate(plan, chain(4), spec), simulate(plan, chain(4), cluster())
    assert est.stages[0].update_s == pytest.approx(16000 / 5e9, rel=1e-12)
    assert plain.stages[0].update_s == pytest.approx(16000 / 50e9, rel=1e-12)
    extra = est.stages[0].backward_s - plain.stages[0].backward_s  # M = 2
    assert extra == pytest.approx(0.5 * (16000 / 5e9 - 16000 / 50e9), rel=1e-6)
    alone = Plan(4, (Stage((0, 4), ("n1/a:0",), 2),))
    assert simulate(alone, chain(4), spec).stages[0].update_s == pytest.approx(16000 / 100e9)


def test_batch_eval_uses_the_calibration() -> None:
    spec = calibrated()
    plans = [
        Plan(8, (Stage((0, 2), ("n0/a:0",), 2), Stage((2, 4), ("n1/a:0", "n1/b:0"), 4))),
        Plan(8, (Stage((0, 1), ("n1/b:0",), 8), Stage((1, 4), ("n0/a:0", "n0/a:1"), 2))),
    ]  # the second's replicas all-reduce over the fitted ring
    result = BatchEvaluator(chain(4), spec).evaluate(PlanBatch.from_plans(plans, spec), 8)
    for i, plan in enumerate(plans):
        assert result.batch_time_s[i] == pytest.approx(
            simulate(plan, chain(4), spec).batch_time_s, rel=1e-9
        )


def test_model_scale_multiplies_only_its_own_models_layers() -> None:
    """Rule 1c's model scale: the paper case above with ``model_scale`` 1.5 on the chain's
    model: F = 1.5 x 16 + 1 = 25 ms, backward 1.5 x 32 + 2 = 50 ms (the call overheads and
    the update unscaled); another model's key leaves it at 17 and 34 ms."""
    plan = Plan(4, (Stage((0, 4), ("n0/a:0",), 2),))
    profile = chain(4)
    for key, fwd, bwd in ((profile.model_key, 0.025, 0.050), ("other@3:00000000", 0.017, 0.034)):
        cal = dataclasses.replace(CALIBRATION, model_scale={key: 1.5})
        est = simulate(plan, profile, cluster().calibrated(cal))
        assert est.stages[0].forward_s == pytest.approx(fwd, rel=1e-12)
        assert est.stages[0].backward_s == pytest.approx(bwd + 8e-8, rel=1e-12)


def test_model_key_names_the_model_not_its_timings() -> None:
    """A profile with other timings (measured again) keeps its model key; one more layer or
    another input shape changes it."""
    profile = chain(4)
    retimed = profile.with_timings("a", [LayerTiming(2e-3, 4e-3)] * 4)
    assert retimed.model_key == profile.model_key
    assert profile.model_key.startswith(f"{profile.name}@")
    assert chain(5).model_key != profile.model_key
    reshaped = ModelProfile(profile.name, (7,), profile.layers)
    assert reshaped.model_key != profile.model_key


def test_round_trip_through_the_document() -> None:
    spec = calibrated()
    again = ClusterSpec.from_dict(spec.to_dict())
    assert again.calibration == CALIBRATION
    assert again.to_dict() == spec.to_dict()
    assert "calibration" not in cluster().to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"compute_scale": {"zz": 1.0}}, "calibration.compute_scale: unknown device type 'zz'"),
        ({"compute_scale": {"a": 40.0}}, "calibration.compute_scale.a: must be in [0.1, 10]"),
        ({"call_overhead": {"a": {"fwd_s": -1}}}, "calibration.call_overhead.a.fwd_s: must be"),
        ({"call_overhead": {"b": "x"}}, "calibration.call_overhead.b"),
        ({"network": {"wan": {}}}, "calibration.network: unknown link class 'wan'"),
        (
            {"network": {"inter_node": {"bandwidth_gbps": 0, "latency_us": 1}}},
            "calibration.network.inter_node.bandwidth_gbps: must be > 0, got 0",
        ),
        ({"all_reduce": {"ring": {}}}, "calibration.all_reduce: unknown link class 'ring'"),
        (
            {"all_reduce": {"intra_node": {"bandwidth_gbps": 0, "latency_us": 1}}},
            "calibration.all_reduce.intra_node.bandwidth_gbps: must be > 0, got 0",
        ),
        (
            {"all_reduce": {"intra_node": {"bandwidth_gbps": 2}}},
            "calibration.all_reduce.intra_node",
        ),
        ({"all_reduce": [1]}, "calibration.all_reduce: expected an object, got [1]"),
        ({"step_overhead_s": "soon"}, "calibration.step_overhead_s: expected a number"),
        (
            {"memory_bandwidth_gbps": {"zz": 3.0}},
            "calibration.memory_bandwidth_gbps: unknown device type 'zz'",
        ),
        (
            {"memory_bandwidth_gbps": {"a": 0}},
            "calibration.memory_bandwidth_gbps.a: must be a number > 0, got 0",
        ),
        (
            {"memory_bandwidth_gbps": {"a": "fast"}},
            "calibration.memory_bandwidth_gbps.a: expected a number, got 'fast'",
        ),
        ({"memory_bandwidth_gbps": 7}, "calibration.memory_bandwidth_gbps: expected an object"),
        ({"scale": 1}, "calibration: unknown key 'scale'"),
        (
            {"model_scale": {"gpt@32:0123abcd": 0.01}},
            "calibration.model_scale.gpt@32:0123abcd: must be in [0.1, 10], got 0.01",
        ),
        (
            {"model_scale": {"gpt@32:0123abcd": "big"}},
            "calibration.model_scale.gpt@32:0123abcd: expected a number, got 'big'",
        ),
        ({"model_scale": [2]}, "calibration.model_scale: expected an object, got [2]"),
        ({"model_scale": {"": 1.0}}, "calibration.model_scale: keys must be model keys"),
    ],
)
def test_bad_calibration_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    doc = cluster().to_dict()
    doc["calibration"] = change
    with pytest.raises(FormatError) as err:
        ClusterSpec.from_dict(doc)
    assert message in str(err.value)


def test_calibration_must_be_an_object() -> None:
    doc = cluster().to_dict() | {"calibration": [1]}
    with pytest.raises(FormatError, match=r"calibration: expected an object, got \[1\]"):
        ClusterSpec.from_dict(doc)
