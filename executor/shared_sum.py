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

**Gradients kept in the segment.** Where the stage's parameters share one dtype and every
replica's gradients fit (:data:`ARENA_SHARE` of the free shared memory), the segment holds,
instead of the chunk buffers, one *region* per replica as large as all of its gradients
(:class:`ArenaLayout`: each gradient at its own offset). The step's last backward writes each
accumulated gradient straight into the replica's region (the add that accumulates it has an
output anyway), the parameter's ``.grad`` becomes that view, and :meth:`SharedSum.sum_regions`
sums in place: after one barrier replica ``r`` adds up the ``r``-th part of every region, in
region order, and writes the sum into every region; after a second barrier each replica's
gradients are the sums. No gradient is copied in or out: a two-replica sum reads and writes
each byte of the gradients once, where the chunk buffers take three reads and two and a half
writes, and gloo's ring the same through the kernel's socket copies.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

CHUNK_BYTES = 32 * 2**20
"""One slot: the most bytes of a gradient summed between two barriers."""
HEADER = 64
"""Bytes before the buffers: the token that proves the mapping is the creator's."""
SHM_DIR = Path("/dev/shm")
ARENA_SHARE = 0.25
"""The most of ``/dev/shm``'s free space the replicas' gradient regions may take together
(Ray's object store lives there too); past it the chunk buffers are used."""
BLOCK_BYTES = 2 * 2**20
"""A region sum's unit: one block of the sum is written to the other regions while it is
still in the cache."""
ALIGN_BYTES = 64
"""Each gradient in a region starts on a cache line."""
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


@dataclass(frozen=True)
class ArenaLayout:
    """Where each parameter's gradient lives in a replica's region: its element offset and
    shape, every gradient of one dtype."""

    dtype: torch.dtype
    slots: dict[str, tuple[int, torch.Size]]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor]) -> ArenaLayout | None:
        """The layout of ``params``' gradients, or None where they are not all CPU tensors of
        one floating dtype (the chunk buffers serve those)."""
        kinds = {(p.dtype, p.device.type) for p in params.values()}
        if len(kinds) != 1:
            return None
        dtype, device = kinds.pop()
        if device != "cpu" or not dtype.is_floating_point:
            return None
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        slots: dict[str, tuple[int, torch.Size]] = {}
        offset = 0
        for name, p in params.items():
            slots[name] = (offset, p.shape)
            offset += -(-p.numel() // align) * align
        return cls(dtype, slots, offset)


class SharedSum:
    """Sums tensors over a stage's replicas through one shared segment (module docstring);
    with ``layout``, the segment holds every replica's gradients (:meth:`grad_view`)."""

    def __init__(
        self,
        segment: torch.Tensor,
        index: int,
        count: int,
        group: Any,
        layout: ArenaLayout | None = None,
    ) -> None:
        self.segment = segment
        self.index = index
        self.count = count
        self.group = group
        self.flip = 0
        self.layout = layout
        self.regions: list[torch.Tensor] = []
        if layout is not None:
            for k in range(count):
                start = HEADER + k * _region_bytes(layout)
                raw = segment[start : start + layout.nbytes]
                self.regions.append(raw.view(layout.dtype))

    def for_params(self, layout: ArenaLayout | None) -> SharedSum | None:
        """The same segment for another model's gradients (a stage started over with other
        weights, another dtype perhaps): their regions where they fit in it, else its chunk
        buffers where those fit, else None (gloo sums). Every replica decides alike."""
        capacity = self.segment.numel() - HEADER
        if layout is not None and self.count * _region_bytes(layout) <= capacity:
            return SharedSum(self.segment, self.index, self.count, self.group, layout)
        if 2 * self.count * CHUNK_BYTES <= capacity:
            return SharedSum(self.segment, self.index, self.count, self.group)
        return None

    def grad_view(self, name: str) -> torch.Tensor:
        """This replica's place for parameter ``name``'s gradient (its shape)."""
        assert self.layout is not None
        offset, shape = self.layout.slots[name]
        return self.regions[self.index][offset : offset + shape.numel()].view(shape)

    def sum_regions(self, written: set[str]) -> None:
        """Sum every replica's region in place (module docstring). ``written``: the
        parameters whose gradient this step wrote into the region; the others' places are
        zeroed first, so that a gradient no replica had (the same graph everywhere) sums no
        stale values."""
        assert self.layout is not None
        mine = self.regions[self.index]
        for name, (offset, shape) in self.layout.slots.items():
            if name not in written:
                mine[offset : offset + shape.numel()].zero_()
        dist.barrier(group=self.group)
        n = self.layout.numel
        lo, hi = n * self.index // self.count, n * (self.index + 1) // self.count
        block = max(1, BLOCK_BYTES // self.layout.dtype.itemsize)
        first, rest = self.regions[0], self.regions[1:]
        for start in range(lo, hi, block):
            end = min(start + block, hi)
            acc = first[start:end]
            for other in rest:
                acc.add_(other[start:end])
            for other in rest:
                other[start:end].copy_(acc)
        dist.barrier(group=self.group)

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
    group: Any,
    ranks: Sequence[int],
    rank: int,
    node: str,
    name: str,
    layout: ArenaLayout | None = None,
) -> SharedSum | None:
    """The replicas' :class:`SharedSum`, or None where gloo must sum (module docstring).
    Collective over ``group`` (the stage's subgroup, ranks ``ranks``); ``node``: this
    replica's plan node; ``name``: the segment's file name, unique on the host; ``layout``:
    the stage's gradients, kept in the segment where they fit (every replica passes the
    same)."""
    index = list(ranks).index(rank)
    seen: list[Any] = [None] * len(ranks)
    dist.all_gather_object(seen, (host_id(), node), group=group)
    if len(set(seen)) != 1:
        return None
    path = SHM_DIR / name
    token = secrets.token_hex(16) if index == 0 else ""
    regions = False
    if index == 0:
        regions = layout is not None and _regions_fit(layout, len(ranks))
        size = _segment_bytes(layout if regions else None, len(ranks))
        try:
            segment = _map(path, size, create=True)
            segment[:32].copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
        except (OSError, RuntimeError):
            segment, token = None, ""
    shared: list[Any] = [(token, regions)]
    dist.broadcast_object_list(shared, src=ranks[0], group=group)
    token, regions = shared[0]
    size = _segment_bytes(layout if regions else None, len(ranks))
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
    return SharedSum(segment, index, len(ranks), group, layout if regions else None)


def _region_bytes(layout: ArenaLayout) -> int:
    return -(-layout.nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _segment_bytes(layout: ArenaLayout | None, count: int) -> int:
    if layout is None:
        return HEADER + 2 * count * CHUNK_BYTES
    return HEADER + count * _region_bytes(layout)


def _regions_fit(layout: ArenaLayout, count: int) -> bool:
    """Whether ``count`` regions of ``layout`` fit in :data:`ARENA_SHARE` of the free
    shared memory."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return count * _region_bytes(layout) <= ARENA_SHARE * st.f_bavail * st.f_frsize


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
