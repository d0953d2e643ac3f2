"""Payloads between stage workers: rows of the samples an operation needs, as numpy arrays.

Activations and gradients travel as ``{value name: numpy array}`` (Ray moves
numpy arrays faster than torch tensors); each call gets the payloads of the neighbour
operations that hold its samples and a :class:`~executor.microbatch.Piece` per payload
saying which rows to take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pipeplan.executor.microbatch import Piece
from pipeplan.executor.partition import ValueKind

Payload = dict[str, Any]
"""``{value name: numpy array}`` (or a constant) sent from one operation to another."""


def to_numpy(value: Any) -> Any:
    """A tensor as a numpy array (copied to the CPU first when it lives on a GPU: payloads
    travel through Ray's object store as CPU arrays); any other value as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().cpu().numpy()


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype of a torch dtype (without touching a tensor's data)."""
    return torch.empty((), dtype=dtype).numpy().dtype


def gather(
    names: Sequence[str],
    pieces: Sequence[Piece],
    payloads: Sequence[Payload],
    kinds: Mapping[str, ValueKind],
) -> dict[str, Any]:
    """The values ``names`` for the samples of ``pieces``: batched rows concatenated in order;
    shared and constant values from the first piece."""
    out: dict[str, Any] = {}
    for name in names:
        if kinds[name] == "batched":
            rows = [p[name][pc.lo : pc.hi] for pc, p in zip(pieces, payloads, strict=True)]
            out[name] = torch.from_numpy(np.concatenate(rows, axis=0))
        elif kinds[name] == "shared":
            out[name] = torch.from_numpy(np.array(payloads[0][name]))
        else:
            out[name] = payloads[0][name]
    return out


def gather_gradients(
    names: Sequence[str],
    pieces: Sequence[Piece],
    payloads: Sequence[Payload | None],
    kinds: Mapping[str, ValueKind],
) -> dict[str, torch.Tensor]:
    """Gradients of ``names`` for this operation's samples from the next stage's pieces.

    Batched: rows concatenated (a piece without a gradient counts as zeros). Shared: the sum
    of the pieces this operation owns. Names with no gradient at all are left out.
    """
    out: dict[str, torch.Tensor] = {}
    for name in names:
        got = [
            (pc, None if p is None else p.get(name)) for pc, p in zip(pieces, payloads, strict=True)
        ]
        present = [g for _, g in got if g is not None]
        if not present or kinds[name] == "constant":
            continue
        if kinds[name] == "shared":
            owned = [g for pc, g in got if pc.owner and g is not None]
            if owned:
                out[name] = torch.from_numpy(np.sum(owned, axis=0))
            continue
        like = present[0]
        rows = [
            np.zeros((pc.hi - pc.lo, *like.shape[1:]), like.dtype)
            if g is None
            else g[pc.lo : pc.hi]
            for pc, g in got
        ]
        out[name] = torch.from_numpy(np.concatenate(rows, axis=0))
    return out
