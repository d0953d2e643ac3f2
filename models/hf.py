"""Hugging Face ``transformers`` models by class name (``hf:GPT2LMHeadModel``), never
downloaded: built from the class's config with random weights, seeded.

``build("LlamaForCausalLM", 32, options={"num_hidden_layers": 2, "hidden_size": 64})``
makes ``LlamaForCausalLM.config_class(**options)`` and the model from it
(``_from_config``), inside ``torch.random.fork_rng`` after ``manual_seed(seed)``: the same
weights on every build, the global RNG untouched. Two defaults differ from the configs':

- ``tie_word_embeddings=False``: a tied input embedding and LM head would be one parameter
  read by the first and the last stage, which a pipeline cannot train (each stage owns its
  parameters); give ``tie_word_embeddings=True`` to keep them tied on one stage;
- ``use_cache=False``: no key/value cache is returned (training).

The model is wrapped in :class:`TokenLogits`, which takes token ids ``(B, T)`` and returns
the logits alone (a pipeline's last stage computes the loss on one tensor). The example
input is token ids of shape ``(1, input_size)`` drawn below the vocabulary size from the
seed; without ``input_size``, the config's maximum positions capped at
:data:`DEFAULT_TOKENS`. torch.fx cannot trace these models: the layer machinery exports
them with ``torch.export`` (:mod:`models.exported`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipeplan.core.errors import PipeplanError

DEFAULT_TOKENS = 64
"""Sequence length of the example input when none is given (or the model's maximum)."""
DEFAULTS: dict[str, Any] = {"tie_word_embeddings": False, "use_cache": False}
"""Config options pipeplan sets unless the options give them (module docstring)."""


class TokenLogits(nn.Module):
    """A ``transformers`` model as token ids -> logits (no cache, one output tensor)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.label = type(model).__name__
        """The wrapped class, which errors name."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        assert isinstance(logits, torch.Tensor)
        return logits


def model_class(name: str) -> Any:
    """The ``transformers`` class called ``name``, with a config class to build it from."""
    try:
        import transformers
    except ImportError as e:
        raise PipeplanError(
            f"model: hf:{name} needs Hugging Face transformers: pip install 'pipeplan[hf]'"
        ) from e
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or not hasattr(
        cls, "config_class"
    ):
        raise PipeplanError(
            f"model: hf:{name} is not a transformers model class (e.g. hf:GPT2LMHeadModel, "
            "hf:LlamaForCausalLM)"
        )
    return cls


def _config(cls: Any, options: Mapping[str, Any]) -> Any:
    name = cls.__name__
    config_class = cls.config_class
    unknown = [k for k in options if not hasattr(config_class(), k)]
    if unknown:
        raise PipeplanError(
            f"model_options: {unknown[0]!r} is not an option of hf:{name} ({config_class.__name__})"
        )
    try:
        return config_class(**{**DEFAULTS, **options})
    except (TypeError, ValueError) as e:
        raise PipeplanError(f"model_options: hf:{name} refuses {dict(options)} ({e})") from e


def _tokens(config: Any, name: str, input_size: int | None) -> int:
    limit = getattr(config, "max_position_embeddings", None)
    if input_size is None:
        return min(DEFAULT_TOKENS, limit) if isinstance(limit, int) else DEFAULT_TOKENS
    if isinstance(input_size, bool) or not isinstance(input_size, int) or input_size < 1:
        raise PipeplanError(
            f"input_size: hf:{name} takes a sequence length >= 1, got {input_size!r}"
        )
    if isinstance(limit, int) and input_size > limit:
        raise PipeplanError(
            f"input_size: must be <= max_position_embeddings ({limit}) of hf:{name}, "
            f"got {input_size}"
        )
    return input_size


def build(
    name: str, input_size: int | None = None, *, seed: int = 0, options: Mapping[str, Any]
) -> tuple[nn.Module, torch.Tensor]:
    """``(TokenLogits(model), token_ids)`` for the ``transformers`` class ``name``."""
    cls = model_class(name)
    config = _config(cls, options)
    tokens = _tokens(config, name, input_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TokenLogits(cls._from_config(config))
    vocab = int(getattr(config, "vocab_size", 2))
    example = torch.randint(vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))
    return model, example
