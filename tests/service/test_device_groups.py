"""A stage's devices written compactly: counts by node kind and type on a ``count:`` cluster
and on a hand-written one, the threshold below which a plan keeps its ids, and the CLI's
table of a plan on about a hundred devices within the page's width."""

from __future__ import annotations

from dataclasses import replace

import pytest
from rich.console import Console

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.models.shapes import generate
from pipeplan.service.device_groups import (
    IDS_UP_TO,
    DeviceGroup,
    compact,
    group_devices,
    index_ranges,
    node_kind,
    stage_labels,
)
from pipeplan.service.render import estimate_table
from pipeplan.service.render_runs import describe_plan
from pipeplan.service.tasks.common import PRESETS_DIR

SCALE_CLUSTER = PRESETS_DIR / "scale" / "dc-328.yaml"


def on(node: str, type_: str, n: int, first: int = 0) -> list[str]:
    """Device ids ``node/type_:first .. first+n-1``."""
    return [f"{node}/{type_}:{k}" for k in range(first, first + n)]


def scale_stages() -> list[list[str]]:
    """The devices of eleven stages on dc-328, 104 devices in all: whole nodes, two nodes,
    four nodes, and a stage of half a V100 node and half a T4 node."""
    stages = [on(f"a100x8-{i}", "a100", 8) for i in range(4)]
    stages.append(on("a100x8-4", "a100", 8) + on("a100x8-5", "a100", 8))
    stages += [on(f"v100x8-{i}", "v100", 8) for i in range(4)]
    stages.append([d for i in range(4) for d in on(f"t4x4-{i}", "t4", 4)])
    stages.append(on("v100x8-6", "v100", 4) + on("t4x4-9", "t4", 4))
    return stages


def scale_plan(profile: ModelProfile) -> Plan:
    """:func:`scale_stages` over ``profile``'s layers in near-equal runs, batch 512."""
    stages = scale_stages()
    n, k = len(profile.layers), len(stages)
    cuts = [round(i * n / k) for i in range(k + 1)]
    return Plan.from_dict(
        {
            "global_batch": 512,
            "stages": [
                {"layers": [cuts[i], cuts[i + 1]], "devices": d, "microbatch": 8}
                for i, d in enumerate(stages)
            ],
        }
    )


SCALE_LABELS = [
    "8 a100 (a100x8-0)",
    "8 a100 (a100x8-1)",
    "8 a100 (a100x8-2)",
    "8 a100 (a100x8-3)",
    "2 nodes x 8 a100 (a100x8-4..5)",
    "8 v100 (v100x8-0)",
    "8 v100 (v100x8-1)",
    "8 v100 (v100x8-2)",
    "8 v100 (v100x8-3)",
    "4 nodes x 4 t4 (t4x4-0..3)",
    "4 v100 (v100x8-6) + 4 t4 (t4x4-9)",
]
""":func:`stage_labels` of :func:`scale_stages`."""


def test_the_scale_plan_is_on_the_presets_devices_and_labelled_by_kind() -> None:
    ids = set(ClusterSpec.load(SCALE_CLUSTER).device_ids)
    stages = scale_stages()
    assert sum(len(s) for s in stages) == 104 and set().union(*stages) <= ids
    assert stage_labels(stages) == SCALE_LABELS


def test_a_count_clusters_nodes_are_counted_and_written_as_index_ranges() -> None:
    cluster = ClusterSpec.load(PRESETS_DIR / "scale" / "dc-64.yaml")
    a100 = [d for d in cluster.device_ids if d.startswith("a100x8-")]
    stage = [d for d in a100 if not d.startswith("a100x8-2/")] + on("t4x4-1", "t4", 3)
    assert set(stage) <= set(cluster.device_ids)
    assert group_devices(stage) == [
        DeviceGroup("a100x8", "a100", 8, ("a100x8-0", "a100x8-1", "a100x8-3")),
        DeviceGroup("t4x4", "t4", 3, ("t4x4-1",)),
    ]
    assert compact(stage) == "3 nodes x 8 a100 (a100x8-0..1,3) + 3 t4 (t4x4-1)"
    # the same type on nodes of one kind, a different number on each: a group per number
    uneven = on("a100x8-2", "a100", 2) + on("a100x8-0", "a100", 8) + on("a100x8-1", "a100", 8)
    assert compact(uneven) == "2 a100 (a100x8-2) + 2 nodes x 8 a100 (a100x8-0..1)"


def test_a_hand_written_clusters_nodes_are_listed_by_name() -> None:
    cluster = ClusterSpec.from_dict(
        {
            "name": "hand",
            "device_types": {
                "v100": {"flops": 1.4e13, "memory_gb": 16},
                "t4": {"flops": 8.1e12, "memory_gb": 16},
            },
            "nodes": [
                {"name": "n0", "devices": {"v100": 2}},
                {"name": "big", "devices": {"v100": 2, "t4": 4}},
                {"name": "rack-07", "devices": {"t4": 4}},
                {"name": "n3", "devices": {"v100": 2}},
            ],
        }
    )
    stage = [
        *on("n3", "v100", 2),
        *on("n0", "v100", 2),
        *on("big", "t4", 4),
        *on("rack-07", "t4", 4),
    ]
    assert set(stage) <= set(cluster.device_ids)
    assert compact(stage) == "2 nodes x 2 v100 (n3, n0) + 2 nodes x 4 t4 (big, rack-07)"
    assert compact(on("big", "v100", 2)) == "2 v100 (big)"


def test_node_kinds_and_index_ranges() -> None:
    assert node_kind("a100x8-12") == ("a100x8", 12)
    assert node_kind("dc-a-0") == ("dc-a", 0)
    assert node_kind("rack-07") is None and node_kind("n0") is None and node_kind("a-") is None
    assert index_ranges([9, 0, 1, 2, 3, 6, 8, 3]) == "0..3,6,8..9"
    assert index_ranges([5]) == "5"


def test_a_small_plan_keeps_its_ids_a_larger_one_is_counted() -> None:
    small = [on("n0", "fast", 1), on("n2", "slow", 2)]
    assert stage_labels(small) == ["n0/fast:0", "n2/slow:0, n2/slow:1"]
    at_limit = [on("a100x8-0", "a100", IDS_UP_TO)]
    assert stage_labels(at_limit) == [", ".join(at_limit[0])]
    over = [on("a100x8-0", "a100", IDS_UP_TO), on("a100x8-1", "a100", 1)]
    assert stage_labels(over) == [f"{IDS_UP_TO} a100 (a100x8-0)", "1 a100 (a100x8-1)"]


@pytest.fixture(scope="module")
def gpt_13b() -> ModelProfile:
    return generate("gpt-13b")


def test_the_cli_table_of_a_hundred_device_plan_keeps_a_line_per_stage(
    gpt_13b: ModelProfile,
) -> None:
    """At the width the CLI prints with when piped (160), every stage is one line of the
    table and no device id is listed."""
    plan = scale_plan(gpt_13b)
    est = simulate(plan, gpt_13b, ClusterSpec.load(SCALE_CLUSTER))
    console = Console(width=160, record=True)
    console.print(estimate_table(est, "genetic"))
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 160
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == plan.num_stages
    for row, label in zip(rows, SCALE_LABELS, strict=True):
        assert f"│ {label} " in row
    assert "/a100:" not in text and "/t4:" not in text


def test_the_cli_table_says_which_stages_recompute(gpt_13b: ModelProfile) -> None:
    plan = scale_plan(gpt_13b)
    stages = list(plan.stages)
    stages[1] = replace(stages[1], recompute=True)
    est = simulate(replace(plan, stages=tuple(stages)), gpt_13b, ClusterSpec.load(SCALE_CLUSTER))
    console = Console(width=160, record=True)
    console.print(estimate_table(est, "genetic"))
    rows = [line for line in console.export_text().splitlines() if line.startswith("│")]
    assert ["recompute" in row for row in rows] == [i == 1 for i in range(plan.num_stages)]


def test_a_run_line_names_a_large_plans_stages_by_group() -> None:
    small = Plan(8, (Stage((0, 2), ("n0/fast:0",), 4), Stage((2, 4), ("n1/mid:0",), 4)))
    assert describe_plan(small) == "[0,2) fast:0 x2 | [2,4) mid:0 x2"
    ids = tuple(f"a100x8-{k}/a100:{i}" for k in range(2) for i in range(8))
    large = Plan(16, (Stage((0, 2), ids[:8], 2), Stage((2, 4), ids[8:], 2)))
    assert describe_plan(large) == "[0,2) 8 a100 (a100x8-0) x8 | [2,4) 8 a100 (a100x8-1) x8"
