"""A model reference's form and its input fields, checked without torch.

The forms (a zoo name, ``package.module:factory``, ``hf:ClassName``) and how each is built
are :mod:`models.spec`'s; this module reads a reference and its ``input_*`` fields only, so
the API process and the CLI's client commands refuse a malformed one without importing
torch or the user's code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

from pipeplan.core.code import is_code_ref
from pipeplan.core.errors import PipeplanError
from pipeplan.core.model_refs import HF_PREFIX
from pipeplan.models import zoo_names

Kind = Literal["zoo", "code", "hf"]
InputDtype = Literal["float32", "int64"]
INPUT_DTYPE_NAMES: tuple[str, ...] = get_args(InputDtype)
"""The dtypes a factory's ``input_shape`` may come with (:data:`models.spec.INPUT_DTYPES`)."""

_HF_CLASS = re.compile(r"^[A-Za-z_]\w*$")


def reference_kind(ref: str, field: str = "model") -> Kind:
    """The form of a model reference, checked without importing anything."""
    if ref.startswith(HF_PREFIX):
        if not _HF_CLASS.match(ref[len(HF_PREFIX) :]):
            raise PipeplanError(f"{field}: {ref!r} is not hf:ClassName (e.g. hf:GPT2LMHeadModel)")
        return "hf"
    if is_code_ref(ref):
        return "code"
    if ref in zoo_names.MODELS:
        return "zoo"
    raise PipeplanError(
        f"{field}: unknown {ref!r} (a zoo name: {', '.join(zoo_names.MODELS)}; "
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
    if input_dtype is not None and input_dtype not in INPUT_DTYPE_NAMES:
        raise PipeplanError(
            f"{name['input_dtype']}: one of {', '.join(INPUT_DTYPE_NAMES)}, got {input_dtype!r}"
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
