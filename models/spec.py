"""Model references: what a flag or request field names a model by, and how to build it.

A reference is one of three forms:

- a **zoo name** (:data:`models.zoo.MODELS`): ``gpt``, ``alexnet``...; ``input_size`` and the
  zoo's options (``n_layer=48``) as :func:`models.zoo.build` takes them;
- ``package.module:factory``: a callable returning an ``nn.Module``, called with the
  options as keyword arguments. Its example input comes from ``example``
  (``package.module:example_fn``, called without arguments, returning a batch-1 tensor) or
  from ``input_shape`` (without the batch dimension) and ``input_dtype``: ``float32``
  draws standard-normal values from the seed; ``int64`` gives token ids 0 (an id every
  vocabulary has; name an ``example`` function for other ids);
- ``hf:ClassName``: a Hugging Face ``transformers`` model class, built from its config
  class with random weights (:mod:`models.hf`); the example is token ids.

Every build is seeded (``torch.random.fork_rng`` and ``manual_seed``: the same weights on
every build, the global RNG untouched), so stage workers rebuild the same model from the
reference alone. :func:`reference_kind` and :func:`check_input` check a reference's form
and its input fields without importing anything (the API process must not import a user's
code, nor torch: they are :mod:`models.reference`'s); the other torch-free parts (option
values, shapes, whether a reference names code) are :mod:`core.model_refs`'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipeplan.core.code import load_callable
from pipeplan.core.errors import PipeplanError
from pipeplan.core.model_refs import HF_PREFIX, names_code, parse_options, parse_shape, parse_value
from pipeplan.models import hf, zoo
from pipeplan.models.reference import (
    INPUT_DTYPE_NAMES,
    InputDtype,
    Kind,
    check_input,
    reference_kind,
)

__all__ = [
    "HF_PREFIX", "INPUT_DTYPES", "Built", "InputDtype", "Kind", "build_model", "check_input",
    "names_code", "parse_options", "parse_shape", "parse_value", "reference_kind",
]  # fmt: skip

INPUT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "int64": torch.int64}
"""The torch dtype of each :data:`~models.reference.INPUT_DTYPE_NAMES`."""
if tuple(INPUT_DTYPES) != INPUT_DTYPE_NAMES:  # one list of names, read without torch there
    raise ImportError(f"models.spec: {tuple(INPUT_DTYPES)} != reference.{INPUT_DTYPE_NAMES}")
Built = tuple[nn.Module, torch.Tensor]


def _factory_model(ref: str, options: Mapping[str, Any], seed: int) -> nn.Module:
    factory = load_callable(ref, "model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = factory(**options)
        except TypeError as e:
            raise PipeplanError(
                f"model_options: {ref!r} does not take {dict(options)} ({e})"
            ) from e
    if not isinstance(model, nn.Module):
        raise PipeplanError(f"model: {ref!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def _factory_example(
    example: str | None, shape: Sequence[int] | None, dtype: str | None, seed: int
) -> torch.Tensor:
    if example is not None:
        fn = load_callable(example, "example")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            value = fn()
        if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] != 1:
            what = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise PipeplanError(f"example: {example!r} must return a batch-1 tensor, got {what}")
        return value
    assert shape is not None  # check_input: one of the two
    size = (1, *(int(n) for n in shape))
    if (dtype or "float32") == "int64":
        return torch.zeros(size, dtype=torch.int64)
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))


def build_model(
    ref: str,
    input_size: int | None = None,
    *,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
    input_shape: Sequence[int] | None = None,
    input_dtype: str | None = None,
    example: str | None = None,
) -> Built:
    """``(model, example_input)`` (batch 1) for a reference of any form, seeded."""
    kind = check_input(ref, input_size, input_shape, input_dtype, example)
    opts = dict(options or {})
    if kind == "zoo":
        return zoo.build(ref, input_size, seed=seed, **opts)
    if kind == "hf":
        return hf.build(ref[len(HF_PREFIX) :], input_size, seed=seed, options=opts)
    model = _factory_model(ref, opts, seed)
    return model, _factory_example(example, input_shape, input_dtype, seed)
