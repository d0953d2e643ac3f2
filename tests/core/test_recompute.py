"""Activation recomputation in the plan format and the cost model (rules 2r and 9r), on
cases worked out by hand; the population evaluator's agreement is in ``test_batch_eval``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeplan.core.bounds import lower_bound
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import FormatError, PlanError
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from tests.core.test_costmodel import chain, cluster


def two_stages(recompute: tuple[bool, bool], batch: int = 4) -> Plan:
    return Plan(
        batch,
        (
            Stage((0, 2), ("n0/a:0",), 2, recompute[0]),
            Stage((2, 4), ("n1/a:0",), 2, recompute[1]),
        ),
    )


# --- the plan format -------------------------------------------------------------------------


def test_recompute_round_trips_and_is_written_only_when_on() -> None:
    plain = two_stages((False, False))
    assert all("recompute" not in s for s in plain.to_dict()["stages"])
    assert Plan.from_dict(plain.to_dict()) == plain
    again = two_stages((False, True))
    doc = again.to_dict()
    assert [s.get("recompute") for s in doc["stages"]] == [None, True]
    assert Plan.from_dict(doc) == again and again.recomputing == (1,)


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_a_recompute_that_is_not_a_bool_names_the_stage_and_value(value: object) -> None:
    doc = two_stages((False, False)).to_dict()
    doc["stages"][1]["recompute"] = value
    with pytest.raises(
        FormatError,
        match=rf"stages\[1\]\.recompute: expected true or false, got {re.escape(repr(value))}",
    ):
        Plan.from_dict(doc)
    with pytest.raises(PlanError, match=r"stages\[0\]\.recompute: must be true or false, got 1"):
        Plan(4, (Stage((0, 4), ("n0/a:0",), 2, 1),))  # type: ignore[arg-type]


# --- rule 2r: the backward reruns the forward --------------------------------------------------


def test_two_stage_gpipe_with_the_last_stage_recomputing_on_paper() -> None:
    """``test_two_stage_gpipe_on_paper`` with stage 1 recomputing: its backwards last
    F + Bk = 4 + 8 = 12 ms (+ the accumulation a).

      s1: F0 4.05016-8.05016, F1 -12.05016, B0 -24.05016+a, B1 -36.05016+2a
      grads deliver 24.10032+a, 36.10032+2a (50.16 us each)
      s0: B0 24.10032+a - 32.10032+2a, B1 36.10032+2a - 44.10032+3a; update 2a
    """
    a = 4e-8
    est = simulate(two_stages((False, True)), chain(4), cluster())
    assert est.stages[1].backward_s == pytest.approx(0.012 + a, rel=1e-12)
    assert est.stages[0].backward_s == pytest.approx(0.008 + a, rel=1e-12)
    assert est.stages[1].end_s == pytest.approx(0.03605016 + 4 * a, rel=1e-12)
    assert est.batch_time_s == pytest.approx(0.04410032 + 5 * a, rel=1e-12)
    assert est.stages[1].compute_s == pytest.approx(2 * (0.004 + 0.012 + a), rel=1e-12)
    doc = est.to_dict()["stages"]
    assert [d.get("recompute") for d in doc] == [None, True]  # written only where on


def test_each_replica_reruns_its_own_forward() -> None:
    """Replicas a (forward 1 ms, backward 1 ms per sample) and b (0.1 ms, 3 ms), one sample
    each: without recompute Bk = max(1, 3) = 3 ms; with it max(1 + 1, 0.1 + 3) = 3.1 ms, not
    max(1, 0.1) + max(1, 3) = 4 ms."""
    t = {"a": LayerTiming(fwd_s=1e-3, bwd_s=1e-3), "b": LayerTiming(fwd_s=1e-4, bwd_s=3e-3)}
    profile = ModelProfile("m", (1,), (LayerProfile("x", "fc", 0, 1e6, 8, (), t),))
    devices = ("n1/a:0", "n1/b:0")
    plain = simulate(Plan(2, (Stage((0, 1), devices, 2),)), profile, cluster())
    again = simulate(Plan(2, (Stage((0, 1), devices, 2, True),)), profile, cluster())
    assert plain.stages[0].backward_s == pytest.approx(3e-3, rel=1e-12)
    assert again.stages[0].backward_s == pytest.approx(3.1e-3, rel=1e-12)
    assert again.stages[0].forward_s == plain.stages[0].forward_s == pytest.approx(1e-3)


# --- rule 9r: only the inputs are held ---------------------------------------------------------


def test_recomputing_stages_hold_their_inputs_and_one_microbatch() -> None:
    """B = 8, b = 2: GPipe holds M = 4 microbatches. chain(4): 1000 parameter bytes and 100
    activation bytes per sample and layer; the cut before layer 2 carries 100 bytes."""
    est = simulate(two_stages((True, True), batch=8), chain(4), cluster())
    params = 4 * 2000
    assert est.stages[0].memory_bytes == params + 0 + 2 * 200  # the model input is not counted
    assert est.stages[1].memory_bytes == params + 4 * 2 * 100 + 2 * 200
    plain = simulate(two_stages((False, False), batch=8), chain(4), cluster())
    assert plain.stages[1].memory_bytes == params + 4 * 2 * 200
    one_f = Plan(8, two_stages((True, True), batch=8).stages, Schedule.ONE_F_ONE_B)
    held = simulate(one_f, chain(4), cluster()).stages  # warm-ups 1 and 0: 2 and 1 held
    assert [s.memory_bytes for s in held] == [params + 2 * 200, params + 1 * 2 * 100 + 2 * 200]


def test_a_stage_over_memory_says_when_recompute_would_fit() -> None:
    """One stage of 4 layers of 1 GB of parameters and 100 MB of activations per sample,
    b = 2, B = 8: 16 GB of state and 3.2 GB of held activations without recompute, 0.8 GB
    with it; the device holds 17 GB."""
    model = chain(4, act=100_000_000, params=1_000_000_000)
    plan = Plan(8, (Stage((0, 4), ("n0/a:0",), 2),))
    est = simulate(plan, model, cluster(gb=17))
    assert est.not_fitting == (
        "stage 0 on n0/a:0: needs 19.200 GB > 17 GB of a (16.800 GB with recompute: it would fit)",
    )
    fixed = Plan(8, (Stage((0, 4), ("n0/a:0",), 2, True),))
    assert simulate(fixed, model, cluster(gb=17)).fits
    tight = simulate(plan, model, cluster(gb=16.5))  # 16.8 GB would not fit either
    assert tight.not_fitting == ("stage 0 on n0/a:0: needs 19.200 GB > 16.5 GB of a",)


# --- a tensor-parallel group as one device type (docs/concepts/cost-model.md) -----------------


def test_the_documented_tensor_parallel_group_holds_a_layer_no_gpu_does() -> None:
    page = (Path(__file__).parents[2] / "docs/concepts/cost-model.md").read_text()
    section = page.split("## Where tensor parallelism is needed", 1)[1]
    snippet = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    groups = ClusterSpec.from_dict(yaml.safe_load(snippet))
    assert groups.device_types["a100x8"].memory_gb == 8 * 80
    one = ClusterSpec.from_dict(
        {"name": "a100", "device_types": {"a100": {"flops": 2.5e14, "memory_gb": 80}},
         "nodes": [{"name": "n0", "devices": {"a100": 8}}]}
    )  # fmt: skip
    layer = LayerProfile("big", "fc", 100_000_000_000, 1e12, 10_000_000)  # 400 GB of state
    profile = ModelProfile("m", (8,), (layer,))
    (oversized,) = lower_bound(profile, one, 8).oversized
    assert "tensor parallelism" in oversized.message()
    assert lower_bound(profile, groups, 8).fits
    plan = Plan(8, (Stage((0, 1), (groups.device_ids[0],), 1, recompute=True),))
    assert simulate(plan, profile, groups).fits
