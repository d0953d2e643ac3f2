"""A replicated stage's gradient sums through shared memory, when its replicas share a host.

gloo's all-reduce moves every byte through the TCP stack, loopback included: two replicas of
a stage on one machine summing a 400 MB gradient spend about three times as long in the
kernel's socket copies as in the sum itself. NCCL sums the GPUs of one node through shared
memory and NVLink rather than its network transports, and gloo's upstream has a shared-memory
all-reduce for the same reason; the torch wheels pipeplan installs do not build it. So for
the replicas of a CPU stage that sit on one plan node and one host, :class:`SharedSum` does
the same with a segment of shared memory they all map; gloo still carries every message and
every collective between hosts, and the sums of replicas spread over nodes.

**How a sum runs.** The segment holds two buffers; a buffer holds one slot per replica of
:data:`CHUNK_BYTES`. A gradient is summed a chunk at a time: every replica copies its chunk
into its own slot; after a barrier, replica ``r`` adds up the ``r``-th part of the chunk over
every slot, in slot order, into slot 0; after a second barrier every replica copies slot 0's
chunk back. Every replica reads the same sum, so replicas stay bit-identical; the next chunk
uses the other buffer, so no replica overwrites slot 0 while another still copies out of it.
The barriers are gloo's (``dist.barrier`` over the stage's subgroup), so a replica whose peer
died fails after the group's ``timeout`` as a gloo all-reduce would.

**Setting it up** is collective over the stage's replicas (:func:`open_shared_sum`): they
compare their host (hostname and boot id) and plan node; if all agree, the first replica
creates the segment under ``/dev/shm`` with a random token in its header, the others map it
and check the token (two containers on one host do not share ``/dev/shm``), and once every
replica has answered the first removes the file: the mappings outlive it, so nothing is left
behind however the run ends. If any replica cannot map it, every replica keeps gloo.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CHUNK_BYTES = 32 * 2**20
"""One slot: the most bytes of a gradient summed between two barriers."""
HEADER = 64
"""Bytes before the buffers: the token that proves the mapping is the creator's."""
SHM_DIR = Path("/dev/shm")
DISABLE_ENV = "PIPEPLAN_SHARED_SUM"
"""Set to ``0`` to sum every replicated stage with gloo's all-reduce."""


def enabled() -> bool:
    """Whether runs may sum same-host replicas through shared memory (:data:`DISABLE_ENV`)."""
    return os.environ.get(DISABLE_ENV, "1") != "0"


def host_id() -> str:
    """This machine, as two processes on it both see it: hostname and kernel boot id."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}|{boot}"


class SharedSum:
    """Sums tensors over a stage's replicas through one shared segment (module docstring)."""

    def __init__(self, segment: torch.Tensor, index: int, count: int, group: Any) -> None:
        self.segment = segment
        self.index = index
        self.count = count
        self.group = group
        self.flip = 0

    def _slot(self, buffer: int, k: int) -> torch.Tensor:
        start = HEADER + (buffer * self.count + k) * CHUNK_BYTES
        return self.segment[start : start + CHUNK_BYTES]

    def sum_(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` (contiguous, on the CPU) with its sum over the replicas. Every
        replica calls it with the same shapes in the same order."""
        flat = tensor.view(-1).view(torch.uint8)
        size = tensor.element_size()
        for start in range(0, flat.numel(), CHUNK_BYTES):
            piece = flat[start : start + CHUNK_BYTES]
            buffer = self.flip
            self.flip ^= 1
            self._slot(buffer, self.index)[: piece.numel()].copy_(piece)
            dist.barrier(group=self.group)
            n = piece.numel() // size
            lo, hi = n * self.index // self.count, n * (self.index + 1) // self.count
            if hi > lo:
                slots = [
                    self._slot(buffer, k)[: n * size].view(tensor.dtype) for k in range(self.count)
                ]
                acc = slots[0][lo:hi]
                for other in slots[1:]:
                    acc.add_(other[lo:hi])
            dist.barrier(group=self.group)
            piece.copy_(self._slot(buffer, 0)[: piece.numel()])


def open_shared_sum(
    group: Any, ranks: Sequence[int], rank: int, node: str, name: str
) -> SharedSum | None:
    """The replicas' :class:`SharedSum`, or None where gloo must sum (module docstring).
    Collective over ``group`` (the stage's subgroup, ranks ``ranks``); ``node``: this
    replica's plan node; ``name``: the segment's file name, unique on the host."""
    index = list(ranks).index(rank)
    seen: list[Any] = [None] * len(ranks)
    dist.all_gather_object(seen, (host_id(), node), group=group)
    if len(set(seen)) != 1:
        return None
    size = HEADER + 2 * len(ranks) * CHUNK_BYTES
    path = SHM_DIR / name
    token = secrets.token_hex(16) if index == 0 else ""
    if index == 0:
        try:
            segment = _map(path, size, create=True)
            segment[:32].copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
        except (OSError, RuntimeError):
            segment, token = None, ""
    shared = [token]
    dist.broadcast_object_list(shared, src=ranks[0], group=group)
    token = shared[0]
    if index != 0:
        segment = None
        if token:
            try:
                segment = _map(path, size, create=False)
                if bytes(segment[:32].tolist()).decode(errors="replace") != token:
                    segment = None
            except (OSError, RuntimeError):
                segment = None
    answers: list[Any] = [None] * len(ranks)
    dist.all_gather_object(answers, segment is not None, group=group)
    if index == 0:
        path.unlink(missing_ok=True)
    if not all(answers) or segment is None:
        return None
    return SharedSum(segment, index, len(ranks), group)


def _map(path: Path, size: int, create: bool) -> torch.Tensor:
    """``size`` bytes of ``path`` mapped shared; ``create``: a new file of that size."""
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    elif not path.is_file() or path.stat().st_size != size:
        raise OSError(f"{path.name}: not the segment its creator made")
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
