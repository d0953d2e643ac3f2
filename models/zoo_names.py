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
"""Named models to profile, plan and run: torchvision CNNs, a GPT-style decoder, a digits CNN.

``build(name, input_size, **options)`` returns ``(model, example_input)``; the example input
has a batch dimension of 1. Weights are freshly initialised from ``seed`` (never downloaded),
so two builds with the same arguments are identical, and the global RNG is left untouched.

- ``alexnet``, ``vgg16``, ``inception_v3``, ``resnet50``: torchvision, ``weights=None``;
  ``input_size`` is the image side (3 x size x size); option ``num_classes`` (default 10).
- ``gpt``: a GPT-1 sized decoder in plain ``torch.nn`` (token + position embeddings, pre-LN
  blocks of causal self-attention and an MLP, final LayerNorm, LM head); ``input_size`` is
  the sequence length; options ``n_layer`` (12), ``d_model`` (768), ``n_head`` (12),
  ``n_ctx`` (512), ``vocab_size`` (40478), ``dropout`` (0.1).
- ``digits_cnn``: a small CNN for 8 x 8 single-channel digits (scikit-learn's
  ``load_digits``), 10 classes; ``input_size`` is the image side.
"""


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
