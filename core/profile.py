"""Per-layer model profiles: the "parameter library" every planner reads.

A :class:`ModelProfile` lists layers in a topological order (index = position). Sizes are per
sample and in bytes/FLOPs; timings are per device type, seconds per sample plus an optional
fixed cost per call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pipeplan.core import _io
from pipeplan.core.errors import FormatError
from pipeplan.core.limits import MAX_LAYERS, check_limit

OPS: tuple[str, ...] = (
    "conv",
    "relu",
    "pool",
    "fc",
    "pad",
    "norm",
    "embedding",
    "attention",
    "dropout",
    "add",
    "concat",
    "flatten",
    "other",
)


@dataclass(frozen=True)
class LayerTiming:
    """Measured cost of one layer on one device type: ``fixed + n * per_sample`` seconds."""

    fwd_s: float
    bwd_s: float
    fwd_fixed_s: float = 0.0
    bwd_fixed_s: float = 0.0

    def forward(self, n: float) -> float:
        return self.fwd_fixed_s + n * self.fwd_s

    def backward(self, n: float) -> float:
        return self.bwd_fixed_s + n * self.bwd_s

    def to_dict(self) -> dict[str, float]:
        return {
            "fwd_s": self.fwd_s,
            "bwd_s": self.bwd_s,
            "fwd_fixed_s": self.fwd_fixed_s,
            "bwd_fixed_s": self.bwd_fixed_s,
        }

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> LayerTiming:
        return cls(
            fwd_s=_io.number(doc, "fwd_s", where),
            bwd_s=_io.number(doc, "bwd_s", where),
            fwd_fixed_s=_io.number(doc, "fwd_fixed_s", where, 0.0),
            bwd_fixed_s=_io.number(doc, "bwd_fixed_s", where, 0.0),
        )


@dataclass(frozen=True)
class LayerProfile:
    """One layer: op kind, sizes per sample, successors (indices) and timings per device type."""

    name: str
    op: str
    params_bytes: int
    flops: float
    activation_bytes: int
    successors: tuple[int, ...] = ()
    timings: Mapping[str, LayerTiming] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"layer {self.name!r}"
        if self.op not in OPS:
            raise FormatError(f"{where}.op: unknown op {self.op!r} (one of {', '.join(OPS)})")
        for key in ("params_bytes", "flops", "activation_bytes"):
            value = getattr(self, key)
            if value < 0:
                raise FormatError(f"{where}.{key}: must be >= 0, got {value!r}")
        object.__setattr__(self, "successors", tuple(self.successors))
        object.__setattr__(self, "timings", _io.FrozenMap(dict(self.timings)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "params_bytes": self.params_bytes,
            "flops": self.flops,
            "activation_bytes": self.activation_bytes,
            "successors": list(self.successors),
            "timings": {t: v.to_dict() for t, v in self.timings.items()},
        }

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> LayerProfile:
        name = _io.text(doc, "name", where)
        succ = _io.field(doc, "successors", where, [])
        if not isinstance(succ, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in succ
        ):
            raise FormatError(f"{where}.successors: expected a list of integers, got {succ!r}")
        timings = _io.field(doc, "timings", where, {})
        if not isinstance(timings, Mapping):
            raise FormatError(f"{where}.timings: expected an object, got {timings!r}")
        op = _io.text(doc, "op", where)
        if op not in OPS:
            raise FormatError(f"{where}.op: unknown op {op!r} (one of {', '.join(OPS)})")
        return cls(
            name=name,
            op=op,
            params_bytes=int(_io.number(doc, "params_bytes", where)),
            flops=_io.number(doc, "flops", where),
            activation_bytes=int(_io.number(doc, "activation_bytes", where)),
            successors=tuple(succ),
            timings={
                str(t): LayerTiming.from_dict(v, f"{where}.timings.{t}") for t, v in timings.items()
            },
        )


@dataclass(frozen=True)
class ModelProfile:
    """A model as a topologically ordered list of layers."""

    name: str
    input_shape: tuple[int, ...]
    layers: tuple[LayerProfile, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(self.input_shape))
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise FormatError(f"profile {self.name!r}.layers: empty; a model needs >= 1 layer")
        where = f"profile {self.name!r}.layers"
        check_limit(where, len(self.layers), MAX_LAYERS, "layers", FormatError)
        if any(d <= 0 for d in self.input_shape):
            raise FormatError(
                f"profile {self.name!r}.input_shape: sizes must be > 0, "
                f"got {list(self.input_shape)}"
            )
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            for s in layer.successors:
                if not 0 <= s < n:
                    raise FormatError(
                        f"layers[{i}] ({layer.name!r}).successors: index {s} out of range [0, {n})"
                    )
        cycle = _find_cycle([layer.successors for layer in self.layers])
        if cycle:
            names = " -> ".join(f"{c} ({self.layers[c].name!r})" for c in cycle)
            raise FormatError(f"profile {self.name!r}: cycle in successors: {names}")
        for i, layer in enumerate(self.layers):
            back = [s for s in layer.successors if s <= i]
            if back:
                raise FormatError(
                    f"layers[{i}] ({layer.name!r}).successors: {back} come before it; "
                    "layers must be listed in a topological order"
                )

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def device_types(self) -> tuple[str, ...]:
        """Device types that have timings for every layer."""
        if not self.layers:
            return ()
        common = set(self.layers[0].timings)
        for layer in self.layers[1:]:
            common &= set(layer.timings)
        return tuple(sorted(common))

    @property
    def params_bytes(self) -> int:
        return sum(layer.params_bytes for layer in self.layers)

    @cached_property
    def model_key(self) -> str:
        """The model this profile measures, apart from its timings: ``NAME@SHAPE:HASH``, the
        hash (8 hex digits of a SHA-256) over the input shape and every layer's name, op,
        sizes and successors. Two profiles of one model (measured again, on another day)
        share it; a model of another width or depth under the same name does not. A
        calibration's ``model_scale`` (:mod:`core.calibration`) is filed by it."""
        structure = [
            list(self.input_shape),
            [
                [x.name, x.op, x.params_bytes, x.flops, x.activation_bytes, list(x.successors)]
                for x in self.layers
            ],
        ]
        digest = hashlib.sha256(json.dumps(structure, separators=(",", ":")).encode()).hexdigest()[
            :8
        ]
        return f"{self.name}@{'x'.join(map(str, self.input_shape))}:{digest}"

    @property
    def flops(self) -> float:
        return sum(layer.flops for layer in self.layers)

    def with_timings(self, device_type: str, timings: Sequence[LayerTiming]) -> ModelProfile:
        """A copy with ``timings[device_type]`` set for every layer."""
        if len(timings) != len(self.layers):
            raise FormatError(
                f"timings for {device_type!r}: {len(timings)} entries for {len(self)} layers"
            )
        layers = [
            dataclasses.replace(layer, timings={**layer.timings, device_type: t})
            for layer, t in zip(self.layers, timings, strict=True)
        ]
        return ModelProfile(self.name, self.input_shape, tuple(layers))

    # --- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "input_shape": list(self.input_shape),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, doc: Any) -> ModelProfile:
        name = _io.text(doc, "name", "profile")
        shape = _io.field(doc, "input_shape", "profile", [])
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise FormatError(f"profile.input_shape: expected a list of integers, got {shape!r}")
        layers = _io.field(doc, "layers", "profile")
        if not isinstance(layers, list):
            raise FormatError(f"profile.layers: expected a list, got {type(layers).__name__}")
        check_limit("profile.layers", len(layers), MAX_LAYERS, "layers", FormatError)
        return cls(
            name=name,
            input_shape=tuple(shape),
            layers=tuple(LayerProfile.from_dict(d, f"layers[{i}]") for i, d in enumerate(layers)),
        )

    def save(self, path: str | Path) -> None:
        _io.write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        return cls.from_dict(_io.read_document(path))

    # --- TAPP text library ------------------------------------------------------------------

    def text_library(self) -> str:
        """TAPP's parameter library: one line per layer, sizes in MB and GFLOPs."""
        head = (
            f"{'index':>5}  {'name':<32} {'op':<10} {'params_MB':>10} {'GFLOPs':>10} "
            f"{'act_MB':>10}  next"
        )
        lines = [f"# {self.name} input {list(self.input_shape)} (sizes per sample)", head]
        for i, layer in enumerate(self.layers):
            nxt = ",".join(str(s) for s in layer.successors) or "-"
            lines.append(
                f"{i:>5}  {layer.name[:32]:<32} {layer.op:<10} {layer.params_bytes / 1e6:>10.4f} "
                f"{layer.flops / 1e9:>10.5f} {layer.activation_bytes / 1e6:>10.4f}  {nxt}"
            )
        return "\n".join(lines) + "\n"


def _find_cycle(successors: Sequence[Sequence[int]]) -> list[int]:
    """Return one cycle as a list of nodes (first node repeated at the end), or []."""
    white, grey, black = 0, 1, 2
    colour = [white] * len(successors)
    parent: dict[int, int] = {}
    for root in range(len(successors)):
        if colour[root] != white:
            continue
        stack: list[tuple[int, int]] = [(root, 0)]
        colour[root] = grey
        while stack:
            node, k = stack[-1]
            if k < len(successors[node]):
                stack[-1] = (node, k + 1)
                nxt = successors[node][k]
                if colour[nxt] == grey:
                    cycle = [nxt]
                    cur = node
                    while cur != nxt:
                        cycle.append(cur)
                        cur = parent[cur]
                    cycle.append(nxt)
                    return list(reversed(cycle))
                if colour[nxt] == white:
                    colour[nxt] = grey
                    parent[nxt] = node
                    stack.append((nxt, 0))
            else:
                colour[node] = black
                stack.pop()
    return []
