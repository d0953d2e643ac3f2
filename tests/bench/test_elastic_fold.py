"""``bench.elastic``'s by-hand restart: the original plan folded onto what is left."""

from __future__ import annotations

import pytest

from bench.elastic import folded
from pipeplan.core.plan import Plan, Schedule, Stage

PLAN = Plan(
    32,
    (
        Stage((0, 19), ("n0/fast:0",), 8),
        Stage((19, 34), ("n2/slow:0", "n2/slow:1"), 8),
        Stage((34, 54), ("n1/mid:0", "n1/mid:1", "n2/slow:2"), 8),
    ),
    Schedule.ONE_F_ONE_B,
)


def test_a_stage_that_lost_every_device_merges_into_the_one_before() -> None:
    assert folded(PLAN, {"n2"}) == Plan(
        32,
        (
            Stage((0, 34), ("n0/fast:0",), 8),
            Stage((34, 54), ("n1/mid:0", "n1/mid:1"), 8),
        ),
        Schedule.ONE_F_ONE_B,
    )


def test_a_first_stage_that_lost_every_device_merges_into_the_next() -> None:
    lost_first = Plan(32, (Stage((0, 10), ("n1/mid:0",), 8), Stage((10, 54), ("n0/fast:0",), 4)))
    assert folded(lost_first, {"n1"}) == Plan(32, (Stage((0, 54), ("n0/fast:0",), 4),))


def test_nothing_left_is_refused_naming_the_nodes() -> None:
    with pytest.raises(
        ValueError, match=r"no device of the plan is left after losing \['n0', 'n1', 'n2'\]"
    ):
        folded(PLAN, {"n0", "n1", "n2"})
