"""References to user code: recognised without importing, loaded with errors naming the field."""

from __future__ import annotations

import pytest

from pipeplan.core.code import is_code_ref, load, load_callable
from pipeplan.core.errors import PipeplanError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mypkg.models:build", True),
        ("m:f", True),
        ("a.b:C.make", True),
        ("alexnet", False),
        ("hf:GPT2LMHeadModel", True),  # the form; hf: is told apart by its prefix first
        ("imagefolder:data/train", False),
        ("a.b:", False),
        (":f", False),
        ("a b:c", False),
    ],
)
def test_code_refs_are_told_by_their_form(text: str, expected: bool) -> None:
    assert is_code_ref(text) is expected


def test_load_follows_dotted_attributes() -> None:
    assert load("os.path:join", "model") is __import__("os").path.join
    assert load("collections:OrderedDict.fromkeys", "loss").__name__ == "fromkeys"


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("no_such_module_xyz:f", "model: cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_fn", "model: module 'os.path' has no attribute 'no_such_fn'"),
        ("not a ref", "model: 'not a ref' is not of the form package.module:attribute"),
    ],
)
def test_load_errors_name_the_field_and_the_reference(ref: str, message: str) -> None:
    with pytest.raises(PipeplanError, match=message):
        load(ref, "model")


def test_load_callable_refuses_a_value() -> None:
    with pytest.raises(PipeplanError, match="data: 'os:sep' is a str, not a callable"):
        load_callable("os:sep", "data")
