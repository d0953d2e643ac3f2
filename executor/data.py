"""Training data for runs: what ``--data`` names, read as a stream of global batches.

:meth:`DataSpec.parse` (:mod:`executor.data_spec`, without torch) reads the ``--data`` text
(nothing is imported, no file is read):

- ``synthetic`` (the default): random inputs shaped like the model's example (token ids
  for the GPT) and random labels, for speed runs where accuracy does not matter; endless.
- ``digits``: scikit-learn's 8x8 digits (real, offline), kept as they are for
  ``digits_cnn`` (1 x 8 x 8), resized bilinearly and repeated over the channels for the
  image models (3 x S x S).
- ``imagefolder:PATH``: torchvision's ``ImageFolder`` (one folder per class), images resized
  to the model input's H x W, in grey for one channel, RGB for three.
- ``tokens:PATH``: a flat ``.npy`` of integer token ids, or a ``.bin`` of uint16 ids as
  nanoGPT writes them, cut into non-overlapping windows of the model's context T (the
  example's second dimension): the input is a window, the target the same window shifted
  by one token.
- ``package.module:callable``: the callable, called without arguments, returns a map-style
  ``torch.utils.data.Dataset`` (a subclass) of ``(input, target)`` samples, or any other
  iterable of ready ``(inputs, targets)`` global batches (a list, a generator...).

Every worker that reads data opens its own stream (:func:`open_stream`) of the same spec and
seed, and gets the same batches: map-style data is shuffled per epoch by a permutation
seeded with ``seed + epoch`` and read through a ``DataLoader`` (no partial last batch), and
:meth:`BatchStream.seek` jumps to a batch by index, without reading the batches before it.
:func:`digits_batches` and :func:`synthetic_batches` are the first ``count`` batches of the
``digits`` and ``synthetic`` streams, as lists.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sized
from itertools import count as counting
from itertools import islice
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from pipeplan.core.code import load_callable
from pipeplan.core.errors import PipeplanError
from pipeplan.executor.data_spec import DataSpec as DataSpec
from pipeplan.executor.model import Batch

Orders = Callable[[int, int], Iterator[torch.Tensor]]
"""``(samples, first epoch) ->`` the sample order of every epoch from the first on."""


class BatchStream:
    """Global batches ``(inputs, targets)`` of one source, from a position on.

    ``next()`` hands out the batch at ``position`` and moves on; ``seek(k)`` makes the next
    batch the one the stream hands out as its k-th (0-based) from the start, as a resumed
    checkpoint needs. ``batches_per_epoch`` is None for an endless or unsized source.
    The first batch handed out is checked against the model (:func:`check_batch`); every
    batch's inputs take the example's dtype, and class targets int64.
    """

    def __init__(
        self,
        batches: Callable[[int], Iterator[Batch]],
        batches_per_epoch: int | None,
        check: Callable[[Batch], None],
        convert: Callable[[Batch], Batch],
    ) -> None:
        self._batches = batches
        self._check: Callable[[Batch], None] | None = check
        self._convert = convert
        self._iterator: Iterator[Batch] | None = None
        self._position = 0
        self.batches_per_epoch = batches_per_epoch

    @property
    def position(self) -> int:
        """Batches handed out so far (or sought past)."""
        return self._position

    def seek(self, position: int) -> None:
        """Hand out batch ``position`` next."""
        if position < 0:
            raise PipeplanError(f"data: cannot seek to batch {position}")
        self._position, self._iterator = position, None

    def next(self) -> Batch:
        """The next global batch."""
        if self._iterator is None:
            self._iterator = self._batches(self._position)
        batch = next(self._iterator)
        if self._check is not None:
            self._check(batch)
            self._check = None
        self._position += 1
        return self._convert(batch)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next()


def open_stream(
    spec: DataSpec,
    example: torch.Tensor,
    output_shape: tuple[int, ...],
    global_batch: int,
    seed: int = 0,
    *,
    class_targets: bool = True,
) -> BatchStream:
    """A stream of ``spec``'s global batches of ``global_batch`` samples for a model that
    takes ``example`` (batch 1) and returns logits of ``output_shape`` (batch 1).

    ``class_targets``: targets are class indices into the logits' last dimension (the
    cross-entropy loss); a user's loss takes targets of any shape and type
    (:attr:`executor.loss.LossSpec.class_targets`). User code is imported, and files are
    opened, here. In a stage worker (the first reads the inputs, the last the targets)::

        stream = open_stream(DataSpec.parse(data), example, output_shape, global_batch, seed,
                             class_targets=LossSpec.parse(loss).class_targets)
        stream.seek(checkpointed_position)  # when resuming
        inputs, targets = stream.next()
    """
    if global_batch < 1:
        raise PipeplanError(f"data: the global batch must be >= 1, got {global_batch}")
    batches, per_epoch = _source(spec, example, output_shape, global_batch, seed)

    def check(batch: Batch) -> None:
        check_batch(batch, example, output_shape, global_batch, class_targets=class_targets)

    def convert(batch: Batch) -> Batch:
        x, y = batch
        return x.to(example.dtype), (y.long() if class_targets else y)

    return BatchStream(batches, per_epoch, check, convert)


def check_batch(
    batch: Batch,
    example: torch.Tensor,
    output_shape: tuple[int, ...],
    global_batch: int | None = None,
    *,
    class_targets: bool = True,
    field: str = "data",
) -> None:
    """Refuse, in one line naming ``field``, a batch the model cannot train on: inputs of
    another per-sample shape than ``example``'s, or floating where it takes integers (or the
    reverse), not ``global_batch`` samples; targets that are not one per sample, or, with
    ``class_targets``, not integer indices in ``[0, classes)`` shaped like the logits of
    ``output_shape`` without their class dimension."""
    x, y = batch
    want = tuple(example.shape[1:])
    if x.dim() == 0 or tuple(x.shape[1:]) != want:
        raise PipeplanError(
            f"{field}: inputs of shape {tuple(x.shape)}, the model takes samples of shape {want}"
        )
    if x.is_floating_point() != example.is_floating_point():
        kind = "floating" if example.is_floating_point() else "integer"
        raise PipeplanError(f"{field}: inputs are {x.dtype}, the model takes {kind} inputs")
    if global_batch is not None and x.shape[0] != global_batch:
        raise PipeplanError(
            f"{field}: a batch of {x.shape[0]} samples, the global batch is {global_batch}"
        )
    if y.dim() == 0 or y.shape[0] != x.shape[0]:
        raise PipeplanError(f"{field}: targets of shape {tuple(y.shape)} for {x.shape[0]} inputs")
    if not class_targets:
        return
    shape, classes = (x.shape[0], *output_shape[1:-1]), output_shape[-1]
    if tuple(y.shape) != shape:
        raise PipeplanError(
            f"{field}: targets of shape {tuple(y.shape)}, the model's logits "
            f"{(x.shape[0], *output_shape[1:])} take {shape}"
        )
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise PipeplanError(f"{field}: targets are {y.dtype}, class indices must be integers")
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= classes:
        raise PipeplanError(
            f"{field}: targets range over [{low}, {high}], the model has {classes} classes "
            f"(0 to {classes - 1})"
        )


# --- the sources: each gives (batches from a position on, batches per epoch) ----------------

Source = tuple[Callable[[int], Iterator[Batch]], int | None]


def _source(
    spec: DataSpec,
    example: torch.Tensor,
    output_shape: tuple[int, ...],
    batch: int,
    seed: int,
) -> Source:
    if spec.kind == "synthetic":
        return lambda start: _synthetic(example, output_shape, batch, seed, start), None
    if spec.kind == "digits":
        x, y = _digits_data(example)
        return _sampled(TensorDataset(x, y), "digits", batch, _chained_orders(seed))
    if spec.kind == "code":
        return _code(str(spec.ref), batch, seed)
    path = str(spec.path)
    if not os.path.exists(path):
        raise PipeplanError(f"data: no such file or folder {path!r}")
    if spec.kind == "imagefolder":
        return _sampled(_image_folder(path, example), path, batch, _seeded_orders(seed))
    return _sampled(_token_windows(path, example), path, batch, _seeded_orders(seed))


def _seeded_orders(seed: int) -> Orders:
    """Epoch ``e`` in the order of a permutation seeded with ``seed + e``."""

    def orders(samples: int, first: int) -> Iterator[torch.Tensor]:
        for epoch in counting(first):
            yield torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch))

    return orders


def _chained_orders(seed: int) -> Orders:
    """The permutations one generator seeded with ``seed`` draws in turn (the order
    :func:`digits_batches` has always had)."""

    def orders(samples: int, first: int) -> Iterator[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        for epoch in counting():
            order = torch.randperm(samples, generator=gen)
            if epoch >= first:
                yield order

    return orders


def _sampled(dataset: Dataset[Any], name: str, batch: int, orders: Orders) -> Source:
    """A map-style data set read in shuffled epochs without their last partial batch."""
    try:
        samples = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise PipeplanError(f"data: {name!r} is a data set without a length") from None
    if samples < batch:
        raise PipeplanError(
            f"data: {name!r} has {samples} samples, fewer than the global batch {batch}"
        )
    per_epoch = samples // batch

    def batches(start: int) -> Iterator[Batch]:
        epoch, skip = divmod(start, per_epoch)
        for order in orders(samples, epoch):
            picked = order[skip * batch : per_epoch * batch].tolist()
            loader = DataLoader(
                dataset, batch_size=batch, sampler=picked, drop_last=True, num_workers=0
            )
            for item in loader:
                yield _as_batch(item, name)
            skip = 0

    return batches, per_epoch


def _as_batch(item: Any, name: str) -> Batch:
    """``(inputs, targets)`` as tensors, from any pair of array-likes."""
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise PipeplanError(
            f"data: {name!r} gave a {type(item).__name__}, not a pair (inputs, targets)"
        )
    try:
        return torch.as_tensor(item[0]), torch.as_tensor(item[1])
    except (TypeError, ValueError, RuntimeError) as e:
        raise PipeplanError(f"data: {name!r} gave a pair that is not two arrays ({e})") from e


def _code(ref: str, batch: int, seed: int) -> Source:
    """A user's data set (shuffled like any) or iterable of batches (read as it comes)."""
    make = load_callable(ref, "data")
    made = make()
    if isinstance(made, Dataset) and not isinstance(made, IterableDataset):
        return _sampled(made, ref, batch, _seeded_orders(seed))
    if not isinstance(made, Iterable):
        raise PipeplanError(
            f"data: {ref!r} returned a {type(made).__name__}, neither a map-style "
            "torch.utils.data.Dataset nor an iterable of (inputs, targets) batches"
        )
    per_epoch = len(made) if isinstance(made, Sized) else None
    return _passes(make, made, ref, per_epoch), per_epoch


def _passes(
    make: Callable[[], Any], first: Iterable[Any], ref: str, per_epoch: int | None
) -> Callable[[int], Iterator[Batch]]:
    """An iterable of batches read pass after pass, ``make()`` giving each pass (an epoch)
    anew; a seek skips whole passes of a sized one, and reads the batches before it
    otherwise."""
    unread: list[Iterable[Any]] = [first]

    def batches(start: int) -> Iterator[Batch]:
        skip = start % per_epoch if per_epoch else start
        while True:
            drawn = 0
            for item in unread.pop() if unread else make():
                drawn += 1
                if skip:
                    skip -= 1
                    continue
                yield _as_batch(item, ref)
            if drawn == 0:
                raise PipeplanError(f"data: {ref!r} gave no batches")

    return batches


# --- digits ---------------------------------------------------------------------------------


def digits(input_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as ``(N, *input_shape)`` float inputs in [0, 1] and int64 labels."""
    if len(input_shape) != 3:
        raise PipeplanError(
            f"data: digits needs an image input (channels, height, width), got shape {input_shape}"
        )
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    c, h, w = input_shape
    if (h, w) != (8, 8):
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)
    return x.repeat(1, c, 1, 1).contiguous(), torch.tensor(d.target, dtype=torch.int64)


def _digits_data(example: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not example.is_floating_point():
        raise PipeplanError(
            f"data: digits are images, the model takes {example.dtype} inputs (token ids?)"
        )
    x, y = digits(tuple(example.shape[1:]))
    return x.to(example.dtype), y


def digits_batches(example: torch.Tensor, batch: int, count: int, *, seed: int = 0) -> list[Batch]:
    """``count`` batches of ``batch`` digits shaped (and typed) like ``example``, shuffled
    once per pass over the data set: the ``digits`` stream's first batches."""
    x, y = _digits_data(example)
    batches, _ = _sampled(TensorDataset(x, y), "digits", batch, _chained_orders(seed))
    return list(islice(batches(0), count))


# --- synthetic ------------------------------------------------------------------------------


def _synthetic(
    example: torch.Tensor, output_shape: tuple[int, ...], batch: int, seed: int, start: int
) -> Iterator[Batch]:
    """Random batches from one generator seeded with ``seed``, from batch ``start`` on (the
    ones before are drawn and dropped: each batch's values depend on all draws before it)."""
    gen = torch.Generator().manual_seed(seed)
    classes = output_shape[-1]
    label_shape = (batch, *output_shape[1:-1])
    high = max(int(example.max()) + 1, classes) if not example.is_floating_point() else 0
    for k in counting():
        if example.is_floating_point():
            x = torch.randn((batch, *example.shape[1:]), generator=gen, dtype=example.dtype)
        else:
            x = torch.randint(high, (batch, *example.shape[1:]), generator=gen)
        y = torch.randint(classes, label_shape, generator=gen)
        if k >= start:
            yield x, y


def synthetic_batches(
    example: torch.Tensor, output_shape: tuple[int, ...], batch: int, count: int, *, seed: int = 0
) -> list[Batch]:
    """Random inputs like ``example`` and labels for logits of ``output_shape`` (batch 1):
    the ``synthetic`` stream's first ``count`` batches.

    Floating inputs are standard normal; integer inputs (token ids) are drawn below the
    example's vocabulary (its largest id + 1, at least the number of classes).
    """
    return list(islice(_synthetic(example, output_shape, batch, seed, 0), count))


# --- files: image folders and token ids -----------------------------------------------------


def _image_folder(path: str, example: torch.Tensor) -> Dataset[Any]:
    """torchvision's ``ImageFolder`` at ``path``, images as the model's input takes them."""
    from torchvision import datasets, transforms

    if example.dim() != 4 or not example.is_floating_point() or example.shape[1] not in (1, 3):
        raise PipeplanError(
            f"data: imagefolder needs a model that takes 1- or 3-channel images, this one "
            f"takes {example.dtype} of shape {tuple(example.shape)}"
        )
    _, c, h, w = example.shape
    steps: list[Any] = [transforms.Resize((h, w))]
    if c == 1:
        steps.append(transforms.Grayscale(1))
    steps.append(transforms.ToTensor())
    try:
        return datasets.ImageFolder(path, transform=transforms.Compose(steps))
    except (FileNotFoundError, NotADirectoryError) as e:
        raise PipeplanError(f"data: {path!r} is no image folder ({e})") from e


class _TokenWindows(Dataset[Batch]):
    """Non-overlapping windows of ``context`` tokens and the same windows one token on."""

    def __init__(self, tokens: np.ndarray, context: int) -> None:
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int) -> Batch:
        start = i * self.context
        window = torch.from_numpy(np.array(self.tokens[start : start + self.context + 1]))
        window = window.long()
        return window[:-1], window[1:]


def _token_windows(path: str, example: torch.Tensor) -> Dataset[Any]:
    """The token ids of a ``.npy`` (any integer type) or ``.bin`` (uint16), memory-mapped."""
    if example.dim() != 2 or example.is_floating_point():
        raise PipeplanError(
            f"data: tokens need a model that takes token ids (batch, context), this one takes "
            f"{example.dtype} of shape {tuple(example.shape)}"
        )
    if not path.endswith((".npy", ".bin")):
        raise PipeplanError(f"data: {path!r} is neither a .npy nor a .bin of token ids")
    try:
        if path.endswith(".bin"):
            tokens = np.memmap(path, dtype=np.uint16, mode="r")
        else:
            tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise PipeplanError(f"data: {path!r} holds no token ids ({e})") from e
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise PipeplanError(
            f"data: {path!r} holds {tokens.dtype} of shape {tokens.shape}, not a flat array "
            "of integer token ids"
        )
    return _TokenWindows(tokens, int(example.shape[1]))
