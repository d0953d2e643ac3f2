"""What ``--loss`` names, parsed without torch: :class:`LossSpec`.

:mod:`executor.loss` turns a spec into the loss a worker computes
(:func:`executor.loss.load_loss`); this module only reads the text, so the API process
checks a train job's ``loss`` without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeplan.core.code import is_code_ref
from pipeplan.core.errors import PipeplanError

CROSS_ENTROPY = "cross-entropy"


@dataclass(frozen=True)
class LossSpec:
    """Which loss to train with, as ``--loss`` names it: ``cross-entropy`` or a reference
    ``package.module:callable`` to a :data:`LossFn` (imported only by :func:`load_loss`)."""

    kind: Literal["cross-entropy", "code"] = "cross-entropy"
    """Cross-entropy over every prediction (next-token for LMs), or a user's function."""
    ref: str | None = None
    """The function's ``package.module:callable`` reference, for ``kind="code"``."""

    def __post_init__(self) -> None:
        if self.kind not in (CROSS_ENTROPY, "code"):
            raise PipeplanError(f"loss: kind is {CROSS_ENTROPY!r} or 'code', got {self.kind!r}")
        if (self.kind == "code") != (self.ref is not None):
            raise PipeplanError(f"loss: a reference goes with kind 'code' only, got {self!r}")
        if self.ref is not None and not is_code_ref(self.ref):
            raise PipeplanError(f"loss: {self.ref!r} is not a package.module:callable")

    @classmethod
    def parse(cls, text: str) -> LossSpec:
        """The spec ``text`` names; refused, naming ``loss`` and the text, when it names none."""
        if text == CROSS_ENTROPY:
            return cls()
        if is_code_ref(text):
            return cls("code", text)
        raise PipeplanError(
            f"loss: {text!r} is neither {CROSS_ENTROPY!r} nor a package.module:callable"
        )

    def __str__(self) -> str:
        return self.ref if self.kind == "code" and self.ref else CROSS_ENTROPY

    @property
    def class_targets(self) -> bool:
        """Whether targets are class indices (cross-entropy); a user's loss takes any."""
        return self.kind == "cross-entropy"
