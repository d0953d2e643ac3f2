"""DESIGN.md's limits: an oversized document is refused at once, naming the field, the value
and the limit (never a hang while it is read)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeplan.agents.problem import Problem, ProblemError
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import FormatError, PlanError
from pipeplan.core.limits import (
    MAX_DEVICES_PER_NODE,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_MICROBATCHES,
)
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from tests.core.test_formats import CLUSTER, PROFILE
from tests.work import AT_ONCE, counting_calls

TYPES = {"a": {"flops": 1e12, "memory_gb": 16}}


def _refused(error: type[Exception], message: str, build: Any) -> None:
    with pytest.raises(error, match=message), counting_calls() as work:
        build()
    assert work.calls < AT_ONCE, f"{work.calls} function calls to refuse it"


def test_a_node_of_a_hundred_million_devices_is_refused_at_once() -> None:
    doc = {"name": "x", "device_types": TYPES, "nodes": [{"name": "n0", "devices": {"a": 10**8}}]}
    message = r"nodes\[0\] \(n0\)\.devices: 100,000,000 devices on one node is over the limit of"
    _refused(FormatError, message, lambda: ClusterSpec.from_dict(doc))


def test_devices_per_node_are_counted_over_every_type() -> None:
    half = MAX_DEVICES_PER_NODE // 2 + 1
    types = {**TYPES, "b": TYPES["a"]}
    doc = {
        "name": "x",
        "device_types": types,
        "nodes": [{"name": "n", "devices": {"a": half, "b": half}}],
    }
    _refused(
        FormatError, "devices on one node is over the limit", lambda: ClusterSpec.from_dict(doc)
    )
    ok = {
        "name": "x",
        "device_types": TYPES,
        "nodes": [{"name": "n", "devices": {"a": MAX_DEVICES_PER_NODE}}],
    }
    assert len(ClusterSpec.from_dict(ok).device_ids) == MAX_DEVICES_PER_NODE


def test_too_many_nodes_are_refused_before_any_is_read() -> None:
    nodes = [{"name": f"n{i}", "devices": {"a": 1}} for i in range(5000)]
    doc = {"name": "x", "device_types": TYPES, "nodes": nodes}
    _refused(
        FormatError,
        r"cluster\.nodes: 5,000 nodes is over the limit of 4,096",
        lambda: ClusterSpec.from_dict(doc),
    )


def test_too_many_layers_are_refused_before_any_is_read() -> None:
    layer = PROFILE["layers"][0]
    doc = {**PROFILE, "layers": [layer] * (MAX_LAYERS + 1)}
    _refused(
        FormatError,
        r"profile\.layers: 100,001 layers is over the limit",
        lambda: ModelProfile.from_dict(doc),
    )


@pytest.mark.parametrize(
    ("batch", "microbatch", "message"),
    [
        (
            10**18,
            1,
            r"plan\.global_batch: 1,000,000,000,000,000,000 samples is over the limit",
        ),
        (
            MAX_MICROBATCHES * 2,
            1,
            r"stages\[0\]\.microbatch: 131,072 microbatches per step is over the limit",
        ),
    ],
)
def test_oversized_plans_are_refused(batch: int, microbatch: int, message: str) -> None:
    doc = {
        "global_batch": batch,
        "stages": [{"layers": [0, 3], "devices": ["n0/cpu:0"], "microbatch": microbatch}],
    }
    _refused(PlanError, message, lambda: Plan.from_dict(doc))


def test_the_largest_allowed_plan_is_accepted() -> None:
    doc = {
        "global_batch": MAX_MICROBATCHES,
        "stages": [{"layers": [0, 3], "devices": ["n0/cpu:0"], "microbatch": 1}],
    }
    assert Plan.from_dict(doc).global_batch == MAX_MICROBATCHES


def test_a_problem_over_the_batch_limit_is_refused() -> None:
    profile, cluster = ModelProfile.from_dict(PROFILE), ClusterSpec.from_dict(CLUSTER)
    with pytest.raises(ProblemError, match="global_batch: 16,777,217 samples is over the limit"):
        Problem(profile, cluster, global_batch=MAX_GLOBAL_BATCH + 1)
