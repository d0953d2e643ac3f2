"""Model references (:mod:`models.spec`): zoo names, ``package.module:factory``, ``hf:``;
their options, inputs and errors; user modules only torch.export can trace."""

from __future__ import annotations

import pickle
import sys
from typing import Any

import pytest
import torch

from pipeplan.core.errors import PipeplanError
from pipeplan.executor.model import ModelSource, OptimizerConfig, train_single_process
from pipeplan.executor.partition import count_layers, fetch_attr, partition
from pipeplan.models import zoo
from pipeplan.models.fx_layers import trace
from pipeplan.models.profiler import profile_model
from pipeplan.models.spec import (
    build_model,
    check_input,
    names_code,
    parse_options,
    parse_shape,
    parse_value,
    reference_kind,
)

MLP = "tests.models.factories:mlp"


def test_reference_kinds_need_no_import() -> None:
    assert reference_kind("gpt") == "zoo"
    assert reference_kind("hf:GPT2LMHeadModel") == "hf"
    assert reference_kind("no_such_package.models:make") == "code"  # not imported
    assert names_code("a.b:c") and not names_code("hf:Foo") and not names_code("gpt")
    assert not names_code(None)
    with pytest.raises(PipeplanError, match=r"^model: unknown 'gtp' \(a zoo name: "):
        reference_kind("gtp")
    with pytest.raises(PipeplanError, match=r"^--model: 'hf:GPT-2' is not hf:ClassName"):
        reference_kind("hf:GPT-2", "--model")


@pytest.mark.parametrize(
    ("text", "value"),
    [("48", 48), ("-3", -3), ("0.5", 0.5), ("1e-3", 1e-3), ("true", True), ("False", False),
     ("gelu", "gelu"), ("", ""), ("3,224", "3,224")],
)  # fmt: skip
def test_option_values_are_int_float_bool_or_text(text: str, value: Any) -> None:
    parsed = parse_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_options_parse_and_errors_name_the_flag() -> None:
    assert parse_options(["n_layer=48", "dropout=0.0", "bias = false"]) == {
        "n_layer": 48, "dropout": 0.0, "bias": False,
    }  # fmt: skip
    with pytest.raises(PipeplanError, match=r"^-M: expected key=value .*got 'n_layer'$"):
        parse_options(["n_layer"])
    with pytest.raises(PipeplanError, match=r"^model_options: .*got '2x=1'$"):
        parse_options(["2x=1"], "model_options")


def test_input_shapes_parse_and_errors_name_the_flag() -> None:
    assert parse_shape("3,224,224") == (3, 224, 224)
    assert parse_shape("16") == (16,)
    for bad in ("", "3,,4", "3,0", "a,b"):
        with pytest.raises(PipeplanError, match=rf"^--input-shape: .*got {bad!r}$"):
            parse_shape(bad)


def test_zoo_names_build_as_before_with_options() -> None:
    model, x = ModelSource(
        "gpt", 8, seed=1, options={"n_layer": 1, "d_model": 16, "n_head": 2}
    ).build()
    again, y = zoo.build("gpt", 8, seed=1, n_layer=1, d_model=16, n_head=2)
    assert torch.equal(x, y)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_factory_with_options_and_an_input_shape() -> None:
    source = ModelSource(MLP, seed=2, options={"depth": 3, "classes": 5}, input_shape=(8,))
    model, x = source.build()
    assert x.shape == (1, 8) and x.dtype == torch.float32
    assert model(x).shape == (1, 5) and len(model) == 5
    again, y = pickle.loads(pickle.dumps(source)).build()  # what a worker receives
    assert torch.equal(x, y)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q)
    other, _ = ModelSource(MLP, seed=3, options={"depth": 3}, input_shape=(8,)).build()
    assert not torch.equal(next(model.parameters()), next(other.parameters()))


def test_int64_inputs_are_token_id_zero_and_examples_come_from_a_function() -> None:
    tokens = "tests.models.factories:token_model"
    model, x = build_model(tokens, input_shape=(6,), input_dtype="int64")
    assert x.dtype == torch.int64 and x.shape == (1, 6) and not x.any()
    assert model(x).shape == (1, 6, 16)
    state = torch.random.get_rng_state()
    _, a = build_model(MLP, seed=5, example="tests.models.factories:mlp_example")
    _, b = build_model(MLP, seed=5, example="tests.models.factories:mlp_example")
    assert torch.equal(a, b) and a.shape == (1, 8)  # seeded, global RNG untouched
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize(
    ("ref", "kwargs", "match"),
    [
        (MLP, {}, r"^input_shape: model 'tests.models.factories:mlp' needs its input's shape"),
        (MLP, {"input_size": 8, "input_shape": (8,)}, r"^input_size: 8 does not apply to"),
        (MLP, {"input_shape": (8,), "input_dtype": "float16"},
         r"^input_dtype: one of float32, int64, got 'float16'$"),
        (MLP, {"input_shape": (8,), "example": "tests.models.factories:mlp_example"},
         r"^example: give either an example function or input_shape"),
        (MLP, {"example": "mlp_example"}, r"^example: 'mlp_example' is not of the form"),
        ("gpt", {"input_shape": (8,)}, r"^input_shape: \(8,\) only applies to a package"),
        ("hf:GPT2LMHeadModel", {"example": "a.b:c"}, r"^example: 'a.b:c' only applies to"),
        ("tests.models.no_such:mlp", {"input_shape": (8,)},
         r"^model: cannot import module 'tests.models.no_such'"),
        ("tests.models.factories:nope", {"input_shape": (8,)},
         r"^model: module 'tests.models.factories' has no attribute 'nope'"),
        ("tests.models.factories:not_a_module", {"input_shape": (8,)},
         r"^model: 'tests.models.factories:not_a_module' returned a int, not an nn.Module$"),
        (MLP, {"input_shape": (8,), "options": {"width": 8, "colour": 1}},
         r"^model_options: 'tests.models.factories:mlp' does not take"),
        (MLP, {"example": "tests.models.factories:two_examples"},
         r"^example: 'tests.models.factories:two_examples' must return a batch-1 tensor, "
         r"got \(2, 8\)$"),
    ],
)  # fmt: skip
def test_bad_references_name_the_field(ref: str, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PipeplanError, match=match):
        build_model(ref, **kwargs)


def test_check_input_names_the_flags_it_is_given() -> None:
    flags = {"input_shape": "--input-shape", "model": "--model"}
    with pytest.raises(PipeplanError, match=r"^--input-shape: model 'a.b:c' needs"):
        check_input("a.b:c", None, None, None, None, flags)
    assert check_input("a.b:c", None, (3,), "int64", None, flags) == "code"  # nothing imported


def test_a_module_torch_fx_cannot_trace_is_exported_and_cut() -> None:
    source = ModelSource("tests.models.factories:ShapeBranch", seed=1, input_shape=(8,))
    model, x = source.build()
    n = count_layers(model, x)
    assert len(profile_model(model, x, "branch", device_type=None)) == n == 4  # fc1 relu mul fc2
    with pytest.raises(PipeplanError, match=r"no example input to export it with"):
        count_layers(model)
    cut = partition(model, x, (0, 2, n))
    env: dict[str, torch.Tensor] = {cut.model_inputs[0]: torch.randn(3, 8)}
    with torch.no_grad():
        for st in cut.stages:
            args = [env[a] if a in env else fetch_attr(model, st.attrs[a]) for a in st.args]
            env.update(zip(st.results, st.module(*args), strict=True))
        assert torch.allclose(env[cut.model_output], model(env[cut.model_inputs[0]]))
    batches = [(torch.randn(4, 8), torch.randint(4, (4,)))]
    assert train_single_process(source, batches, OptimizerConfig()).losses[0] > 0


def test_a_module_neither_tracer_takes_is_refused_in_one_line() -> None:
    model, x = build_model("tests.models.factories:ValueBranch", input_shape=(8,))
    with pytest.raises(PipeplanError) as info:
        trace(model, x)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model ValueBranch: torch.export cannot trace it (")
    assert "at forward: 'if y.sum() > 0:'" in message


def test_hf_without_transformers_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if absent
    with pytest.raises(PipeplanError) as info:
        build_model("hf:GPT2LMHeadModel", 8)
    assert str(info.value) == (
        "model: hf:GPT2LMHeadModel needs Hugging Face transformers: pip install 'pipeplan[hf]'"
    )
