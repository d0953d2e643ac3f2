"""Upper bounds on every count a document or request may ask for (DESIGN.md, "Limits").

They are checked when a document is read, before any work that grows with them, so an
oversized cluster, profile or plan is refused at once with an error naming the field, the
value and the limit, instead of hanging the process that reads it. Raise one only with a
benchmark showing that the work stays bounded.
"""

from __future__ import annotations

from pipeplan.core.errors import PipeplanError

MAX_DEVICES_PER_NODE = 4_096
MAX_NODES = 4_096
MAX_LAYERS = 100_000
MAX_GLOBAL_BATCH = 2**24
MAX_MICROBATCHES = 65_536
"""Microbatches of one stage per step: ``ceil(global_batch / microbatch)``."""


def check_limit(where: str, value: int, limit: int, what: str, error: type[PipeplanError]) -> None:
    """Raise ``error`` naming ``where``, the value and the limit when ``value > limit``."""
    if value > limit:
        raise error(f"{where}: {value:,} {what} is over the limit of {limit:,}")
