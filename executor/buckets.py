"""A replicated stage's gradient sums, in buckets of about 25 MB, as DDP sends them.

One ``all_reduce`` per parameter costs a collective's fixed work per parameter: a GPT block
has a dozen small tensors, and their sums took several times what their bytes alone cost.
:class:`Buckets` groups the parameters, last first (the order the backward makes their
gradients), into runs of at most :data:`BUCKET_BYTES` of one dtype and device; once every
gradient of a bucket is ready it is copied into one flat buffer and summed with one
``all_reduce`` while the backward goes on, and :meth:`Buckets.finish` waits for every sum
and copies it back into the gradients. A parameter larger than a bucket is summed in place,
with no copy.

Replicas that share a host sum through shared memory instead (:mod:`executor.shared_sum`):
then a full bucket is only noted, and :meth:`Buckets.finish` sums every bucket, in the same
order, once the backward is over. Where the shared segment holds the replicas' gradients,
:meth:`Buckets.ready` writes each one into its place there (the accumulation's add has an
output anyway) and :meth:`Buckets.finish` sums the regions in place: no buckets, no copies.

Every replica of a stage runs the same graph, so the same gradients become ready in the same
order and the replicas start the same collectives in the same order. A parameter that gets
no gradient in a step gets none on any replica: its bucket is summed without it when the
step's backward is over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipeplan.executor import transport
from pipeplan.executor.shared_sum import SharedSum

BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket size."""


def layout(params: Mapping[str, torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[str]]:
    """The parameters' names in buckets: last parameter first, at most ``limit`` bytes (or one
    larger parameter) of one dtype and device each."""
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    kind: tuple[torch.dtype, torch.device] | None = None
    for name in reversed(list(params)):
        p = params[name]
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > limit or (p.dtype, p.device) != kind):
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
        kind = (p.dtype, p.device)
    if current:
        buckets.append(current)
    return buckets


class Buckets:
    """One step's gradient sums over a stage's replicas (module docstring)."""

    def __init__(
        self, buckets: list[list[str]], group: Any, shared: SharedSum | None = None
    ) -> None:
        self.buckets = buckets
        self.group = group
        self.shared = shared
        self.bucket_of = {n: i for i, names in enumerate(buckets) for n in names}
        self.pending = [len(names) for names in buckets]
        self.grads: dict[str, torch.Tensor] = {}
        self.started: list[tuple[Any, torch.Tensor | None, list[str]]] = []
        """(gloo's work, or None for a shared-memory sum; the flat buffer, or None for one
        parameter summed in place; the names), in start order."""
        self.launched: set[int] = set()

    def ready(
        self, name: str, grad: torch.Tensor, earlier: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Parameter ``name``'s gradient of the step is final, ``grad`` plus the step's
        ``earlier`` one (the accumulation): sum its bucket once full. Returns the tensor that
        is now the parameter's gradient (in the shared segment, where it holds them)."""
        if self.shared is not None and self.shared.layout is not None:
            view = self.shared.grad_view(name)
            if earlier is not None:
                torch.add(earlier, grad, out=view)
            else:
                view.copy_(grad)
            self.grads[name] = view
            return view
        if earlier is not None:
            grad = earlier.add_(grad)
        self.grads[name] = grad
        i = self.bucket_of[name]
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._start(i)
        return grad

    def _start(self, i: int) -> None:
        self.launched.add(i)
        names = [n for n in self.buckets[i] if n in self.grads]
        if not names:
            return
        if len(names) == 1 and self.grads[names[0]].is_contiguous():
            flat = None
            target = self.grads[names[0]]
        else:
            flat = target = torch.cat([self.grads[n].reshape(-1) for n in names])
        work = None
        if self.shared is None:
            work = transport.all_reduce_sum(target, self.group, wait=False)
        self.started.append((work, flat, names))

    def finish(self) -> None:
        """Sum what is left (buckets with a parameter that had no gradient), wait for every
        sum, and write the flat sums back into the gradients (where the shared segment
        holds them: sum them in place)."""
        if self.shared is not None and self.shared.layout is not None:
            self.shared.sum_regions(set(self.grads))
            return
        for i in range(len(self.buckets)):
            if i not in self.launched:
                self._start(i)
        for work, flat, names in self.started:
            if work is not None:
                work.wait()
            else:
                assert self.shared is not None
                self.shared.sum_(self.grads[names[0]] if flat is None else flat)
            if flat is None:
                continue
            offset = 0
            for n in names:
                grad = self.grads[n]
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self.started.clear()
