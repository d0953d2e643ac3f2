"""Small helpers to read fields from untrusted dicts with errors that name them."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pipeplan.core.errors import FormatError

Doc = Mapping[str, Any]


def field(doc: Doc, key: str, where: str, default: Any = ...) -> Any:
    if not isinstance(doc, Mapping):
        raise FormatError(f"{where}: expected an object, got {type(doc).__name__} {doc!r}")
    if key not in doc:
        if default is ...:
            raise FormatError(f"{where}.{key}: missing")
        return default
    return doc[key]


def known_keys(doc: Doc, where: str, known: frozenset[str]) -> None:
    """Refuse a key of the object ``doc`` that is not in ``known``: the first one, sorted, with
    the known ones."""
    unknown = sorted(str(k) for k in doc if k not in known)
    if unknown:
        raise FormatError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )


def number(doc: Doc, key: str, where: str, default: Any = ..., minimum: float = 0.0) -> float:
    value = _yaml11_float(field(doc, key, where, default))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FormatError(f"{where}.{key}: expected a number, got {value!r}")
    if value != value or value < minimum:  # NaN or below the minimum
        raise FormatError(f"{where}.{key}: must be >= {minimum:g}, got {value!r}")
    return float(value)


def _yaml11_float(value: Any) -> Any:
    """PyYAML follows YAML 1.1, which reads ``2.0e11`` (no exponent sign) as a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def integer(doc: Doc, key: str, where: str, default: Any = ..., minimum: int = 0) -> int:
    value = field(doc, key, where, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where}.{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise FormatError(f"{where}.{key}: must be >= {minimum}, got {value!r}")
    return value


def text(doc: Doc, key: str, where: str, default: Any = ...) -> str:
    value = field(doc, key, where, default)
    if not isinstance(value, str) or not value:
        raise FormatError(f"{where}.{key}: expected a non-empty string, got {value!r}")
    return value


def read_text(path: str | Path) -> str:
    """A document's text; a :class:`FormatError` naming the file when it cannot be read."""
    try:
        return Path(path).read_text()
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror or e}") from None


def read_document(path: str | Path) -> Any:
    """Load JSON or YAML (by extension; YAML accepts JSON too)."""
    p = Path(path)
    raw = read_text(p)
    try:
        if p.suffix.lower() == ".json":
            return json.loads(raw)
        return yaml.safe_load(raw)
    except (json.JSONDecodeError, ValueError) as e:
        raise FormatError(f"{p}: not valid JSON: {e}") from None
    except yaml.YAMLError as e:
        raise FormatError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None


def write_json(path: str | Path, doc: Any) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def write_yaml(path: str | Path, doc: Any) -> None:
    Path(path).write_text(yaml.safe_dump(doc, sort_keys=False))


K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping[K, V]):
    """A read-only mapping that pickles and deep-copies (``MappingProxyType`` does neither)."""

    __slots__ = ("_data",)
    _data: dict[K, V]

    def __init__(self, data: Mapping[K, V] | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(self._data.items()))

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (self._data,))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenMap is read-only")
