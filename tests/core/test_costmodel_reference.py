"""``core.costmodel.simulate`` against an independent reading of DESIGN.md's ten rules.

The reference (``reference_costmodel.py``) was written from the contract alone. Cases are
generated as documents and parsed with the project's loaders, so optional fields that are
left out exercise the documented defaults; the same documents feed the real CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import Estimate, simulate
from pipeplan.core.plan import Plan, Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.service.cli import app
from tests.core.reference_costmodel import (
    RefEstimate,
    op_order,
    reference_simulate,
    upstream_microbatch,
)

Doc = dict[str, Any]
Case = tuple[Doc, Doc, Doc]  # profile, cluster, plan documents

TYPES = ("cpu", "t4", "v100")
BATCHES = (12, 8, 16, 6, 4, 2, 1, 7, 10)
REL = 1e-9


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= REL * max(abs(a), abs(b))


# --- generated documents ------------------------------------------------------------------


def _timing(draw: st.DrawFn) -> Doc:
    doc: Doc = {"fwd_s": draw(st.floats(1e-6, 1e-2)), "bwd_s": draw(st.floats(1e-6, 2e-2))}
    if draw(st.booleans()):  # the fixed costs are optional (default 0)
        doc["fwd_fixed_s"] = draw(st.floats(0, 1e-3))
        doc["bwd_fixed_s"] = draw(st.floats(0, 1e-3))
    return doc


@st.composite
def profile_docs(draw: st.DrawFn) -> Doc:
    n = draw(st.integers(1, 8) | st.integers(4, 8))
    # Per device type: timed on every layer, on none (FLOPs fallback), or on some layers.
    coverage = {t: draw(st.sampled_from(("all", "none", "some"))) for t in TYPES}
    layers = []
    for i in range(n):
        succ: set[int] = set()
        if i < n - 1:
            succ.add(i + 1)
            succ |= draw(st.sets(st.integers(i + 1, n - 1), max_size=2))
        timings = {
            t: _timing(draw)
            for t in TYPES
            if coverage[t] == "all" or (coverage[t] == "some" and draw(st.booleans()))
        }
        layers.append(
            {
                "name": f"l{i}",
                "op": draw(st.sampled_from(("conv", "fc", "relu", "add"))),
                "params_bytes": draw(st.integers(0, 10**8)),
                "flops": draw(st.floats(1e3, 1e10)),
                "activation_bytes": draw(st.integers(0, 10**6)),
                "successors": sorted(succ),
                "timings": timings,
            }
        )
    return {"name": "random", "input_shape": [3, 8, 8], "layers": layers}


def _link_doc(draw: st.DrawFn, max_gbps: float, max_us: float) -> Doc:
    doc: Doc = {}
    if draw(st.booleans()):
        doc["bandwidth_gbps"] = draw(st.floats(0.1, max_gbps))
    if draw(st.booleans()):
        doc["latency_us"] = draw(st.floats(0, max_us))
    if draw(st.booleans()):
        doc["all_reduce"] = {
            "bandwidth_gbps": draw(st.floats(0.1, max_gbps)),
            "latency_us": draw(st.floats(0, max_us)),
        }
    return doc


@st.composite
def cluster_docs(draw: st.DrawFn) -> Doc:
    types: Doc = {}
    for t in TYPES:
        doc: Doc = {"flops": draw(st.floats(1e9, 1e13)), "memory_gb": draw(st.floats(0.01, 2))}
        if draw(st.booleans()):
            doc["memory_bandwidth_gbps"] = draw(st.floats(10, 1000))
        if draw(st.booleans()):
            doc["price_per_hour"] = draw(st.floats(0, 3))
        types[t] = doc
    counts: list[dict[str, int]] = [
        {t: draw(st.sampled_from((2, 1, 0, 2))) for t in TYPES}
        for _ in range(draw(st.integers(1, 3)))
    ]
    if sum(sum(c.values()) for c in counts) < 2:
        counts[0]["cpu"] = 2
    nodes = [{"name": f"n{k}", "devices": c} for k, c in enumerate(counts)]
    cluster: Doc = {"name": "random", "device_types": types, "nodes": nodes}
    network: Doc = {}
    if draw(st.booleans()):
        network["intra_node"] = _link_doc(draw, 200, 20)
    if draw(st.booleans()):
        network["inter_node"] = _link_doc(draw, 50, 200)
    write_empty = draw(st.booleans())  # "network: {}" and no "network" both mean defaults
    if network or write_empty:
        cluster["network"] = network
    if draw(st.booleans()):  # rule 1c: a calibration of some types and link classes
        cluster["calibration"] = _calibration_doc(draw)
    return cluster


def _calibration_doc(draw: st.DrawFn) -> Doc:
    doc: Doc = {
        "compute_scale": {t: draw(st.floats(0.5, 2.0)) for t in TYPES if draw(st.booleans())},
        "call_overhead": {
            t: {"fwd_s": draw(st.floats(0, 5e-3)), "bwd_s": draw(st.floats(0, 5e-3))}
            for t in TYPES
            if draw(st.booleans())
        },
        "step_overhead_s": draw(st.floats(0, 1e-2)),
    }
    for key in ("network", "all_reduce"):  # fitted sends, fitted ring rounds (rule 8r)
        links = {
            k: {"bandwidth_gbps": draw(st.floats(0.1, 100)), "latency_us": draw(st.floats(0, 500))}
            for k in ("intra_node", "inter_node")
            if draw(st.booleans())
        }
        if links:
            doc[key] = links
    return doc


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def cases(draw: st.DrawFn, schedule: Schedule | None = None) -> Case:
    profile = draw(profile_docs())
    cluster = draw(cluster_docs())
    if "calibration" in cluster and draw(st.booleans()):
        # rule 1c's model scale: of this profile's model, or of another model (no effect)
        key = ModelProfile.from_dict(profile).model_key
        other = draw(st.booleans())
        cluster["calibration"]["model_scale"] = {
            ("other@1:00000000" if other else key): draw(st.floats(0.5, 2.0))
        }
    ids = list(ClusterSpec.from_dict(cluster).device_ids)
    n = len(profile["layers"])
    most = min(4, n, len(ids))
    num_stages = min(most, draw(st.sampled_from((3, 2, 4, 1, 2, 3, 4))))
    sched = schedule or draw(st.sampled_from(list(Schedule)))
    batch = draw(st.sampled_from(BATCHES))
    cuts = (
        sorted(
            draw(st.sets(st.integers(1, n - 1), min_size=num_stages - 1, max_size=num_stages - 1))
        )
        if num_stages > 1
        else []
    )
    bounds = [0, *cuts, n]
    ids = draw(st.permutations(ids))
    spare = len(ids) - num_stages
    # divisors of the batch, or any size up to it (the last microbatch holds the remainder)
    sizes = draw(st.sampled_from((_divisors(batch), list(range(1, batch + 1)))))
    equal_mb = draw(st.sampled_from(sizes))
    unequal = draw(st.booleans())
    stages = []
    for s in range(num_stages):
        r = 1 + draw(st.integers(0, min(spare, 2)))
        spare -= r - 1
        devices, ids = ids[:r], ids[r:]
        mb = draw(st.sampled_from(sizes)) if unequal else equal_mb
        stages.append({"layers": [bounds[s], bounds[s + 1]], "devices": devices, "microbatch": mb})
    plan: Doc = {"global_batch": batch, "stages": stages}
    if sched is Schedule.ONE_F_ONE_B or draw(st.booleans()):  # gpipe is the default
        plan["schedule"] = sched.value
    return profile, cluster, plan


def load(case: Case) -> tuple[Plan, ModelProfile, ClusterSpec]:
    profile_doc, cluster_doc, plan_doc = case
    return (
        Plan.from_dict(plan_doc),
        ModelProfile.from_dict(profile_doc),
        ClusterSpec.from_dict(cluster_doc),
    )


# --- comparison ---------------------------------------------------------------------------


def assert_agrees(est: Estimate, ref: RefEstimate) -> None:
    pairs = {
        "batch_time_s": (est.batch_time_s, ref.batch_time),
        "throughput": (est.throughput, ref.throughput),
        "cost_per_hour": (est.cost_per_hour, ref.cost_per_hour),
        "cost_per_batch": (est.cost_per_batch, ref.cost_per_batch),
        "comm_fraction": (est.comm_fraction, ref.comm_fraction),
    }
    for s, stage in enumerate(est.stages):
        pairs[f"stages[{s}].memory_bytes"] = (stage.memory_bytes, ref.memory[s])
        pairs[f"stages[{s}].forward_s"] = (stage.forward_s, ref.forward[s])
        pairs[f"stages[{s}].backward_s"] = (stage.backward_s, ref.backward[s])
        pairs[f"stages[{s}].end_s"] = (stage.end_s, ref.stage_end[s])
    pairs["transfer_s"] = (est.transfer_s, ref.transfer)
    boxes = {**ref.op_times, **ref.send_times}
    seen: set[tuple[int, str, int]] = set()
    for e in est.timeline:
        if e.kind in ("F", "B", "send", "grad"):
            key = (e.stage, e.kind, e.microbatch)
            seen.add(key)
            start, end = boxes[key]
            pairs[f"{e.kind}{e.microbatch} of stage {e.stage} start"] = (e.start, start)
            pairs[f"{e.kind}{e.microbatch} of stage {e.stage} end"] = (e.end, end)
    assert seen == set(boxes), f"timeline boxes differ: {sorted(seen ^ set(boxes))}"
    wrong = {k: v for k, v in pairs.items() if not close(*v)}
    assert not wrong, f"simulate (left) disagrees with the reference (right): {wrong}"
    assert len(est.stages) == len(ref.memory)
    assert est.fits == ref.fits, f"fits: simulate {est.fits}, reference {ref.fits}"


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(cases())
def test_simulate_and_batch_eval_agree_with_reference(case: Case) -> None:
    """Both evaluators against the reference on the same cases (drawing a case costs more
    than evaluating it three times)."""
    plan, profile, cluster = load(case)
    ref = reference_simulate(plan, profile, cluster)
    assert_agrees(simulate(plan, profile, cluster), ref)
    result = BatchEvaluator(profile, cluster).evaluate(
        PlanBatch.from_plans([plan], cluster), plan.global_batch, plan.schedule
    )
    got = float(result.batch_time_s[0])
    assert close(got, ref.batch_time), (
        f"batch_time_s: batch_eval {got!r}, reference {ref.batch_time!r}"
    )
    assert close(float(result.cost_per_hour[0]), ref.cost_per_hour)
    assert bool(result.fits[0]) is ref.fits


@PROPERTY
@given(cases(Schedule.GPIPE))
def test_gpipe_unequal_microbatches_agree(case: Case) -> None:
    plan, profile, cluster = load(case)
    assert_agrees(simulate(plan, profile, cluster), reference_simulate(plan, profile, cluster))


@PROPERTY
@given(cases(Schedule.ONE_F_ONE_B))
def test_1f1b_agrees(case: Case) -> None:
    plan, profile, cluster = load(case)
    assert_agrees(simulate(plan, profile, cluster), reference_simulate(plan, profile, cluster))


# --- the CLI ------------------------------------------------------------------------------


def run_cli(case: Case, tmp: Path) -> Any:
    for name, doc in zip(("profile", "cluster", "plan"), case, strict=True):
        (tmp / f"{name}.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--profile",
            str(tmp / "profile.json"),
            "--cluster",
            str(tmp / "cluster.json"),
            "--plan",
            str(tmp / "plan.json"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=cases())
def test_cli_json_agrees_with_reference(case: Case, tmp_path: Path) -> None:
    out = run_cli(case, tmp_path)
    ref = reference_simulate(*load(case))
    expected = {
        "batch_time_s": ref.batch_time,
        "throughput": ref.throughput,
        "cost_per_hour": ref.cost_per_hour,
        "cost_per_batch": ref.cost_per_batch,
        "comm_fraction": ref.comm_fraction,
    }
    for key, value in expected.items():
        assert close(out[key], value), f"{key}: CLI {out[key]!r}, reference {value!r}"
    assert out["fits"] is ref.fits
    memory = [stage["memory_bytes"] for stage in out["stages"]]
    assert len(memory) == len(ref.memory)
    for s, (got, want) in enumerate(zip(memory, ref.memory, strict=True)):
        assert close(got, want), f"stages[{s}].memory_bytes: CLI {got!r}, reference {want!r}"


# --- the reference itself, by hand ----------------------------------------------------------


def test_reference_op_orders_are_the_literal_tables() -> None:
    assert op_order(Schedule.GPIPE, 2, 0, 3) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2),
    ]  # fmt: skip
    # 1F1B, 3 stages, 4 microbatches: stage 0 warms up with 2, stage 2 with none.
    assert op_order(Schedule.ONE_F_ONE_B, 3, 0, 4) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3),
    ]  # fmt: skip
    assert op_order(Schedule.ONE_F_ONE_B, 3, 2, 4) == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3),
    ]  # fmt: skip
    assert op_order(Schedule.ONE_F_ONE_B, 4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize(
    ("j", "b_s", "b_other", "k"),
    [(0, 2, 4, 0), (1, 2, 4, 0), (2, 2, 4, 1), (0, 4, 2, 1), (1, 4, 2, 3), (0, 3, 2, 1)],
)
def test_reference_microbatch_holding_the_last_sample(
    j: int, b_s: int, b_other: int, k: int
) -> None:
    assert upstream_microbatch(j, b_s, b_other) == k


def test_reference_hand_computed_two_stages() -> None:
    """Two timed stages on two nodes, B=4, b=(2, 4), GPipe; every number worked by hand."""
    profile = ModelProfile.from_dict(
        {
            "name": "hand",
            "input_shape": [1],
            "layers": [
                {"name": "a", "op": "fc", "params_bytes": 1000, "flops": 1.0,
                 "activation_bytes": 125, "successors": [1],
                 "timings": {"cpu": {"fwd_s": 1.0, "bwd_s": 2.0, "fwd_fixed_s": 0.5}}},
                {"name": "b", "op": "fc", "params_bytes": 2000, "flops": 1.0,
                 "activation_bytes": 10, "successors": [],
                 "timings": {"cpu": {"fwd_s": 0.5, "bwd_s": 1.0}}},
            ],
        }
    )  # fmt: skip
    cluster = ClusterSpec.from_dict(
        {
            "name": "hand",
            "device_types": {"cpu": {"flops": 1e9, "memory_gb": 1, "price_per_hour": 3.6}},
            "nodes": [{"name": "n0", "devices": {"cpu": 1}}, {"name": "n1", "devices": {"cpu": 1}}],
            # inter-node: 1000 bytes/s (8e-6 Gbit/s), 1 s latency
            "network": {"inter_node": {"bandwidth_gbps": 8e-6, "latency_us": 1e6}},
        }
    )
    plan = Plan.from_dict(
        {
            "global_batch": 4,
            "stages": [
                {"layers": [0, 1], "devices": ["n0/cpu:0"], "microbatch": 2},
                {"layers": [1, 2], "devices": ["n1/cpu:0"], "microbatch": 4},
            ],
        }
    )
    ref = reference_simulate(plan, profile, cluster)
    # F0 = 0.5 + 2 = 2.5, Bk0 = 4; F1 = 2, Bk1 = 4. Send: 1 + 125 * 2 / 1000 = 1.25 s.
    # Stage 0: F0 [0, 2.5] send -> 3.75; F1 [2.5, 5] send [5, 6.25].
    # Stage 1 (needs upstream 1): F0 [6.25, 8.25]; B0 [8.25, 12.25]; grad 1 + 125*4/1000 = 1.5
    # -> delivered 13.75. Stage 0: B0 and B1 both need downstream microbatch 0:
    # B0 [13.75, 17.75], B1 [17.75, 21.75]; update 4 * 1000 / 1e11 = 4e-8, and each of
    # stage 0's two backwards accumulates gradients for (M - 1) / M = 1/2 of that, a = 2e-8
    # (stage 1 has one microbatch: none).
    a = 2e-8
    assert ref.op_times[(1, "F", 0)] == (6.25, 8.25)
    assert ref.op_times[(0, "B", 1)] == pytest.approx((17.75 + a, 21.75 + 2 * a), rel=1e-12)
    assert ref.batch_time == pytest.approx(21.75 + 2 * a + 4e-8, rel=1e-12)
    # comm: two sends of 1.25 and one gradient of 1.5 = 4; compute 2 * 6.5 + 1 * 6 = 19.
    assert ref.comm_fraction == pytest.approx(4 / (23 + 2 * a), rel=1e-12)
    assert ref.memory == (4 * 1000 + 2 * 2 * 125, 4 * 2000 + 1 * 4 * 10)
    assert ref.cost_per_batch == pytest.approx(7.2 * ref.batch_time / 3600, rel=1e-12)


def test_documented_defaults_reach_the_objects() -> None:
    cluster = ClusterSpec.from_dict(
        {
            "name": "d",
            "device_types": {"cpu": {"flops": 1e9, "memory_gb": 1}},
            "nodes": [{"name": "n0", "devices": {"cpu": 1}}],
        }
    )
    cpu = cluster.device_types["cpu"]
    assert (cpu.memory_bandwidth_gbps, cpu.price_per_hour) == (100, 0)
    net = cluster.network
    assert (net.intra_node.bandwidth_gbps, net.intra_node.latency_us) == (100, 5)
    assert (net.inter_node.bandwidth_gbps, net.inter_node.latency_us) == (10, 50)
    profile = ModelProfile.from_dict(
        {"name": "d", "input_shape": [1], "layers": [
            {"name": "a", "op": "fc", "params_bytes": 1, "flops": 1.0, "activation_bytes": 1,
             "timings": {"cpu": {"fwd_s": 1.0, "bwd_s": 1.0}}}]}
    )  # fmt: skip
    timing = profile.layers[0].timings["cpu"]
    assert (timing.fwd_fixed_s, timing.bwd_fixed_s) == (0, 0)
    plan = Plan.from_dict(
        {
            "global_batch": 1,
            "stages": [{"layers": [0, 1], "devices": ["n0/cpu:0"], "microbatch": 1}],
        }
    )
    assert plan.schedule is Schedule.GPIPE
