"""Op kind and forward FLOPs of a PipeDream layer, read off its module repr.

PipeDream's ``graph.txt`` names each layer by the repr of its module (``Conv2d(3, 64,
kernel_size=(11, 11), stride=(4, 4), padding=(2, 2))``) and gives its output and parameter
sizes in bytes, but no FLOPs: :func:`op_kind` maps the class name to a pipeplan op and
:func:`layer_flops` derives FLOPs per sample from the repr's arguments and the output size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pipeplan.core.errors import FormatError

BYTES_PER_FLOAT = 4


def op_kind(desc: str) -> str:
    """The pipeplan op of a module repr (``Conv2d(...)`` -> ``conv``); ``other`` if unknown."""
    cls = _class_name(desc)
    low = cls.lower()
    if low.startswith("conv"):
        return "conv"
    if "pool" in low:
        return "pool"
    if low in ("linear", "bilinear", "lazylinear"):
        return "fc"
    if "norm" in low:
        return "norm"
    if "dropout" in low:
        return "dropout"
    if low in ("view", "flatten", "unflatten", "size", "reshape", "squeeze", "unsqueeze"):
        return "flatten"
    if low in ("add", "__add__", "__iadd__", "iadd"):
        return "add"
    if low in ("concat", "cat", "__cat__", "concatenate"):
        return "concat"
    if "pad" in low:
        return "pad"
    if low.startswith("embedding"):
        return "embedding"
    if low == "multiheadattention" or low.endswith("attention"):
        return "attention"
    if re.sub(r"\d+d$", "", low) in _ACTIVATIONS:
        return "relu"
    return "other"


_ACTIVATIONS = frozenset(
    {
        "relu",
        "relu6",
        "leakyrelu",
        "prelu",
        "rrelu",
        "elu",
        "celu",
        "selu",
        "gelu",
        "silu",
        "swish",
        "mish",
        "sigmoid",
        "hardsigmoid",
        "logsigmoid",
        "tanh",
        "hardtanh",
        "tanhshrink",
        "softplus",
        "softsign",
        "softmax",
        "logsoftmax",
        "softmin",
        "hardswish",
        "threshold",
        "glu",
    }
)


def layer_flops(desc: str, op: str, out_bytes: float, params_bytes: float) -> float:
    """Forward FLOPs per sample, from the repr and ``out_bytes`` (first output, per sample).

    Multiply-adds count 2 and bias is ignored, as ``torch.utils.flop_counter`` counts them.
    ``conv``: 2 * in/groups * kernel * output elements (divided by the stride for transposed
    convolutions); ``fc``: 2 * in * out * rows (rows = output elements / out, the tokens of a
    sequence); ``pool``: kernel * output elements; other element-wise ops: output elements;
    ``flatten``: 0. Recurrent and composite modules with parameters (``other``): 2 * parameter
    elements * rows, rows from the output width of the last LSTM/GRU/RNN/Linear in the repr;
    without parameters: 0. Unparseable conv/linear reprs fall back to 2 * parameter elements *
    output positions.
    """
    out = out_bytes / BYTES_PER_FLOAT
    weights = params_bytes / BYTES_PER_FLOAT
    args = _arguments(desc)
    if op == "conv":
        return _conv_flops(_class_name(desc), args, out, weights)
    if op == "fc":
        return _fc_flops(args, out, weights)
    if op == "pool":
        kernel = args.keywords.get("kernel_size", args.positional[0] if args.positional else "")
        if not kernel or "adaptive" in desc.lower():
            return out
        return math.prod(_ints(kernel, _spatial_dims(_class_name(desc)))) * out
    if op == "flatten":
        return 0.0
    if op in ("other", "attention"):
        return 2.0 * weights * _rows(desc, out) if weights > 0 else 0.0
    return out


@dataclass(frozen=True)
class _Args:
    positional: list[str]
    keywords: dict[str, str]


def _class_name(desc: str) -> str:
    return desc.split("(", 1)[0].strip()


def _arguments(desc: str) -> _Args:
    """Top-level arguments of ``Name(a, b, key=(1, 2))``; nested reprs are left alone."""
    start, end = desc.find("("), desc.rfind(")")
    if start < 0 or end <= start:
        return _Args([], {})
    parts: list[str] = []
    depth, current = 0, ""
    for ch in desc[start + 1 : end]:
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        depth += (ch in "([{") - (ch in ")]}")
        current += ch
    parts.append(current.strip())
    args = _Args([], {})
    for part in filter(None, parts):
        key, eq, value = part.partition("=")
        if eq and re.fullmatch(r"\w+", key.strip()):
            args.keywords[key.strip()] = value.strip()
        else:
            args.positional.append(part)
    return args


def _int(args: _Args, position: int, key: str) -> int:
    raw = args.keywords.get(
        key, args.positional[position] if position < len(args.positional) else ""
    )
    try:
        return int(raw)
    except ValueError:
        raise FormatError(f"cannot read {key} from module arguments {raw!r}") from None


def _ints(raw: str, dims: int) -> tuple[int, ...]:
    values = tuple(int(v) for v in re.findall(r"-?\d+", raw))
    return values * dims if len(values) == 1 else values


def _spatial_dims(cls: str) -> int:
    m = re.search(r"(\d)d$", cls)
    return int(m[1]) if m else 2


def _conv_flops(cls: str, args: _Args, out: float, weights: float) -> float:
    dims = _spatial_dims(cls)
    try:
        c_in = _int(args, 0, "in_channels")
        kernel = math.prod(_ints(args.keywords.get("kernel_size") or args.positional[2], dims))
        groups = int(args.keywords.get("groups", "1"))
    except (FormatError, IndexError, ValueError):
        return 2.0 * weights * _positions(args, out)
    macs = c_in // max(1, groups) * kernel * out
    if "transpose" in cls.lower():  # each input position feeds kernel outputs
        macs /= math.prod(_ints(args.keywords.get("stride", "1"), dims))
    return 2.0 * macs


def _fc_flops(args: _Args, out: float, weights: float) -> float:
    try:
        fan_in, fan_out = _int(args, 0, "in_features"), _int(args, 1, "out_features")
    except FormatError:
        return 2.0 * weights
    rows = max(1.0, out / fan_out) if fan_out > 0 else 1.0
    return 2.0 * fan_in * fan_out * rows


def _positions(args: _Args, out: float) -> float:
    """Output positions (H x W) = output elements / output channels, or 1 if unknown."""
    try:
        return max(1.0, out / _int(args, 1, "out_channels"))
    except (FormatError, ZeroDivisionError):
        return 1.0


_WIDTH = re.compile(r"\b(?P<kind>LSTM|GRU|RNN|Linear)\((?P<args>[^()]*)\)")


def _rows(desc: str, out: float) -> float:
    """Output rows (e.g. tokens) per sample: output elements / width of the last inner module."""
    width = 0
    for m in _WIDTH.finditer(desc):
        args = _arguments(f"{m['kind']}({m['args']})")
        try:
            if m["kind"] == "Linear":
                width = _int(args, 1, "out_features")
            else:
                both = args.keywords.get("bidirectional", "False") == "True"
                width = _int(args, 1, "hidden_size") * (2 if both else 1)
        except FormatError:
            continue
    return max(1.0, out / width) if width > 0 else 1.0
