"""TAPP's literal baselines on every device: ``bsp_all`` and ``pipe_torch_all``."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeplan.agents import InfeasibleError, Problem
from pipeplan.agents.baselines.every_device import bsp_all, pipe_torch_all
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import ModelProfile

ROOT = Path(__file__).resolve().parents[2]
HETERO = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")


@pytest.fixture(scope="module")
def alexnet() -> ModelProfile:
    return load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")


def test_bsp_uses_every_device_and_the_best_microbatch(alexnet: ModelProfile) -> None:
    problem = Problem(alexnet, HETERO, global_batch=32)
    plan = bsp_all(problem)
    assert len(plan.stages) == 1 and plan.stages[0].layers == (0, len(alexnet))
    assert set(plan.stages[0].devices) == set(HETERO.device_ids)
    assert plan.stages[0].devices[0] == "n0/fast:0"  # fastest first
    best = simulate(plan, alexnet, HETERO).batch_time_s
    for m in (4, 8, 16, 32):  # every size with a sample per replica
        other = Plan(32, (Stage(plan.stages[0].layers, plan.stages[0].devices, m),))
        assert simulate(other, alexnet, HETERO).batch_time_s >= best


def test_pipe_torch_splits_equal_layer_counts_fastest_first(alexnet: ModelProfile) -> None:
    plan = pipe_torch_all(Problem(alexnet, HETERO, global_batch=32, microbatches=4))
    assert [s.devices[0] for s in plan.stages] == [
        "n0/fast:0",
        "n1/mid:0",
        "n2/slow:0",
        "n2/slow:1",
    ]
    sizes = [s.end - s.start for s in plan.stages]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(alexnet)
    assert all(s.microbatch == 8 for s in plan.stages)  # the fixed count: 32 / 4


def test_no_fitting_plan_names_the_baseline(alexnet: ModelProfile) -> None:
    tiny = ClusterSpec(
        "tiny",
        {"t": DeviceType("t", 1e12, memory_gb=1e-6)},
        (Node("n0", {"t": 2}),),
    )
    with pytest.raises(InfeasibleError, match="BSP on all 2 devices: no microbatch size"):
        bsp_all(Problem(alexnet, tiny, global_batch=8))
    with pytest.raises(InfeasibleError, match="Pipe-Torch over 2 devices"):
        pipe_torch_all(Problem(alexnet, tiny, global_batch=8))
