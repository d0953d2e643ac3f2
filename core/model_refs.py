"""The parts of a model reference that need no torch: option values, input shapes, and
whether a reference names code (:mod:`models.spec` builds the model; the CLI's client
commands and the API read flags and requests with this module alone).

A reference is a zoo name, ``package.module:factory`` (code), or ``hf:ClassName`` (a
Hugging Face ``transformers`` class: not code of the user's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeplan.core.code import is_code_ref
from pipeplan.core.errors import PipeplanError

HF_PREFIX = "hf:"


def names_code(ref: str | None) -> bool:
    """Whether a reference imports user code (``package.module:attr``); ``hf:`` does not."""
    return ref is not None and not ref.startswith(HF_PREFIX) and is_code_ref(ref)


def parse_value(text: str) -> int | float | bool | str:
    """An option's value: ``true``/``false``, an int, a float, else the text itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: Iterable[str], field: str = "-M") -> dict[str, Any]:
    """``key=value`` texts as a dict of options (values by :func:`parse_value`)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise PipeplanError(f"{field}: expected key=value with a name for key, got {pair!r}")
        options[key] = parse_value(raw.strip())
    return options


def parse_shape(text: str, field: str = "--input-shape") -> tuple[int, ...]:
    """``3,224,224`` (without the batch dimension) as a tuple of positive ints."""
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise PipeplanError(f"{field}: expected sizes >= 1 separated by commas, got {text!r}")
    return shape
