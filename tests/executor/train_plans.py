"""The plan the training tests share: three stages on the three nodes of ``local-hetero``'s
shape, the last replicated on one node."""

from __future__ import annotations

from pipeplan.core.plan import Plan, Schedule, Stage

BATCH = 8


def three_stages(schedule: Schedule = Schedule.GPIPE) -> Plan:
    return Plan(
        BATCH,
        (
            Stage((0, 10), ("n0/fast:0",), 4),
            Stage((10, 20), ("n1/mid:0",), 2),
            Stage((20, 30), ("n2/slow:0", "n2/slow:1"), 4),
        ),
        schedule,
    )
