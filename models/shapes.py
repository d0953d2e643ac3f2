"""Profiles of large models built from their shapes, without torch and without building them.

A production-size model (a 13B-70B GPT, ViT-H/14, ResNet-152) is too large to build and trace
on a small machine, but its per-layer sizes follow from its shape. :func:`generate` writes the
project's profile (:class:`~core.profile.ModelProfile`, analytic: no timings, so the cost
model's rule 1 prices each layer by ``flops / device flops``, backward twice that) from
formulas, one profile layer per repeated block:

- **GPT-style decoder** (pre-LN, as :class:`models.zoo.GPT`: token + position embeddings,
  blocks of causal self-attention and a 4x MLP, a final LayerNorm, an untied LM head without
  bias), ``s`` tokens per sample, width ``d``, vocabulary ``V``. Layers: ``embed``,
  ``blocks.0 .. blocks.(L-1)``, ``head``.

  - A block's parameters: ``12 d^2 + 13 d`` (QKV ``3d^2 + 3d``, output projection ``d^2 + d``,
    MLP ``4d^2 + 4d`` and ``4d^2 + d``, two LayerNorms ``2d`` each).
  - A block's forward FLOPs per sample: the matmuls ``2 s (12 d^2)``, attention's two
    matmuls over the full score matrix ``2 x 2 s^2 d`` (causal masking not discounted), and
    one FLOP per output element of each bias (``9 s d``), LayerNorm (``2 s d``), GELU
    (``4 s d``), dropout (``2 s d``) and residual add (``2 s d``):
    ``24 s d^2 + 4 s^2 d + 19 s d``. The embedding costs ``4 s d`` (two lookups, an add, a
    dropout), the head ``2 s d V + s d``. This is how :mod:`models.layer_sizes` counts the
    same graph, so a zoo GPT profiled by torch.fx has the same total (tested).
- **ViT** (torchvision's ``VisionTransformer``: patch convolution, class token, position
  embedding, pre-LN encoder blocks with ``nn.MultiheadAttention``, final LayerNorm, a linear
  head), ``t = (image / patch)^2 + 1`` tokens: a block as the GPT's with ``s = t`` and a
  third dropout (``+ t d``); the patch embedding ``2 (t-1) (3 p^2) d + (t-1) d`` plus a
  concat, an add and a dropout (``3 t d``); the head ``t d + 2 d C + C`` for ``C`` classes.
  Layers ``embed``, ``encoder.0 ..``, ``head``.
- **ResNet** (torchvision's v1.5 bottleneck: stride on the 3x3 convolution, expansion 4):
  a convolution costs ``2 x k^2 x C_in x C_out`` FLOPs per output pixel, a BatchNorm,
  ReLU and residual add one FLOP per output element, a pool one per input element. Layers
  ``stem`` (7x7 convolution, BatchNorm, ReLU, max pool), one per bottleneck
  (``layer1.0 .. layer4.2``), ``head`` (average pool, linear). Parameters: convolution
  weights (no bias), BatchNorm ``2 C``, the linear layer's weight and bias.

Backward FLOPs are twice the forward (a gradient for the inputs and one for the weights):
:attr:`LayerShape.bwd_flops`, the ratio rule 1 applies.

**Bytes.** ``precision`` is ``mixed`` (fp16/bf16 weights, gradients and activations, fp32
master weights and Adam moments: ``2 + 2 + 4 + 4 + 4 = 16`` bytes of training state per
parameter) or ``fp32`` (weights, gradients and two Adam moments: ``4 x 4 = 16`` bytes).
Rule 9 of the cost model holds ``4 x params_bytes`` of state per stage, so ``params_bytes`` is
4 bytes per parameter under both (the state comes out right; under ``mixed`` rule 8's
all-reduce then moves fp32 gradients, twice what an fp16 all-reduce moves). Activations are
2 bytes per element under ``mixed``, 4 under ``fp32``.

**A block's activation bytes** are its output (``s d`` elements for a GPT or ViT block,
``4 w H W`` for a bottleneck of width ``w``): the profile format's ``activation_bytes`` is
what other layers read, which is what crosses a cut (rule 3). Rule 9 sums these over a
stage as the activations it holds per sample, so at block granularity it counts what a stage
keeps when each block recomputes its inside in the backward (per-block activation
checkpointing), without the extra forward that recomputation costs. Without recomputation a
block keeps the outputs of its operations, :attr:`LayerShape.saved_elements` (``20 s d`` for a
GPT block: what a torch.fx profile of the block's operations sums to); the profile does not
carry it, the format having one field for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import LayerProfile, ModelProfile

PREFIX = "gen:"
"""How a generated model is named where a model is named (``pipeplan profile gen:gpt-13b``)."""


class ShapeError(PipeplanError):
    """A generated model's name or option is not one this module builds."""


class Precision(StrEnum):
    """How training stores numbers (module docstring, "Bytes")."""

    MIXED = "mixed"
    FP32 = "fp32"


STATE_BYTES_PER_PARAM = 16
"""Training state per parameter under either precision (module docstring, "Bytes")."""
PARAMS_BYTES_PER_PARAM = 4
"""``params_bytes`` per parameter: rule 9's four copies of it are :data:`STATE_BYTES_PER_PARAM`."""
ACTIVATION_BYTES = {Precision.MIXED: 2, Precision.FP32: 4}
"""Bytes per activation element."""


@dataclass(frozen=True)
class LayerShape:
    """One profile layer as the formulas give it, per sample: parameters (a count), forward
    FLOPs, the elements of its output (what the next layer reads) and of everything its
    operations output (what it keeps for the backward without recomputation)."""

    name: str
    op: str
    params: int
    fwd_flops: float
    output_elements: int
    saved_elements: int

    @property
    def bwd_flops(self) -> float:
        """The backward: twice the forward (input and weight gradients)."""
        return 2.0 * self.fwd_flops


# --- GPT ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTShape:
    """A pre-LN GPT decoder (:class:`models.zoo.GPT`'s layout); ``tokens`` per sample
    (default ``n_ctx``)."""

    n_layer: int
    d_model: int
    n_head: int
    n_ctx: int = 2048
    vocab_size: int = 50257
    tokens: int | None = None

    def check(self) -> None:
        _positive(self, ("n_layer", "d_model", "n_head", "n_ctx", "vocab_size"))
        if self.d_model % self.n_head:
            raise ShapeError(
                f"gpt.d_model: must be a multiple of n_head ({self.n_head}), got {self.d_model}"
            )
        if self.tokens is not None:
            _positive(self, ("tokens",))
            if self.tokens > self.n_ctx:
                raise ShapeError(f"gpt.tokens: must be <= n_ctx ({self.n_ctx}), got {self.tokens}")

    def input_shape(self) -> tuple[int, ...]:
        return (self.seq,)

    @property
    def seq(self) -> int:
        return self.n_ctx if self.tokens is None else self.tokens

    def layers(self) -> list[LayerShape]:
        s, d, v = self.seq, self.d_model, self.vocab_size
        embed = LayerShape(
            "embed", "embedding", (v + self.n_ctx) * d, 4.0 * s * d, s * d, 4 * s * d
        )
        block = transformer_block(s, d, dropouts=2)
        blocks = [replace(block, name=f"blocks.{i}") for i in range(self.n_layer)]
        head_flops = 2.0 * s * d * v + s * d
        head = LayerShape("head", "fc", 2 * d + d * v, head_flops, s * v, s * d + s * v)
        return [embed, *blocks, head]


def transformer_block(tokens: int, d: int, dropouts: int) -> LayerShape:
    """A pre-LN transformer block over ``tokens`` of width ``d`` with ``dropouts`` dropout
    modules (module docstring)."""
    s = tokens
    matmul = 2.0 * s * 12 * d * d
    attention = 2.0 * 2 * s * s * d
    elementwise = (9 + 2 + 4 + dropouts + 2) * s * d  # biases, LayerNorms, GELU, dropouts, adds
    # outputs of ln1, qkv, attention, out projection, add, ln2, fc1, GELU, fc2, add; dropouts
    saved = (1 + 3 + 1 + 1 + 1 + 1 + 4 + 4 + 1 + 1 + dropouts) * s * d
    flops = matmul + attention + elementwise
    return LayerShape("block", "attention", 12 * d * d + 13 * d, flops, s * d, saved)


# --- ViT ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViTShape:
    """torchvision's ``VisionTransformer``: ``image`` side, ``patch`` side, ``n_layer`` blocks
    of width ``d_model`` with a ``4 d`` MLP, ``num_classes`` outputs."""

    n_layer: int = 32
    d_model: int = 1280
    n_head: int = 16
    patch: int = 14
    image: int = 224
    num_classes: int = 1000

    def check(self) -> None:
        _positive(self, ("n_layer", "d_model", "n_head", "patch", "image", "num_classes"))
        if self.d_model % self.n_head:
            raise ShapeError(
                f"vit.d_model: must be a multiple of n_head ({self.n_head}), got {self.d_model}"
            )
        if self.image % self.patch:
            raise ShapeError(
                f"vit.image: must be a multiple of patch ({self.patch}), got {self.image}"
            )

    def input_shape(self) -> tuple[int, ...]:
        return (3, self.image, self.image)

    def layers(self) -> list[LayerShape]:
        d, c, p = self.d_model, self.num_classes, self.patch
        patches = (self.image // p) ** 2
        t = patches + 1
        conv = 2.0 * patches * 3 * p * p * d + patches * d
        params = 3 * p * p * d + d + d + t * d  # patch convolution, class token, positions
        embed_flops = conv + 3.0 * t * d  # the convolution; concat, add, dropout
        embed = LayerShape("embed", "conv", params, embed_flops, t * d, patches * d + 3 * t * d)
        block = transformer_block(t, d, dropouts=3)
        blocks = [replace(block, name=f"encoder.{i}") for i in range(self.n_layer)]
        head = LayerShape("head", "fc", 2 * d + d * c + c, t * d + 2.0 * d * c + c, c, t * d + c)
        return [embed, *blocks, head]


# --- ResNet ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResNetShape:
    """torchvision's bottleneck ResNet (v1.5): ``blocks`` per stage, ``image`` side."""

    blocks: tuple[int, int, int, int] = (3, 8, 36, 3)
    image: int = 224
    num_classes: int = 1000

    def check(self) -> None:
        _positive(self, ("image", "num_classes"))
        if len(self.blocks) != 4 or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.blocks
        ):
            raise ShapeError(f"resnet.blocks: expected four integers >= 1, got {self.blocks!r}")
        if self.image < 32:
            raise ShapeError(f"resnet.image: must be >= 32, got {self.image}")

    def input_shape(self) -> tuple[int, ...]:
        return (3, self.image, self.image)

    def layers(self) -> list[LayerShape]:
        h = _conv_out(self.image, 7, 2, 3)
        stem_flops = 2.0 * h * h * 3 * 49 * 64 + 2 * h * h * 64  # conv; BatchNorm, ReLU
        stem_flops += h * h * 64  # the max pool: one per input element
        pooled = _conv_out(h, 3, 2, 1)
        saved = 3 * h * h * 64 + 64 * pooled * pooled
        stem = LayerShape("stem", "conv", 3 * 49 * 64 + 2 * 64, stem_flops, 64 * pooled**2, saved)
        out = [stem]
        side, channels = pooled, 64
        for stage, count in enumerate(self.blocks):
            width = 64 * 2**stage
            for k in range(count):
                stride = 2 if stage > 0 and k == 0 else 1
                block = _bottleneck(f"layer{stage + 1}.{k}", channels, width, side, stride)
                out.append(block)
                side, channels = _conv_out(side, 3, stride, 1), 4 * width
        c = self.num_classes
        head_flops = float(channels * side * side) + 2.0 * channels * c + c  # pool, linear
        head = LayerShape("head", "fc", channels * c + c, head_flops, c, channels + c)
        return [*out, head]


def _conv_out(side: int, kernel: int, stride: int, pad: int) -> int:
    return (side + 2 * pad - kernel) // stride + 1


def _bottleneck(name: str, c_in: int, width: int, side: int, stride: int) -> LayerShape:
    """A v1.5 bottleneck (1x1, 3x3 with the stride, 1x1 to ``4 width``), with a projection
    shortcut (1x1 convolution with the stride, BatchNorm) where the shape changes."""
    c_out, h2 = 4 * width, _conv_out(side, 3, stride, 1)
    a1, a2 = side * side, h2 * h2
    params = c_in * width + 9 * width * width + width * c_out + 2 * (2 * width + c_out)
    flops = 2.0 * a1 * c_in * width + 2 * a1 * width  # conv1; bn1, relu
    flops += 2.0 * a2 * 9 * width * width + 2 * a2 * width  # conv2; bn2, relu
    flops += 2.0 * a2 * width * c_out + 3 * a2 * c_out  # conv3; bn3, add, relu
    saved = 3 * a1 * width + 3 * a2 * width + 4 * a2 * c_out
    if stride != 1 or c_in != c_out:
        params += c_in * c_out + 2 * c_out
        flops += 2.0 * a2 * c_in * c_out + a2 * c_out  # projection; its BatchNorm
        saved += 2 * a2 * c_out
    return LayerShape(name, "conv", params, flops, a2 * c_out, saved)


# --- the models --------------------------------------------------------------------------------

Shape = GPTShape | ViTShape | ResNetShape

MODELS: dict[str, Shape] = {
    # GPT-3 13B's shape (Brown et al. 2020: 40 layers, d 5,140 there; 5,120 here, a multiple
    # of 40 heads of 128), 2,048 tokens, GPT-2's 50,257-token vocabulary: 13.1e9 parameters
    "gpt-13b": GPTShape(n_layer=40, d_model=5120, n_head=40),
    # 60 blocks of d 6,656 (52 heads of 128): 32.6e9 parameters
    "gpt-30b": GPTShape(n_layer=60, d_model=6656, n_head=52),
    # 80 blocks of d 8,192 (64 heads of 128), a plain 4x GELU MLP: 65.3e9 parameters
    "gpt-70b": GPTShape(n_layer=80, d_model=8192, n_head=64),
    # ViT-H/14 at 224 x 224 (Dosovitskiy et al. 2021): 32 blocks, d 1,280: 632e6 parameters
    "vit-h14": ViTShape(),
    # ResNet-152 at 224 x 224 (He et al. 2016): 60.2e6 parameters
    "resnet152": ResNetShape(),
}
"""The generated models by name (what follows ``gen:``); options override their fields."""


def names() -> list[str]:
    """The generated models' references (``gen:NAME``)."""
    return [f"{PREFIX}{n}" for n in MODELS]


def is_generated(ref: str | None) -> bool:
    """Whether a model reference names a generated model (``gen:...``)."""
    return ref is not None and ref.startswith(PREFIX)


def shape_of(
    name: str, input_size: int | None = None, options: Mapping[str, Any] | None = None
) -> Shape:
    """The shape of ``name`` (with or without ``gen:``), its fields replaced by ``options``
    (``precision`` aside) and ``input_size`` (tokens of a GPT, the image side otherwise);
    every value checked, an error naming the field and the value."""
    key = name.removeprefix(PREFIX)
    if key not in MODELS:
        raise ShapeError(f"model {name!r}: not a generated model (one of {', '.join(names())})")
    base = MODELS[key]
    known = {f.name for f in fields(base)}
    given = {k: v for k, v in dict(options or {}).items() if k != "precision"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ShapeError(
            f"{PREFIX}{key}: unknown option {unknown[0]!r} "
            f"(known: {', '.join(sorted(known | {'precision'}))})"
        )
    if isinstance(base, ResNetShape) and "blocks" in given:
        given["blocks"] = _blocks(given["blocks"])
    if input_size is not None:
        given["tokens" if isinstance(base, GPTShape) else "image"] = input_size
    shape = replace(base, **given)
    shape.check()
    return shape


def _blocks(value: Any) -> Any:
    """``-M blocks=3x4x6x3`` (text) as a tuple; anything else is left for the check."""
    if isinstance(value, str):
        try:
            return tuple(int(b) for b in value.replace(",", "x").split("x"))
        except ValueError:
            return value
    return tuple(value) if isinstance(value, list | tuple) else value


def precision_of(options: Mapping[str, Any] | None) -> Precision:
    """``options['precision']`` (default ``mixed``), checked."""
    value = dict(options or {}).get("precision", Precision.MIXED.value)
    try:
        return Precision(value)
    except ValueError:
        raise ShapeError(
            f"precision: {value!r} is not one of {', '.join(p.value for p in Precision)}"
        ) from None


def generate(
    name: str, input_size: int | None = None, options: Mapping[str, Any] | None = None
) -> ModelProfile:
    """The analytic profile of a generated model (module docstring): one layer per
    :class:`LayerShape`, a chain (each layer's successor is the next)."""
    shape = shape_of(name, input_size, options)
    return to_profile(name.removeprefix(PREFIX), shape, precision_of(options))


def to_profile(name: str, shape: Shape, precision: Precision) -> ModelProfile:
    """``shape``'s layers as a :class:`~core.profile.ModelProfile` under ``precision``."""
    act = ACTIVATION_BYTES[precision]
    layers = shape.layers()
    n = len(layers)
    return ModelProfile(
        name,
        shape.input_shape(),
        tuple(
            LayerProfile(
                x.name,
                x.op,
                x.params * PARAMS_BYTES_PER_PARAM,
                x.fwd_flops,
                x.output_elements * act,
                (i + 1,) if i + 1 < n else (),
            )
            for i, x in enumerate(layers)
        ),
    )


def parameters(shape: Shape) -> int:
    """The model's parameter count."""
    return sum(x.params for x in shape.layers())


def _positive(shape: object, keys: tuple[str, ...]) -> None:
    label = _LABELS[type(shape)]
    for key in keys:
        value = getattr(shape, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ShapeError(f"{label}.{key}: must be an integer >= 1, got {value!r}")


_LABELS: dict[type, str] = {GPTShape: "gpt", ViTShape: "vit", ResNetShape: "resnet"}
