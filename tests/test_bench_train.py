"""bench.train's numbers and table (no Ray): the median after the warm-up, the ratios to the
single device and to BSP, the loss check's difference, and the factory model it names."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.models import small_resnet
from bench.train import (
    BSP,
    PLANNED,
    SINGLE,
    cells,
    describe,
    loss_checks,
    max_abs_difference,
    render,
    throughput,
    with_ratios,
)
from pipeplan.core.plan import Plan, Stage


def test_throughput_is_the_median_after_the_warmup() -> None:
    assert throughput([1.0, 10.0, 30.0, 20.0], warmup=1) == 20.0
    assert throughput([5.0, 7.0], warmup=0) == 6.0
    assert throughput([5.0], warmup=3) == 5.0  # nothing after the warm-up: every step
    with pytest.raises(ValueError, match="no steps"):
        throughput([], warmup=0)


def test_max_abs_difference_of_two_loss_curves() -> None:
    assert max_abs_difference([2.0, 1.5, 1.0], [2.0, 1.25, 1.125]) == 0.25
    with pytest.raises(ValueError, match="curves of 2 and 1 steps"):
        max_abs_difference([1.0, 2.0], [1.0])


def rows() -> list[dict[str, Any]]:
    speeds = {PLANNED: 60.0, SINGLE: 40.0, BSP: 20.0}
    out = [{"model": "m", "plan": p, "samples_per_s": s} for p, s in speeds.items()]
    return out + [{"model": "n", "plan": PLANNED, "samples_per_s": 9.0}]


def test_ratios_are_to_the_same_models_single_device_and_bsp() -> None:
    got = {(r["model"], r["plan"]): (r["vs_single"], r["vs_bsp"]) for r in with_ratios(rows())}
    assert got == {
        ("m", PLANNED): (1.5, 3.0),
        ("m", SINGLE): (1.0, 2.0),
        ("m", BSP): (0.5, 1.0),
        ("n", PLANNED): (None, None),  # no baselines of its own
    }


def test_describe_and_the_table_cells() -> None:
    plan = Plan(32, (Stage((0, 8), ("n0/fast:0",), 8), Stage((8, 21), ("n1/mid:0", "n1/mid:1"), 4)))
    assert describe(plan) == "[0,8)@fast b8 | [8,21)@mid+mid b4"
    row = {
        **with_ratios(rows())[0],
        "same_as": None,
        "batch": 32,
        "stages": describe(plan),
        "predicted_s": 0.5,
        "final_loss": 2.30258,
    }
    assert cells(row) == [
        "m", PLANNED, describe(plan), "60.0", "64.0", "1.50x", "3.00x", "2.3026",
    ]  # fmt: skip
    twin = {**row, "plan": SINGLE, "same_as": PLANNED, "predicted_s": None, "samples_per_s": None}
    assert cells(twin)[1] == f"{SINGLE} (= {PLANNED})"
    assert cells(twin)[3:5] == ["-", "-"]
    table = render([row, twin], steps=4, note="EMULATED")
    assert [c.header for c in table.columns][-1] == "loss @4"
    assert table.row_count == 2 and table.caption == "EMULATED"


def test_loss_check_line() -> None:
    line = loss_checks({"gpt": {"steps": 4, "max_abs_difference": 1.2e-7}, "cnn": {"steps": 0}})
    assert line.endswith("gpt 1.2e-07 over 4 steps; cnn - over 0 steps")


def test_small_resnet_gives_logits_whatever_the_microbatch() -> None:
    """Per-sample normalisation: a sample's logits do not depend on its batch (so a plan's
    microbatches train what one whole batch does)."""
    torch.manual_seed(0)
    model = small_resnet(width=8, blocks=1).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        whole, halves = model(x), torch.cat([model(x[:2]), model(x[2:])])
    assert whole.shape == (4, 10)
    assert torch.allclose(whole, halves, atol=1e-6)
    with pytest.raises(ValueError, match=r"width \(6\) .* divisible by groups \(4\)"):
        small_resnet(width=6)
