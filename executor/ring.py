"""Ring all-reduce of a stage's replicas' gradients, one chunk per message.

The cost model charges a replicated stage a ring all-reduce (DESIGN.md rule 8:
``2 (r-1)/r x params_bytes / bw + 2 (r-1) x latency``); the executor runs exactly that
algorithm, so what it measures is what the model predicts. Each of the ``r`` replicas cuts
its flat gradient into ``r`` chunks; in ``2 (r-1)`` rounds replica ``k`` sends one chunk to
replica ``k+1`` (mod ``r``): in the first ``r-1`` rounds (reduce-scatter) the receiver adds
it to its own copy of that chunk, after which replica ``k`` holds chunk ``k+1`` summed over
every replica; in the last ``r-1`` rounds (all-gather) the receiver stores it. Every chunk is
summed once, by one chain of additions, and then copied: all replicas end with bit-identical
sums and so keep identical weights.

This module is the pure part: which chunk goes where, and the arithmetic
(:class:`RingState`). :class:`executor.stage.StageWorker` holds a state per step and the
driver (:mod:`executor.submit`) passes each round's chunk from one replica's actor to the
next as a Ray object ref.

A parameter without a gradient on every replica keeps none (the optimizer skips it, as in
single-process training): the flat vector ends with one presence flag per parameter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

Grads = Mapping[str, np.ndarray | None]


def rounds(replicas: int) -> int:
    """Messages each replica sends: ``2 (r-1)``."""
    return 2 * (replicas - 1)


def send_chunk(replica: int, round_: int, replicas: int) -> int:
    """The chunk replica ``replica`` sends in round ``round_``."""
    r = replicas
    if round_ < r - 1:
        return (replica - round_) % r
    return (replica + 1 - (round_ - (r - 1))) % r


def ring_table(replicas: int) -> list[list[int]]:
    """``table[round][replica]``: the chunk that replica sends in that round."""
    return [[send_chunk(k, u, replicas) for k in range(replicas)] for u in range(rounds(replicas))]


@dataclass
class RingState:
    """One replica's side of one all-reduce."""

    replica: int
    replicas: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    flat: np.ndarray
    """The flat gradient and presence flags; summed in place, then the result's storage."""
    chunks: list[np.ndarray] = field(default_factory=list)
    """Views of ``flat``: a replica holds one copy of its gradient, not two."""
    done: int = 0
    """Rounds received so far."""

    @classmethod
    def start(
        cls,
        replica: int,
        replicas: int,
        grads: Grads,
        shapes: Mapping[str, tuple[int, ...]],
        dtype: np.dtype,
    ) -> RingState:
        """Flatten ``grads`` into chunks, parameters in the order of ``shapes`` (the same on
        every replica); a missing gradient (absent or ``None``) is zeros with a presence flag
        of 0."""
        if not 0 <= replica < replicas:
            raise ValueError(f"replica: {replica} is not in 0..{replicas - 1}")
        names = tuple(shapes)
        parts: list[np.ndarray] = []
        flags: list[float] = []
        for n in names:
            g = grads.get(n)
            size = int(np.prod(shapes[n], dtype=np.int64))
            parts.append(np.zeros(size, dtype) if g is None else np.asarray(g, dtype).ravel())
            flags.append(0.0 if g is None else 1.0)
        return cls._of(
            replica, replicas, names, tuple(tuple(shapes[n]) for n in names), dtype, parts, flags
        )

    @classmethod
    def _of(
        cls,
        replica: int,
        replicas: int,
        names: tuple[str, ...],
        shapes: tuple[tuple[int, ...], ...],
        dtype: np.dtype,
        parts: Sequence[np.ndarray],
        flags: Sequence[float],
    ) -> RingState:
        flat = np.concatenate([*parts, np.asarray(flags, dtype)]) if parts else np.zeros(0, dtype)
        chunks = np.array_split(flat, replicas)
        return cls(replica, replicas, names, shapes, np.dtype(dtype), flat, chunks)

    @property
    def finished(self) -> bool:
        return self.done == rounds(self.replicas)

    def outgoing(self) -> np.ndarray | None:
        """The chunk to send in round ``done`` (``None`` once every round is received): a
        view, which the sender must copy (Ray serialises an actor's return value) before the
        chunk changes in a later round."""
        if self.finished:
            return None
        return self.chunks[send_chunk(self.replica, self.done, self.replicas)]

    def receive(self, chunk: np.ndarray) -> None:
        """Take the left neighbour's chunk of round ``done``: add it or store it."""
        if self.finished:
            raise ValueError(f"ring: replica {self.replica} got a chunk after its last round")
        r, u = self.replicas, self.done
        left = (self.replica - 1) % r
        index = send_chunk(left, u, r)
        if chunk.shape != self.chunks[index].shape:
            raise ValueError(
                f"ring round {u}: chunk {index} has shape {chunk.shape}, "
                f"expected {self.chunks[index].shape}"
            )
        if u < r - 1:
            self.chunks[index] += chunk
        else:
            self.chunks[index][...] = chunk
        self.done += 1

    def result(self) -> dict[str, np.ndarray | None]:
        """The summed gradients by name (``None`` where no replica had one)."""
        if not self.finished:
            raise ValueError(
                f"ring: replica {self.replica} has {self.done} of {rounds(self.replicas)} rounds"
            )
        flat = self.flat
        flags = flat[len(flat) - len(self.names) :]
        out: dict[str, np.ndarray | None] = {}
        offset = 0
        for name, shape, flag in zip(self.names, self.shapes, flags, strict=True):
            size = int(np.prod(shape, dtype=np.int64))
            out[name] = flat[offset : offset + size].reshape(shape) if flag > 0 else None
            offset += size
        return out
