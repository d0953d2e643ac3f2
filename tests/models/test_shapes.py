"""models.shapes: generated profiles against real models of the same shape (parameters
exactly, FLOPs against the torch.fx profiler and torchvision's published counts), the
presets' sizes, the precision's bytes, and every bad name and option named."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeplan.core.profile import ModelProfile
from pipeplan.models import shapes, zoo
from pipeplan.models.profiler import profile_model
from pipeplan.models.shapes import GPTShape, Precision, ShapeError

SMALL_GPT = {"n_layer": 3, "d_model": 64, "n_head": 4, "n_ctx": 32, "vocab_size": 211}
FLOPS_REL = 1e-9
"""The generator counts a GPT's FLOPs as the profiler does (module docstring of
models.shapes): equal up to rounding."""
TORCHVISION_REL = 5e-3
"""torchvision's published "GFLOPS" count multiply-adds of the convolutions and matmuls only;
the generator adds one FLOP per element of the norms, activations, adds and pools (0.3% of
ResNet-152, 0.1% of ViT-H/14)."""


def small_gpt(tokens: int = 32) -> tuple[ModelProfile, torch.nn.Module]:
    model, example = zoo.build("gpt", tokens, **SMALL_GPT)
    return profile_model(model, example, "gpt", device_type=None), model


@pytest.mark.parametrize("tokens", [32, 20])
def test_a_small_gpt_matches_the_zoo_model_profiled_by_torch_fx(tokens: int) -> None:
    measured, model = small_gpt(tokens)
    options = {**SMALL_GPT, "precision": "fp32"}
    generated = shapes.generate("gen:gpt-13b", tokens, options)
    # parameters: the whole model and each block, exactly (fp32: 4 bytes each, as torch's)
    assert generated.params_bytes == measured.params_bytes
    count = sum(p.numel() for p in model.parameters())
    assert shapes.parameters(shapes.shape_of("gpt-13b", tokens, options)) == count
    blocks = [x for x in generated.layers if x.name.startswith("blocks.")]
    assert len(blocks) == SMALL_GPT["n_layer"]
    for i, layer in enumerate(blocks):
        assert layer.params_bytes == 4 * sum(p.numel() for p in model.blocks[i].parameters())
    # FLOPs: the profiler's count of the same graph
    assert generated.flops == pytest.approx(measured.flops, rel=FLOPS_REL)
    # what crosses a cut after a block, and the logits
    assert blocks[0].activation_bytes == 4 * tokens * SMALL_GPT["d_model"]
    assert generated.layers[-1].activation_bytes == measured.layers[-1].activation_bytes


def test_saved_activations_of_a_gpt_block_are_the_outputs_of_its_operations() -> None:
    measured, _ = small_gpt()
    names = [x.name for x in measured.layers]
    first, second = names.index("blocks.0.ln1"), names.index("blocks.1.ln1")
    outputs = sum(x.activation_bytes for x in measured.layers[first:second])
    (block,) = [
        x for x in shapes.shape_of("gpt-13b", 32, SMALL_GPT).layers() if x.name == "blocks.0"
    ]
    assert 4 * block.saved_elements == outputs


@pytest.mark.parametrize(
    ("name", "weights", "entry"),
    [
        ("resnet152", "ResNet152_Weights", "IMAGENET1K_V1"),
        ("vit-h14", "ViT_H_14_Weights", "IMAGENET1K_SWAG_LINEAR_V1"),  # the 224 x 224 one
    ],
)
def test_vision_models_match_torchvisions_published_sizes(
    name: str, weights: str, entry: str
) -> None:
    import torchvision.models as tvm  # its weights' metadata only: nothing is downloaded

    meta: dict[str, Any] = getattr(getattr(tvm, weights), entry).meta
    assert shapes.parameters(shapes.shape_of(name)) == meta["num_params"]
    multiply_adds = meta["_ops"] * 1e9
    assert shapes.generate(name).flops == pytest.approx(2 * multiply_adds, rel=TORCHVISION_REL)


def test_the_presets_sizes() -> None:
    sizes = {n: (len(shapes.generate(n)), shapes.parameters(shapes.shape_of(n))) for n in
             ("gpt-13b", "gpt-30b", "gpt-70b", "vit-h14", "resnet152")}  # fmt: skip
    assert {n: layers for n, (layers, _) in sizes.items()} == {
        "gpt-13b": 42, "gpt-30b": 62, "gpt-70b": 82, "vit-h14": 34, "resnet152": 52
    }  # fmt: skip
    billions = {n: round(p / 1e9, 1) for n, (_, p) in sizes.items()}
    assert billions["gpt-13b"] == 13.1 and billions["gpt-30b"] == 32.6
    assert billions["gpt-70b"] == 65.3
    # 13B: a block is 24 s d^2 + 4 s^2 d + 19 s d, forward, per sample of 2,048 tokens
    block = shapes.generate("gpt-13b").layers[1]
    s, d = 2048, 5120
    assert block.flops == 24 * s * d * d + 4 * s * s * d + 19 * s * d
    assert block.params_bytes == 4 * (12 * d * d + 13 * d)


def test_precision_sets_the_activation_bytes_not_the_state() -> None:
    mixed = shapes.generate("gpt-13b")
    fp32 = shapes.generate("gpt-13b", options={"precision": "fp32"})
    assert [x.activation_bytes * 2 for x in mixed.layers] == [
        x.activation_bytes for x in fp32.layers
    ]
    assert mixed.params_bytes == fp32.params_bytes
    params = shapes.parameters(shapes.shape_of("gpt-13b"))
    # rule 9 holds 4 x params_bytes: 16 bytes per parameter under either precision
    assert 4 * mixed.params_bytes == shapes.STATE_BYTES_PER_PARAM * params
    assert shapes.precision_of({}) is Precision.MIXED


def test_options_and_input_size_reshape_the_model() -> None:
    p = shapes.generate("gen:gpt-70b", 1024, {"n_layer": 4})
    assert len(p) == 6 and p.input_shape == (1024,)
    vit = shapes.generate("vit-h14", 448)
    assert vit.input_shape == (3, 448, 448)
    assert vit.layers[1].activation_bytes == 2 * (32 * 32 + 1) * 1280
    small = shapes.generate("resnet152", None, {"blocks": "3x4x6x3"})
    assert len(small) == 3 + 4 + 6 + 3 + 2
    assert ModelProfile.from_dict(small.to_dict()) == small


@pytest.mark.parametrize(
    ("name", "size", "options", "message"),
    [
        ("gpt-7b", None, {}, r"model 'gpt-7b': not a generated model \(one of gen:gpt-13b"),
        ("gpt-13b", None, {"depth": 2}, r"gen:gpt-13b: unknown option 'depth' \(known: "),
        ("gpt-13b", None, {"n_layer": 0}, r"gpt.n_layer: must be an integer >= 1, got 0"),
        ("gpt-13b", None, {"n_layer": 2.5}, r"gpt.n_layer: must be an integer >= 1, got 2.5"),
        ("gpt-13b", None, {"n_head": 3}, r"gpt.d_model: must be a multiple of n_head \(3\), "
         "got 5120"),
        ("gpt-13b", 4096, {}, r"gpt.tokens: must be <= n_ctx \(2048\), got 4096"),
        ("gpt-13b", None, {"precision": "fp8"}, r"precision: 'fp8' is not one of mixed, fp32"),
        ("vit-h14", 230, {}, r"vit.image: must be a multiple of patch \(14\), got 230"),
        ("resnet152", 16, {}, r"resnet.image: must be >= 32, got 16"),
        ("resnet152", None, {"blocks": "3x4"}, r"resnet.blocks: expected four integers >= 1, "
         r"got \(3, 4\)"),
    ],
)  # fmt: skip
def test_bad_names_and_options_are_named(
    name: str, size: int | None, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ShapeError, match=message):
        shapes.generate(name, size, options)


def test_a_shape_checks_itself() -> None:
    with pytest.raises(ShapeError, match=r"gpt.vocab_size: must be an integer >= 1, got -1"):
        GPTShape(2, 64, 4, vocab_size=-1).check()
    assert shapes.is_generated("gen:resnet152") and not shapes.is_generated("gpt")
