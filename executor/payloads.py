"""An operation's inputs from its neighbours' messages: rows concatenated, gradients summed.

Each forward of stage ``s > 0`` receives one message per operation of stage ``s - 1`` that
holds some of its samples, each backward of stage ``s < S - 1`` one per operation of stage
``s + 1`` (:class:`executor.microbatch.Link`, in row order). A message holds the rows of every
value it carries (:func:`executor.transport.unpack`); these functions put the pieces
together into the values the stage's module reads and the gradients its autograd backward
starts from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pipeplan.executor.microbatch import Link
from pipeplan.executor.partition import ValueMeta

Payload = dict[str, Any]
"""``{name: value}`` handed to or by a worker: a batch's inputs, a step's loss terms."""

Part = Sequence[torch.Tensor | None]
"""One message's tensors, in the order of the names it carries."""


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype of a torch dtype (without touching a tensor's data)."""
    return torch.empty((), dtype=dtype).numpy().dtype


def concat_inputs(
    inputs: Sequence[str],
    carried: Sequence[str],
    parts: Sequence[Part],
    meta: Mapping[str, ValueMeta],
) -> dict[str, Any]:
    """The values ``inputs`` of one operation: batched ones the pieces' rows in order,
    shared ones from the first piece, constants from the cut (they never travel).
    ``carried``: the names each message holds, in order."""
    index = {n: i for i, n in enumerate(carried)}
    out: dict[str, Any] = {}
    for name in inputs:
        m = meta[name]
        if m.kind == "constant":
            out[name] = m.constant
            continue
        tensors = [part[index[name]] for part in parts]
        if m.kind == "batched":
            out[name] = torch.cat([t for t in tensors if t is not None], dim=0)
        else:
            out[name] = tensors[0]
    return out


def concat_gradients(
    names: Sequence[str],
    links: Sequence[Link],
    parts: Sequence[Part],
    meta: Mapping[str, ValueMeta],
) -> dict[str, torch.Tensor]:
    """Gradients of ``names`` for one operation's samples from the next stage's messages.

    Batched: rows concatenated (a piece without a gradient counts as zeros). Shared: the sum
    of the pieces this operation owns (``Link.owner``: each downstream piece's is counted
    once over the stage). Names with no gradient at all are left out, as autograd leaves a
    value no loss depends on without one.
    """
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(names):
        got = [(link, part[i]) for link, part in zip(links, parts, strict=True)]
        present = [g for _, g in got if g is not None]
        if not present:
            continue
        if meta[name].kind == "shared":
            owned = [g for link, g in got if link.owner and g is not None]
            if owned:
                out[name] = torch.stack(owned).sum(dim=0)
            continue
        like = present[0]
        rows = [
            torch.zeros((link.rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
            if g is None
            else g
            for link, g in got
        ]
        out[name] = torch.cat(rows, dim=0)
    return out
