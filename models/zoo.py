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

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from pipeplan.core.errors import PipeplanError
from pipeplan.models import zoo_names
from pipeplan.models.zoo_names import GPT1_N_CTX as GPT1_N_CTX
from pipeplan.models.zoo_names import GPT1_VOCAB as GPT1_VOCAB

Builder = Callable[..., nn.Module]


def _check_positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipeplanError(f"{field}: must be an integer >= 1, got {value!r}")


# --- GPT ------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused QKV projection, SDPA, output projection."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, 3C) -> (3, B, H, T, D); no shape queries, so torch.fx traces it as is.
        qkv = self.qkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).flatten(2)))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder: token ids ``(B, T)`` -> next-token logits ``(B, T, vocab)``.

    Attention-probability dropout is left out (SDPA's ``dropout_p`` would be frozen into the
    fx graph at trace time); residual and embedding dropout are ``nn.Dropout`` modules.
    """

    def __init__(
        self,
        n_layer: int = 12,
        d_model: int = 768,
        n_head: int = 12,
        n_ctx: int = GPT1_N_CTX,
        vocab_size: int = GPT1_VOCAB,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(n_ctx, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(d_model, n_head, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        return self.head(self.ln_f(self.blocks(x)))


def _gpt(
    n_layer: int = 12,
    d_model: int = 768,
    n_head: int = 12,
    n_ctx: int = GPT1_N_CTX,
    vocab_size: int = GPT1_VOCAB,
    dropout: float = 0.1,
) -> nn.Module:
    sizes = {"n_layer": n_layer, "d_model": d_model, "n_head": n_head, "n_ctx": n_ctx}
    for key, value in {**sizes, "vocab_size": vocab_size}.items():
        _check_positive(f"gpt.{key}", value)
    if d_model % n_head:
        raise PipeplanError(f"gpt.d_model: must be a multiple of n_head ({n_head}), got {d_model}")
    if not 0.0 <= dropout < 1.0:
        raise PipeplanError(f"gpt.dropout: must be in [0, 1), got {dropout!r}")
    return GPT(n_layer, d_model, n_head, n_ctx, vocab_size, dropout)


# --- digits ---------------------------------------------------------------------------------


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers, for 1 x size x size."""

    def __init__(self, input_size: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        side = input_size // 2
        self.classifier = nn.Sequential(
            nn.Linear(32 * side * side, 64), nn.ReLU(), nn.Linear(64, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


# --- registry -------------------------------------------------------------------------------


def _torchvision(name: str, **extra: Any) -> Builder:
    def build(num_classes: int = 10) -> nn.Module:
        _check_positive(f"{name}.num_classes", num_classes)
        factory = getattr(torchvision.models, name)
        model: nn.Module = factory(weights=None, num_classes=num_classes, **extra)
        return model

    return build


def _digits(input_size: int, num_classes: int = 10) -> nn.Module:
    _check_positive("digits_cnn.num_classes", num_classes)
    return DigitsCNN(input_size, num_classes)


_BUILDERS: dict[str, Builder] = {
    "alexnet": _torchvision("alexnet"),
    "vgg16": _torchvision("vgg16"),
    "inception_v3": _torchvision("inception_v3", aux_logits=False, init_weights=False),
    "resnet50": _torchvision("resnet50"),
    "gpt": _gpt,
    "digits_cnn": _digits,
}

MODELS: tuple[str, ...] = zoo_names.MODELS
"""The names :func:`build` takes (in :mod:`models.zoo_names`, which needs no torch, with
each model's input sizes and options)."""
if tuple(_BUILDERS) != MODELS:  # one list of names: a builder for each, and no other
    raise ImportError(f"models.zoo: builders {tuple(_BUILDERS)} != zoo_names.MODELS {MODELS}")


def _example(
    spec: zoo_names.ZooInput, size: int, options: dict[str, Any], gen: torch.Generator
) -> torch.Tensor:
    if spec.kind == "tokens":
        vocab = options.get("vocab_size", GPT1_VOCAB)
        return torch.randint(vocab, (1, size), generator=gen)
    channels = 1 if spec.kind == "image1" else 3
    return torch.randn((1, channels, size, size), generator=gen)


def build(
    name: str, input_size: int | None = None, *, seed: int = 0, **options: Any
) -> tuple[nn.Module, torch.Tensor]:
    """``(model, example_input)`` for a name in :data:`MODELS` (module docstring: options)."""
    spec = zoo_names.INPUTS.get(name)
    if spec is None:
        raise PipeplanError(f"model name: unknown {name!r} (one of {', '.join(MODELS)})")
    size = zoo_names.check_size(name, input_size, options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        args = (size,) if spec.kind == "image1" else ()
        model = _BUILDERS[name](*args, **options)
    return model, _example(spec, size, options, torch.Generator().manual_seed(seed))
