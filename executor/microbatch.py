"""Which samples each stage operation holds, and which upstream pieces make them up.

Pure arithmetic over sample ranges, no torch and no Ray. Samples of a global batch are
numbered ``0 .. B-1``; stage ``s`` cuts them into ``M_s = ceil(B / b_s)`` microbatches of
``b_s`` samples (the last one holds the remainder), and each microbatch into ``r_s``
contiguous replica shares (sizes differ by at most one, the first shares are larger, as
``torch.tensor_split``). Operation ``(j, k)`` of a stage
is microbatch ``j`` on replica ``k``.

With unequal microbatches (or replica counts) an operation's samples come from several
operations of the neighbouring stage: :func:`pieces` lists them as row ranges of those
operations' payloads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeplan.core import rules
from pipeplan.core.schedules import microbatch_count, microbatch_samples

Span = tuple[int, int]
"""Samples ``[lo, hi)`` of the global batch."""
Endpoint = tuple[int, int, int]
"""An operation: ``(stage, microbatch, replica)``."""
OpIndex = tuple[int, int]
"""An operation of a known stage: ``(microbatch, replica)``."""


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of one neighbour operation's payload (its own row numbering).

    ``owner`` is true for exactly one receiving operation per neighbour operation (the one
    holding the neighbour's first sample): values shared by every sample (no batch dimension)
    have their gradient counted there and nowhere else.
    """

    stage: int
    microbatch: int
    replica: int
    lo: int
    hi: int
    owner: bool


@dataclass(frozen=True)
class Link:
    """One message of an operation, to or from ``peer`` (an operation of the neighbour
    stage): rows ``[lo, hi)`` in the numbering of the side that holds them whole (the
    sender's outputs for activations, the gradient sender's inputs for gradients), and
    whether the receiving operation owns the peer's shared values' gradient."""

    peer: Endpoint
    lo: int
    hi: int
    owner: bool = False

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def replica_shares(microbatch: int, replicas: int) -> list[Span]:
    """Row ranges of a microbatch's replica shares: ``replica_shares(5, 2) == [(0, 3), (3, 5)]``."""
    if replicas < 1 or microbatch < replicas:
        raise ValueError(
            f"replica_shares: a microbatch of {microbatch} cannot be shared by {replicas} replicas"
        )
    bounds = [0]
    for k in range(replicas):  # the cost model's rule 2i prices these sizes
        bounds.append(bounds[-1] + int(rules.replica_samples(microbatch, replicas, k)))
    return [(bounds[k], bounds[k + 1]) for k in range(replicas)]


def op_spans(global_batch: int, microbatch: int, replicas: int) -> list[list[Span]]:
    """``spans[j][k]``: the global samples of operation ``(j, k)`` of a stage; the last
    microbatch holds the remainder ``B - (M - 1) b``, shared the same way."""
    if not 1 <= microbatch <= global_batch:
        raise ValueError(
            f"op_spans: microbatch {microbatch} is not in [1, global batch {global_batch}]"
        )
    return [
        [
            (j * microbatch + lo, j * microbatch + hi)
            for lo, hi in replica_shares(microbatch_samples(j, microbatch, global_batch), replicas)
        ]
        for j in range(microbatch_count(global_batch, microbatch))
    ]


def pieces(span: Span, stage: int, neighbour: list[list[Span]]) -> list[Piece]:
    """The operations of stage ``stage`` (spans ``neighbour``) that overlap ``span``, in order.

    Each piece gives the overlap in the neighbour operation's own row numbering; concatenated
    they hold exactly the samples of ``span``.
    """
    lo, hi = span
    found: list[Piece] = []
    for j, row in enumerate(neighbour):
        for k, (a, b) in enumerate(row):
            if a < hi and lo < b:
                found.append(Piece(stage, j, k, max(a, lo) - a, min(b, hi) - a, lo <= a < hi))
    if sum(p.hi - p.lo for p in found) != hi - lo:
        raise ValueError(f"pieces: stage {stage} does not cover samples [{lo}, {hi})")
    return found


@dataclass(frozen=True)
class Layout:
    """Spans of every operation of every stage of a plan, and who feeds whom.

    ``spans[s][j][k]`` are the samples of operation ``(j, k)`` of stage ``s``.
    """

    spans: tuple[list[list[Span]], ...]

    @classmethod
    def of(cls, global_batch: int, stages: list[tuple[int, int]]) -> Layout:
        """From ``(microbatch, replicas)`` per stage."""
        return cls(tuple(op_spans(global_batch, b, r) for b, r in stages))

    @property
    def num_stages(self) -> int:
        return len(self.spans)

    def microbatches(self, s: int) -> int:
        return len(self.spans[s])

    def replicas(self, s: int) -> int:
        return len(self.spans[s][0])

    def forward_pieces(self, s: int, j: int, k: int) -> list[Piece]:
        """Pieces of stage ``s - 1``'s forward payloads that make up ``(j, k)``'s input."""
        return pieces(self.spans[s][j][k], s - 1, self.spans[s - 1])

    def backward_pieces(self, s: int, j: int, k: int) -> list[Piece]:
        """Pieces of stage ``s + 1``'s backward payloads (input gradients) for ``(j, k)``."""
        return pieces(self.spans[s][j][k], s + 1, self.spans[s + 1])

    def forward_links(self, s: int) -> dict[OpIndex, list[Link]]:
        """Per operation of stage ``s > 0``: the activation messages it receives, one per
        piece of stage ``s - 1``, in row order (the sender slices the rows)."""
        return self._links(s, self.forward_pieces)

    def backward_links(self, s: int) -> dict[OpIndex, list[Link]]:
        """Per operation of stage ``s < S - 1``: the gradient messages it receives, one per
        piece of stage ``s + 1``, in row order; ``owner`` as :class:`Piece`'s."""
        return self._links(s, self.backward_pieces)

    def _links(
        self, s: int, pieces_of: Callable[[int, int, int], list[Piece]]
    ) -> dict[OpIndex, list[Link]]:
        return {
            (j, k): [
                Link((p.stage, p.microbatch, p.replica), p.lo, p.hi, p.owner)
                for p in pieces_of(s, j, k)
            ]
            for j in range(self.microbatches(s))
            for k in range(self.replicas(s))
        }

    def forward_sends(self, s: int) -> dict[OpIndex, list[Link]]:
        """Per operation of stage ``s < S - 1``: the activation messages it sends, to the
        operations of stage ``s + 1`` that hold its samples, rows in its own numbering."""
        return self._inverse(s, s + 1, self.forward_links(s + 1))

    def backward_sends(self, s: int) -> dict[OpIndex, list[Link]]:
        """Per operation of stage ``s > 0``: the gradient messages it sends to the operations
        of stage ``s - 1`` that hold its samples, rows in its own numbering."""
        return self._inverse(s, s - 1, self.backward_links(s - 1))

    def _inverse(
        self, s: int, other: int, received: dict[OpIndex, list[Link]]
    ) -> dict[OpIndex, list[Link]]:
        sends: dict[OpIndex, list[Link]] = {
            (j, k): [] for j in range(self.microbatches(s)) for k in range(self.replicas(s))
        }
        for (j, k), links in received.items():
            for link in links:
                _, mine, rep = link.peer
                sends[(mine, rep)].append(Link((other, j, k), link.lo, link.hi, link.owner))
        return sends
