"""The held-out splits and the error summaries (core.held_out), and the observation documents
(core.observations): the literal splits, and each document read back as it was written."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from pipeplan.core import held_out as split
from pipeplan.core.errors import PlanError
from pipeplan.core.held_out import Fold
from pipeplan.core.observations import Observation, observation_of_run
from pipeplan.core.plan import Plan, Stage
from tests.calibration_cases import profile

F, S0, S1 = "n0/fast:0", "n1/slow:0", "n1/slow:1"


def test_the_splits() -> None:
    assert split.alternate(5) == Fold((0, 2, 4), (1, 3))
    assert split.newest_quarter(5) == Fold((0, 1, 2), (3, 4))  # ceil(5 / 4) held out
    assert split.leave_one_out(3) == [Fold((1, 2), (0,)), Fold((0, 2), (1,)), Fold((0, 1), (2,))]
    assert split.leave_group_out(["b", "a", "b"]) == {
        "a": Fold((0, 2), (1,)),
        "b": Fold((1,), (0, 2)),
    }
    assert split.by_count(8) == ("newest quarter", [Fold(tuple(range(6)), (6, 7))])
    assert split.by_count(3) == ("leave-one-out", split.leave_one_out(3))
    assert split.by_count(1) == ("none", [])


def test_the_summary_of_held_out_errors() -> None:
    s = split.summary([0.2, -0.4, 0.1], [-0.01, 0.03, 0.02])
    assert s["held_out_plans"] == 3
    assert s["held_out_median_abs_error_before"] == pytest.approx(0.2)
    assert s["held_out_max_abs_error_before"] == pytest.approx(0.4)
    assert s["held_out_median_abs_error_after"] == pytest.approx(0.02)
    assert s["held_out_max_abs_error_after"] == pytest.approx(0.03)
    empty = split.summary([], [])
    assert empty["held_out_plans"] == 0
    assert all(math.isnan(v) for k, v in empty.items() if k != "held_out_plans")
    assert split.relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert math.isnan(split.relative_error(1.0, 0.0))


def two_stages() -> Plan:
    return Plan(16, (Stage((0, 3), (F,), 4), Stage((3, 6), (S0, S1), 8)))


def test_an_observation_document_reads_back_as_written() -> None:
    o = Observation(
        two_stages(), profile(), 0.5, (0.01, 0.02), (0.03, 0.04), (0.0, 0.1), (0.0, 0.2)
    )
    assert Observation.from_doc(o.to_doc(), o.plan, o.profile) == o
    old = {k: v for k, v in o.to_doc().items() if k not in ("allreduce_s", "update_s")}
    assert Observation.from_doc(old, o.plan, o.profile).update_s == ()  # optional: not fitted


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_time_s": 0}, "obs.batch_time_s: must be a number > 0, got 0"),
        ({"forward_s": [0.1]}, "obs.forward_s: 1 values for a plan of 2 stages"),
        ({"backward_s": None}, "obs.backward_s: expected a list of seconds, got None"),
        ({"update_s": [0.1, math.inf]}, "obs.update_s[1]: must be a number >= 0, got inf"),
        ({"allreduce_s": [True, 0.0]}, "obs.allreduce_s[0]: must be a number >= 0, got True"),
    ],
)
def test_a_bad_observation_document_names_the_field(change: dict[str, Any], message: str) -> None:
    doc = {"batch_time_s": 0.5, "forward_s": [0.1, 0.1], "backward_s": [0.2, 0.2]} | change
    with pytest.raises(PlanError, match=re.escape(message)):
        Observation.from_doc(doc, two_stages(), profile(), "obs")


def test_a_run_document_gives_per_call_times() -> None:
    """``pipeplan run --json`` holds a stage's forward and backward per step: the observation
    has them per call (stage 0 runs 4 microbatches of 4, stage 1 two of 8)."""
    stages = [
        {"forward_s": 0.4, "backward_s": 0.8, "update_s": 0.01},
        {"forward_s": 0.2, "backward_s": 0.4, "allreduce_s": 0.05},
    ]
    doc = {"plan": two_stages().to_dict(), "measured": {"batch_time_s": 1.5, "stages": stages}}
    o = observation_of_run(doc, profile())
    assert o.forward_s == pytest.approx((0.1, 0.1)) and o.backward_s == pytest.approx((0.2, 0.2))
    assert o.allreduce_s == (0.0, 0.05) and o.update_s == (0.01, 0.0)
    with pytest.raises(PlanError, match=r"run\.measured\.batch_time_s: must be a number > 0"):
        observation_of_run({**doc, "measured": {"batch_time_s": -1, "stages": stages}}, profile())
