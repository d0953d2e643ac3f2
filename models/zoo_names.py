"""The zoo's model names and inputs, readable without torch: the service states the names
in its OpenAPI document (a spec's ``model``) and checks a spec's input size with
:func:`check_size`, and the client commands must not import torch. :mod:`models.zoo`
builds exactly these (``zoo.MODELS`` is this tuple; its import checks it has a builder for
each)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeplan.core.errors import PipeplanError

GPT1_N_CTX = 512
GPT1_VOCAB = 40478


@dataclass(frozen=True)
class ZooInput:
    """What one named model takes: its input's size and kind, and the options it knows."""

    default_size: int
    min_size: int
    kind: Literal["image3", "image1", "tokens"]
    """A 3-channel or 1-channel square image of side ``size``, or ``size`` token ids."""
    options: tuple[str, ...]
    max_size_option: str | None = None
    """The option that bounds the size (the GPT's context, ``n_ctx``), if any."""


_IMAGE = ("num_classes",)
INPUTS: dict[str, ZooInput] = {
    "alexnet": ZooInput(64, 63, "image3", _IMAGE),
    "vgg16": ZooInput(32, 32, "image3", _IMAGE),
    "inception_v3": ZooInput(75, 75, "image3", _IMAGE),
    "resnet50": ZooInput(32, 32, "image3", _IMAGE),
    "gpt": ZooInput(64, 1, "tokens",
                    ("n_layer", "d_model", "n_head", "n_ctx", "vocab_size", "dropout"), "n_ctx"),
    "digits_cnn": ZooInput(8, 2, "image1", ("num_classes",)),
}  # fmt: skip

MODELS: tuple[str, ...] = tuple(INPUTS)
"""The zoo's names, in the order :mod:`models.zoo` documents them (its docstring says what
each model is and the options it takes)."""


def check_size(name: str, size: Any, options: Mapping[str, Any]) -> int:
    """The input size a build of ``name`` uses (``size``, or the model's default for None),
    refused naming the field when it is out of the model's range or an option is unknown.
    The options' values are the builders' to check."""
    spec = INPUTS[name]
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise PipeplanError(
            f"{name}: unknown option {unknown[0]!r} (known: {', '.join(spec.options)})"
        )
    size = spec.default_size if size is None else size
    if isinstance(size, bool) or not isinstance(size, int):
        raise PipeplanError(f"{name}.input_size: expected an integer, got {size!r}")
    if size < spec.min_size:
        raise PipeplanError(f"{name}.input_size: must be >= {spec.min_size}, got {size}")
    if spec.max_size_option is not None:
        limit = options.get(spec.max_size_option, GPT1_N_CTX)
        if size > limit:
            raise PipeplanError(
                f"{name}.input_size: must be <= {spec.max_size_option} ({limit}), got {size}"
            )
    return size
