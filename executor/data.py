"""Training data for runs: scikit-learn's digits (real, offline) or generated tensors.

``digits_batches`` shapes the 8x8 digit images to the model's input: kept as they are for
``digits_cnn`` (1 x 8 x 8), resized bilinearly and repeated over the channels for the image
models (3 x S x S). ``synthetic_batches`` draws random inputs of the example's shape (token
ids for the GPT) and random labels, for speed runs where accuracy does not matter.
Both are deterministic for a seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from pipeplan.core.errors import PipeplanError
from pipeplan.executor.model import Batch


def digits(input_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as ``(N, *input_shape)`` float inputs in [0, 1] and int64 labels."""
    if len(input_shape) != 3:
        raise PipeplanError(
            f"digits: needs an image input (channels, height, width), got shape {input_shape}"
        )
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    c, h, w = input_shape
    if (h, w) != (8, 8):
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)
    return x.repeat(1, c, 1, 1).contiguous(), torch.tensor(d.target, dtype=torch.int64)


def digits_batches(example: torch.Tensor, batch: int, count: int, *, seed: int = 0) -> list[Batch]:
    """``count`` batches of ``batch`` digits shaped (and typed) like ``example``, shuffled
    once per pass over the data set."""
    if example.is_floating_point() is False:
        raise PipeplanError("digits: the model takes token ids, not images; use synthetic data")
    x, y = digits(tuple(example.shape[1:]))
    x = x.to(example.dtype)
    if batch > len(y):
        raise PipeplanError(f"digits: batch {batch} exceeds the {len(y)} samples")
    gen = torch.Generator().manual_seed(seed)
    out: list[Batch] = []
    order = torch.randperm(len(y), generator=gen)
    pos = 0
    for _ in range(count):
        if pos + batch > len(order):
            order, pos = torch.randperm(len(y), generator=gen), 0
        idx = order[pos : pos + batch]
        pos += batch
        out.append((x[idx].contiguous(), y[idx].contiguous()))
    return out


def synthetic_batches(
    example: torch.Tensor, output_shape: tuple[int, ...], batch: int, count: int, *, seed: int = 0
) -> list[Batch]:
    """Random inputs like ``example`` and labels for logits of ``output_shape`` (batch 1).

    Floating inputs are standard normal; integer inputs (token ids) are drawn below the
    example's vocabulary (its largest id + 1, at least the number of classes).
    """
    gen = torch.Generator().manual_seed(seed)
    classes = output_shape[-1]
    label_shape = (batch, *output_shape[1:-1])
    out: list[Batch] = []
    for _ in range(count):
        if example.is_floating_point():
            x = torch.randn((batch, *example.shape[1:]), generator=gen, dtype=example.dtype)
        else:
            high = max(int(example.max()) + 1, classes)
            x = torch.randint(high, (batch, *example.shape[1:]), generator=gen)
        out.append((x, torch.randint(classes, label_shape, generator=gen)))
    return out
