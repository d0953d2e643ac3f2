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
reference alone. :func:`check_reference` checks a reference's form without importing
anything (the API process must not import a user's code); the torch-free parts (option
values, shapes, whether a reference names code) are :mod:`core.model_refs`'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from pipeplan.core.code import is_code_ref, load_callable
from pipeplan.core.errors import PipeplanError
from pipeplan.core.model_refs import HF_PREFIX, names_code, parse_options, parse_shape, parse_value
from pipeplan.models import hf, zoo

__all__ = [
    "HF_PREFIX", "INPUT_DTYPES", "Built", "InputDtype", "Kind", "build_model", "check_input",
    "names_code", "parse_options", "parse_shape", "parse_value", "reference_kind",
]  # fmt: skip

Kind = Literal["zoo", "code", "hf"]
InputDtype = Literal["float32", "int64"]
INPUT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "int64": torch.int64}
Built = tuple[nn.Module, torch.Tensor]

_HF_CLASS = re.compile(r"^[A-Za-z_]\w*$")


def reference_kind(ref: str, field: str = "model") -> Kind:
    """The form of a model reference, checked without importing anything."""
    if ref.startswith(HF_PREFIX):
        if not _HF_CLASS.match(ref[len(HF_PREFIX) :]):
            raise PipeplanError(f"{field}: {ref!r} is not hf:ClassName (e.g. hf:GPT2LMHeadModel)")
        return "hf"
    if is_code_ref(ref):
        return "code"
    if ref in zoo.MODELS:
        return "zoo"
    raise PipeplanError(
        f"{field}: unknown {ref!r} (a zoo name: {', '.join(zoo.MODELS)}; "
        "package.module:factory; or hf:ClassName)"
    )


def check_input(
    ref: str,
    input_size: int | None,
    input_shape: Sequence[int] | None,
    input_dtype: str | None,
    example: str | None,
    fields: Mapping[str, str] | None = None,
) -> Kind:
    """The reference's form and whether its input is described the way its form takes;
    ``fields`` renames the fields in errors (``{"input_shape": "--input-shape"}``)."""
    name = {"model": "model", "input_size": "input_size", "input_shape": "input_shape",
            "input_dtype": "input_dtype", "example": "example", **(fields or {})}  # fmt: skip
    kind = reference_kind(ref, name["model"])
    if kind == "code" and input_size is not None:
        raise PipeplanError(
            f"{name['input_size']}: {input_size!r} does not apply to {ref!r} (a factory's "
            "input is described by input_shape or an example function)"
        )
    given = {"input_shape": input_shape, "input_dtype": input_dtype, "example": example}
    if kind != "code":
        for key, value in given.items():
            if value is not None:
                raise PipeplanError(
                    f"{name[key]}: {value!r} only applies to a package.module:factory model, "
                    f"not {ref!r} (it takes input_size)"
                )
        return kind
    if input_dtype is not None and input_dtype not in INPUT_DTYPES:
        raise PipeplanError(
            f"{name['input_dtype']}: one of {', '.join(INPUT_DTYPES)}, got {input_dtype!r}"
        )
    if input_shape is not None and (
        not input_shape or any(isinstance(n, bool) or int(n) < 1 for n in input_shape)
    ):
        raise PipeplanError(f"{name['input_shape']}: sizes must be >= 1, got {input_shape!r}")
    if example is not None:
        if not is_code_ref(example):
            raise PipeplanError(
                f"{name['example']}: {example!r} is not of the form package.module:function"
            )
        if input_shape is not None or input_dtype is not None:
            raise PipeplanError(
                f"{name['example']}: give either an example function or input_shape/"
                f"input_dtype, not both (got {example!r} and {input_shape!r})"
            )
    elif input_shape is None:
        raise PipeplanError(
            f"{name['input_shape']}: model {ref!r} needs its input's shape (without the "
            "batch dimension) or an example function"
        )
    return kind


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
