"""models.zoo: every model builds, runs and profiles (analytic); errors name field and value."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import nn

from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import ModelProfile
from pipeplan.models import zoo
from pipeplan.models.profiler import profile_model

# Small but valid sizes keep the suite fast; GPT keeps GPT-1 widths with 2 blocks.
SMALL: dict[str, tuple[int, dict[str, Any]]] = {
    "alexnet": (63, {}),
    "vgg16": (32, {}),
    "inception_v3": (75, {}),
    "resnet50": (32, {}),
    "gpt": (16, {"n_layer": 2}),
    "digits_cnn": (8, {}),
}
# Layers after folding; a change here means the folding (or torchvision) changed.
LAYERS = {
    "alexnet": 21,
    "vgg16": 39,
    "inception_v3": 313,
    "resnet50": 174,
    "gpt": 30,
    "digits_cnn": 8,
}


@functools.cache
def built(name: str) -> tuple[nn.Module, torch.Tensor, ModelProfile]:
    size, options = SMALL[name]
    model, x = zoo.build(name, size, **options)
    return model, x, profile_model(model, x, name, device_type=None)


def test_models_listed() -> None:
    assert set(zoo.MODELS) == set(SMALL)


@pytest.mark.parametrize("name", zoo.MODELS)
def test_builds_and_profiles(name: str) -> None:
    model, x, p = built(name)
    assert len(p) == LAYERS[name]
    assert p.flops > 0
    assert all(layer.flops >= 0 for layer in p.layers)
    assert p.params_bytes == sum(q.numel() * 4 for q in model.parameters())
    assert p.input_shape == tuple(x.shape[1:])
    again = profile_model(model, x, name, device_type=None)  # a fresh trace: same layers
    assert again == p


@pytest.mark.parametrize("name", zoo.MODELS)
def test_forward_shape(name: str) -> None:
    model, x, _ = built(name)
    model.eval()
    with torch.no_grad():
        out = model(x)
    expected = (1, x.shape[1], zoo.GPT1_VOCAB) if name == "gpt" else (1, 10)
    assert tuple(out.shape) == expected


@pytest.mark.parametrize(
    ("name", "ops"),
    [
        ("alexnet", {"conv", "relu", "pool", "dropout", "fc"}),
        ("vgg16", {"conv", "relu", "pool", "fc"}),
        ("inception_v3", {"conv", "norm", "concat", "pool"}),
        ("resnet50", {"conv", "norm", "add"}),
        ("gpt", {"embedding", "norm", "fc", "attention", "add", "dropout"}),
    ],
)
def test_expected_ops(name: str, ops: set[str]) -> None:
    assert ops <= {layer.op for layer in built(name)[2].layers}


def test_example_inputs() -> None:
    _, x = zoo.build("digits_cnn")
    assert x.shape == (1, 1, 8, 8)
    _, x = zoo.build("gpt", n_layer=1, d_model=32, n_head=4, vocab_size=50)
    assert x.shape == (1, 64) and x.dtype == torch.int64 and int(x.max()) < 50


def test_inception_has_no_aux_head() -> None:
    model, _, _ = built("inception_v3")
    assert getattr(model, "AuxLogits", None) is None


def test_num_classes_option() -> None:
    model, x = zoo.build("digits_cnn", num_classes=3)
    assert model(x).shape == (1, 3)


def test_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    (a, xa), (b, xb) = zoo.build("digits_cnn", seed=1), zoo.build("digits_cnn", seed=1)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(xa, xb)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    c, _ = zoo.build("digits_cnn", seed=2)
    assert not torch.equal(next(c.parameters()), next(a.parameters()))


@pytest.mark.parametrize(
    ("name", "size", "options", "message"),
    [
        ("nosuch", None, {}, "model name: unknown 'nosuch'"),
        ("alexnet", 62, {}, "alexnet.input_size: must be >= 63, got 62"),
        ("vgg16", 31, {}, "vgg16.input_size: must be >= 32, got 31"),
        ("inception_v3", 74, {}, "inception_v3.input_size: must be >= 75, got 74"),
        ("resnet50", 16, {}, "resnet50.input_size: must be >= 32, got 16"),
        ("digits_cnn", 1, {}, "digits_cnn.input_size: must be >= 2, got 1"),
        ("gpt", 0, {}, "gpt.input_size: must be >= 1, got 0"),
        ("gpt", 600, {}, "gpt.input_size: must be <= n_ctx (512), got 600"),
        ("gpt", 8, {"n_ctx": 4}, "gpt.input_size: must be <= n_ctx (4), got 8"),
        ("digits_cnn", 8.0, {}, "digits_cnn.input_size: expected an integer, got 8.0"),
        ("digits_cnn", None, {"depth": 3}, "digits_cnn: unknown option 'depth'"),
        ("digits_cnn", None, {"num_classes": 0},
         "digits_cnn.num_classes: must be an integer >= 1, got 0"),
        ("gpt", 8, {"d_model": 30, "n_head": 4},
         "gpt.d_model: must be a multiple of n_head (4), got 30"),
        ("gpt", 8, {"n_layer": 0}, "gpt.n_layer: must be an integer >= 1, got 0"),
        ("gpt", 8, {"dropout": 1.5}, "gpt.dropout: must be in [0, 1), got 1.5"),
    ],
)  # fmt: skip
def test_bad_arguments_name_field_and_value(
    name: str, size: Any, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(PipeplanError, match=re.escape(message)):
        zoo.build(name, size, **options)
