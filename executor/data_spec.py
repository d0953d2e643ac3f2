"""What ``--data`` names, parsed without torch: :class:`DataSpec`.

The forms (``synthetic``, ``digits``, ``imagefolder:PATH``, ``tokens:PATH``,
``package.module:callable``) and what each reads are :mod:`executor.data`'s, which opens
the stream; this module only reads the text (nothing is imported, no file is read), so the
API process checks a train job's ``data`` without loading torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, cast

from pipeplan.core.code import is_code_ref
from pipeplan.core.errors import PipeplanError

DataKind = Literal["synthetic", "digits", "imagefolder", "tokens", "code"]
_NAMED = ("synthetic", "digits")
_WITH_PATH = ("imagefolder", "tokens")
_FORMS = "synthetic, digits, imagefolder:PATH, tokens:PATH or package.module:callable"


@dataclass(frozen=True)
class DataSpec:
    """Where a run's batches come from, as ``--data`` names it (see :mod:`executor.data`)."""

    kind: DataKind = "synthetic"
    """Which source."""
    path: str | None = None
    """The folder (``imagefolder``) or file (``tokens``), absolute so every worker reads
    the same one."""
    ref: str | None = None
    """The ``package.module:callable`` of ``code`` (imported when a stream opens)."""

    def __post_init__(self) -> None:
        if self.kind not in (*_NAMED, *_WITH_PATH, "code"):
            raise PipeplanError(f"data: kind is one of {_FORMS}, got {self.kind!r}")
        takes = "a path" if self.kind in _WITH_PATH else "a ref" if self.kind == "code" else None
        if (takes == "a path") != bool(self.path) or (takes == "a ref") != bool(self.ref):
            raise PipeplanError(
                f"data: {self.kind} takes {takes or 'no path nor ref'}, got {self!r}"
            )
        if self.ref is not None and not is_code_ref(self.ref):
            raise PipeplanError(f"data: {self.ref!r} is not a package.module:callable")

    @classmethod
    def parse(cls, text: str) -> DataSpec:
        """The spec ``text`` names; a relative path is made absolute here."""
        if text in _NAMED:
            return cls(cast(DataKind, text))
        kind, colon, path = text.partition(":")
        if colon and kind in _WITH_PATH:
            if not path:
                raise PipeplanError(f"data: {text!r} names no path")
            return cls(cast(DataKind, kind), path=os.path.abspath(os.path.expanduser(path)))
        if is_code_ref(text):
            return cls("code", ref=text)
        raise PipeplanError(f"data: {text!r} is none of {_FORMS}")

    def __str__(self) -> str:
        if self.kind in _WITH_PATH:
            return f"{self.kind}:{self.path}"
        return self.ref if self.ref is not None else self.kind
