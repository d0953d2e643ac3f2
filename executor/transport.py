"""The stage actors' process group, and how boundary values travel in it.

A run's stage replicas form one ``torch.distributed`` process group, set up as Ray Train sets
up its workers': rank 0 (stage 0, replica 0) opens the TCP store on its node's address and a
free port, the driver hands that address to every actor, and each joins with its rank (plan
order: stage by stage, replica by replica). The store's socket is bound by this module, to
the node's address (``127.0.0.1`` on a local cluster), and handed to the store, so it never
listens on another interface and no port can be taken between choosing and binding it; on a
loopback address gloo's own connections are kept on the loopback interface too
(``GLOO_SOCKET_IFNAME``).

Backends: **gloo** where every stage is a CPU type; with CUDA types the group is
``cpu:gloo,cuda:nccl`` -- a tensor on a GPU travels by NCCL, one on the CPU by gloo -- and a
message between two CUDA stages is sent from GPU memory, any message with a CPU stage at
either end from CPU memory (:func:`wire_device`). So a CUDA stage next to a CPU stage copies
to the host and the pair talks gloo.

The group has a ``timeout``: a receive or a collective whose peer never comes (its process
died mid-step) fails after that long instead of hanging the run.

**Messages.** One message per pair of neighbour operations that share samples, per
direction: the forward carries the rows the receiver needs of every tensor the sender's stage
sends on (skips relayed included), the backward the rows of the gradients of the floating
ones, with one presence byte per gradient (a value with no gradient arrives as ``None``, as
in single-process autograd). A message is one flat ``uint8`` buffer (:func:`pack`); the
receiver knows every value's dtype and shape from its own cut of the model
(:class:`~executor.partition.ValueMeta`), so nothing but the data travels. Constants never
travel. Tags tell one operation pair's messages from another's (:func:`tag`).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.executor.microbatch import Link
from pipeplan.executor.partition import ValueMeta

__all__ = ["Link"]


@dataclass(frozen=True)
class GroupSpec:
    """How one stage replica joins its run's process group."""

    address: str
    """Rank 0's node address, where the TCP store listens."""
    port: int
    rank: int
    ranks: tuple[tuple[int, ...], ...]
    """``ranks[s][k]``: the rank of stage ``s``'s replica ``k`` (plan order)."""
    backend: str
    timeout_s: float
    nodes: tuple[str, ...] = ()
    """``nodes[rank]``: the plan node of that rank's device (empty: unknown)."""
    shared_sum: bool = True
    """Whether replicas on one plan node and host may sum through shared memory
    (:mod:`executor.shared_sum`)."""

    @property
    def world_size(self) -> int:
        return sum(len(row) for row in self.ranks)


def backend_for(accelerators: Sequence[str | None]) -> str:
    """``gloo`` for a run of CPU stages; ``cpu:gloo,cuda:nccl`` once a stage is on CUDA."""
    return "cpu:gloo,cuda:nccl" if "cuda" in accelerators else "gloo"


def listen(address: str) -> socket.socket:
    """A listening socket on ``address`` and a free port, for rank 0's TCP store."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen(128)
    return sock


def open_store(sock: socket.socket, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCP store, serving on ``sock`` (already bound and listening)."""
    return dist.TCPStore(
        sock.getsockname()[0],
        sock.getsockname()[1],
        world_size,
        True,
        dt.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
    )


def join(spec: GroupSpec, store: dist.Store | None = None) -> Any:
    """Join the run's group (every rank calls it at once); returns this rank's stage's
    subgroup for the replicas' all-reduce (None for a stage of one replica).

    Every rank creates every subgroup, in stage order, as ``new_group`` requires.
    """
    if spec.address.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = dt.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.address, spec.port, spec.world_size, False, timeout)
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )
    mine = None
    for row in spec.ranks:
        if len(row) > 1:
            group = dist.new_group(list(row), timeout=timeout)
            if spec.rank in row:
                mine = group
    return mine


def leave() -> None:
    """Leave the group (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def tag(sender: int, receiver: int, backward: bool, step: int) -> int:
    """The tag of the message from microbatch ``sender`` to microbatch ``receiver``.

    Between two ranks, the operation pairs that share samples form a staircase in sample
    order, so ``sender + receiver`` differs for every pair; the direction and the step's
    parity keep a gradient from matching an activation and one step's message from matching
    the next one's.
    """
    return 4 * (sender + receiver) + 2 * int(backward) + step % 2


def wire_device(local: torch.device, peer_accelerator: str | None) -> torch.device:
    """Where a message between this stage and a peer lives: the GPU when both are CUDA
    (NCCL), else the CPU (gloo)."""
    if local.type == "cuda" and peer_accelerator == "cuda":
        return local
    return torch.device("cpu")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def nbytes(meta: ValueMeta, rows: int) -> int:
    """Bytes of ``meta``'s tensor for ``rows`` samples."""
    assert meta.dtype is not None
    return math.prod(meta.rows_shape(rows)) * meta.dtype.itemsize


def pack(
    tensors: Sequence[torch.Tensor | None], device: torch.device, flags: bool = False
) -> torch.Tensor:
    """One ``uint8`` buffer on ``device``: the tensors' bytes in order (a missing one, with
    ``flags``, takes none), then with ``flags`` one presence byte per tensor."""
    parts = [_as_bytes(t.detach().to(device)) for t in tensors if t is not None]
    if flags:
        present = [t is not None for t in tensors]
        parts.append(torch.tensor(present, dtype=torch.uint8, device=device))
    if not parts:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def buffer_size(metas: Sequence[ValueMeta], rows: int, present: Sequence[bool] | None) -> int:
    """Bytes of a message of ``metas`` for ``rows`` samples (``present``: which gradients
    it holds, after its presence bytes have been read; None: all, no presence bytes)."""
    sizes = [nbytes(m, rows) for m in metas]
    if present is None:
        return sum(sizes)
    return sum(s for s, p in zip(sizes, present, strict=True) if p) + len(metas)


def unpack(
    buffer: torch.Tensor, metas: Sequence[ValueMeta], rows: int, flags: bool = False
) -> list[torch.Tensor | None]:
    """The tensors of a buffer made by :func:`pack` (views of it)."""
    present = [True] * len(metas)
    if flags:
        present = [bool(b) for b in buffer[len(buffer) - len(metas) :].tolist()]
    out: list[torch.Tensor | None] = []
    offset = 0
    for meta, here in zip(metas, present, strict=True):
        if flags and not here:
            out.append(None)
            continue
        size = nbytes(meta, rows)
        assert meta.dtype is not None
        chunk = buffer[offset : offset + size]
        if offset % meta.dtype.itemsize:  # after an odd-sized value: realign
            chunk = chunk.clone()
        out.append(chunk.view(meta.dtype).reshape(meta.rows_shape(rows)))
        offset += size
    return out


def recv_buffer(size: int, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, device=device)


def isend(buffer: torch.Tensor, rank: int, message_tag: int) -> Any:
    """Post a send; the returned work must be waited on before ``buffer`` is freed."""
    return dist.isend(buffer, rank, tag=message_tag)


Posted = tuple[torch.Tensor, Any]
"""A receive under way: its buffer and its work."""


def irecv(buffer: torch.Tensor, rank: int, message_tag: int) -> Posted:
    """Post a receive into ``buffer``."""
    work = dist.irecv(buffer, rank, tag=message_tag)
    assert work is not None  # None only for a rank outside the group
    return buffer, work


def wait_all(posted: Sequence[Posted], timeout_s: float) -> list[torch.Tensor]:
    """Wait for every receive (at most ``timeout_s`` each); returns the buffers, filled."""
    timeout = dt.timedelta(seconds=timeout_s)
    for _, work in posted:
        work.wait(timeout)
    return [buffer for buffer, _ in posted]


def recv_all(
    posted: Sequence[tuple[torch.Tensor, int, int]], timeout_s: float
) -> list[torch.Tensor]:
    """Post every ``(buffer, rank, tag)`` receive at once, then wait for each."""
    return wait_all([irecv(*p) for p in posted], timeout_s)


def all_reduce_sum(flat: torch.Tensor, group: dist.ProcessGroup, wait: bool = True) -> Any:
    """Sum ``flat`` over ``group`` in place (NCCL's or gloo's ring); with ``wait=False``
    returns the work under way."""
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=not wait)
