"""References to a user's code: ``package.module:attribute``, imported only when asked.

A model factory, an example input, a data set or a loss may be named by such a reference
(CLI flags, request fields). :func:`is_code_ref` tells a reference from a plain name without
importing anything; :func:`load` imports the module and returns the attribute, with an
error that names the field and the reference when either is missing.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from pipeplan.core.errors import PipeplanError

_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_code_ref(text: str) -> bool:
    """Whether ``text`` has the form ``package.module:attribute`` (nothing is imported)."""
    return bool(_REF.match(text))


def load(ref: str, field: str) -> Any:
    """Import ``ref``'s module and return its attribute (dotted attributes are followed).

    ``field`` names the flag or request field the reference came from, for the error.
    """
    if not is_code_ref(ref):
        raise PipeplanError(f"{field}: {ref!r} is not of the form package.module:attribute")
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise PipeplanError(
            f"{field}: cannot import module {module_name!r} of {ref!r} ({e})"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PipeplanError(
                f"{field}: module {module_name!r} has no attribute {attr!r} (from {ref!r})"
            ) from None
    return obj


def load_callable(ref: str, field: str) -> Any:
    """:func:`load`, refusing an attribute that cannot be called."""
    obj = load(ref, field)
    if not callable(obj):
        raise PipeplanError(f"{field}: {ref!r} is a {type(obj).__name__}, not a callable")
    return obj
