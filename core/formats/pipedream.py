"""Import PipeDream layer profiles (``graph.txt``) as a :class:`ModelProfile`.

PipeDream's profiler (msr-fiddle/pipedream, ``profiler/*/profiles/<model>/graph.txt``) writes
one node per line, then one tab-indented edge per line::

    node2 -- Conv2d(3, 64, kernel_size=(11, 11), ...) -- forward_compute_time=22.316,
        backward_compute_time=6.405, activation_size=198246400.000, parameter_size=93184.000
    \tnode1 -- node2

(the node line is one line in the file). Times are milliseconds for one whole minibatch,
sizes are bytes for the whole minibatch (activations) or the whole model (parameters); a
multi-output module lists its activation sizes as ``[a; b; c]``, and a partitioned graph may
end a node line with ``-- stage_id=N``. Node numbers are not a topological order.

The import drops the ``Input`` nodes (data loading, not compute), orders the rest with Kahn's
algorithm (ties broken by node number), turns minibatch figures into per-sample ones and
derives FLOPs per sample from the module repr and the output size (see :func:`layer_flops`).
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.errors import FormatError
from core.profile import LayerProfile, LayerTiming, ModelProfile

BYTES_PER_FLOAT = 4

_NODE = re.compile(
    r"^(?P<id>\S+) -- (?P<desc>.+?) -- (?P<meta>forward_compute_time=.*?)"
    r"(?: -- stage_id=(?P<stage>-?\d+))?$"
)
_EDGE = re.compile(r"^(?P<src>\S+) -- (?P<dst>\S+)$")
_KEYS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_INPUT = re.compile(r"^Input\d*$")
_NUMBER_SUFFIX = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class PipeDreamNode:
    """One node line as written: minibatch milliseconds and bytes, plus where it was read."""

    id: str
    desc: str
    forward_ms: float
    backward_ms: float
    activation_sizes: tuple[float, ...]  # one entry per output, bytes per minibatch
    parameter_size: float
    line: int
    text: str

    @property
    def activation_size(self) -> float:
        return sum(self.activation_sizes)

    @property
    def is_input(self) -> bool:
        return _INPUT.match(self.desc) is not None


@dataclass(frozen=True)
class PipeDreamEdge:
    src: str
    dst: str
    line: int
    text: str


# --- public API -----------------------------------------------------------------------------


def load_pipedream(
    path: str | Path,
    batch_size: int,
    device_type: str,
    name: str | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> ModelProfile:
    """Read a PipeDream ``graph.txt`` profiled at ``batch_size`` on ``device_type``.

    The model name defaults to the file name before its first dot (``alexnet.graph.txt`` ->
    ``alexnet``), or the folder name for PipeDream's own ``<model>/graph.txt`` layout.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise FormatError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        return parse_pipedream(text, batch_size, device_type, name or _name_from(p), input_shape)
    except FormatError as e:
        raise FormatError(f"{p}: {e}") from None


def parse_pipedream(
    text: str,
    batch_size: int,
    device_type: str,
    name: str | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> ModelProfile:
    """Parse the text of a PipeDream ``graph.txt``; see the module docstring for the format."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise FormatError(f"batch_size: must be an integer > 0, got {batch_size!r}")
    if not isinstance(device_type, str) or not device_type:
        raise FormatError(f"device_type: expected a non-empty string, got {device_type!r}")
    nodes, edges = read_graph(text)
    inputs = [n for n in nodes.values() if n.is_input]
    layers = [n for n in nodes.values() if not n.is_input]
    if not layers:
        raise FormatError(f"no layers: the graph has only Input nodes ({_ids(inputs)})")
    kept = [e for e in edges if not (nodes[e.src].is_input or nodes[e.dst].is_input)]
    order = topological_order(layers, kept)
    index = {n.id: i for i, n in enumerate(order)}
    successors: dict[str, set[int]] = {n.id: set() for n in order}
    for e in kept:
        successors[e.src].add(index[e.dst])
    profile_layers = tuple(
        _layer(n, tuple(sorted(successors[n.id])), batch_size, device_type) for n in order
    )
    shape = tuple(input_shape) if input_shape is not None else _input_shape(inputs, batch_size)
    return ModelProfile(name or "pipedream", shape, profile_layers)


def read_graph(text: str) -> tuple[dict[str, PipeDreamNode], list[PipeDreamEdge]]:
    """Node lines (unindented) and edge lines (indented), checked for duplicates and unknowns."""
    nodes: dict[str, PipeDreamNode] = {}
    edges: list[PipeDreamEdge] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        if raw[0].isspace():
            edges.append(_parse_edge(line, number))
            continue
        node = _parse_node(line, number)
        if node.id in nodes:
            first = nodes[node.id]
            raise FormatError(
                f"line {number}: node {node.id!r} defined twice (first on line "
                f"{first.line}): {line!r}"
            )
        nodes[node.id] = node
    if not nodes:
        raise FormatError(
            "empty profile: no node lines (expected 'nodeN -- <module> -- "
            "forward_compute_time=..., ...')"
        )
    for e in edges:
        unknown = [x for x in (e.src, e.dst) if x not in nodes]
        if unknown:
            raise FormatError(f"line {e.line}: edge to unknown node {unknown[0]!r}: {e.text!r}")
    return nodes, edges


def topological_order(
    nodes: Sequence[PipeDreamNode], edges: Sequence[PipeDreamEdge]
) -> list[PipeDreamNode]:
    """Kahn's algorithm; among ready nodes the lowest node number (then line) goes first."""
    by_id = {n.id: n for n in nodes}
    succ: dict[str, set[str]] = {n.id: set() for n in nodes}
    for e in edges:
        succ[e.src].add(e.dst)
    indegree = {n.id: 0 for n in nodes}
    for targets in succ.values():
        for t in targets:
            indegree[t] += 1
    ready = [_tie_break(n) for n in nodes if indegree[n.id] == 0]
    heapq.heapify(ready)
    order: list[PipeDreamNode] = []
    while ready:
        node = by_id[heapq.heappop(ready)[2]]
        order.append(node)
        for t in succ[node.id]:
            indegree[t] -= 1
            if indegree[t] == 0:
                heapq.heappush(ready, _tie_break(by_id[t]))
    if len(order) < len(nodes):
        left = {i for i, d in indegree.items() if d > 0}
        cycle = _cycle_in(left, succ)
        where = " -> ".join(f"{c} (line {by_id[c].line})" for c in cycle)
        raise FormatError(f"cycle in the graph: {where}")
    return order


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


# --- node and edge lines --------------------------------------------------------------------


def _parse_node(line: str, number: int) -> PipeDreamNode:
    m = _NODE.match(line)
    if not m:
        raise FormatError(
            f"line {number}: malformed node line (expected 'ID -- MODULE -- "
            f"forward_compute_time=..., backward_compute_time=..., activation_size=..., "
            f"parameter_size=...'; edge lines are indented): {line!r}"
        )
    values: dict[str, str] = {}
    for part in m["meta"].split(", "):
        key, eq, value = part.partition("=")
        if not eq or not value:
            raise FormatError(f"line {number}: malformed field {part!r} in {line!r}")
        values[key.strip()] = value.strip()
    missing = [k for k in _KEYS if k not in values]
    if missing:
        raise FormatError(f"line {number}: missing {', '.join(missing)} in {line!r}")
    fwd, bwd, params = (
        _number(values[k], k, number, line)
        for k in ("forward_compute_time", "backward_compute_time", "parameter_size")
    )
    act = values["activation_size"]
    items = act[1:-1].split(";") if act.startswith("[") and act.endswith("]") else [act]
    sizes = tuple(_number(x.strip(), "activation_size", number, line) for x in items)
    return PipeDreamNode(m["id"], m["desc"].strip(), fwd, bwd, sizes, params, number, line)


def _parse_edge(line: str, number: int) -> PipeDreamEdge:
    m = _EDGE.match(line)
    if not m:
        raise FormatError(
            f"line {number}: malformed edge line (expected 'nodeA -- nodeB'): {line!r}"
        )
    return PipeDreamEdge(m["src"], m["dst"], number, line)


def _number(value: str, key: str, number: int, line: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise FormatError(f"line {number}: {key}={value!r} is not a number: {line!r}") from None
    if not math.isfinite(x) or x < 0:
        raise FormatError(
            f"line {number}: {key} must be a finite number >= 0, got {value!r}: {line!r}"
        )
    return x


# --- conversion to the profile --------------------------------------------------------------


def _layer(
    node: PipeDreamNode, successors: tuple[int, ...], batch: int, device_type: str
) -> LayerProfile:
    op = op_kind(node.desc)
    timing = LayerTiming(
        fwd_s=node.forward_ms / 1000 / batch, bwd_s=node.backward_ms / 1000 / batch
    )
    first_out = node.activation_sizes[0] / batch if node.activation_sizes else 0.0
    return LayerProfile(
        name=node.id,
        op=op,
        params_bytes=round(node.parameter_size),
        flops=layer_flops(node.desc, op, first_out, node.parameter_size),
        activation_bytes=round(node.activation_size / batch),
        successors=successors,
        timings={device_type: timing},
    )


def _input_shape(inputs: Sequence[PipeDreamNode], batch: int) -> tuple[int, ...]:
    """3xSxS for a square RGB image, else the floats per sample (1 when nothing is known)."""
    floats = round(sum(n.activation_size for n in inputs) / batch / BYTES_PER_FLOAT)
    if len(inputs) == 1:
        side = math.isqrt(floats // 3)
        if side >= 8 and 3 * side * side == floats:
            return (3, side, side)
    return (max(1, floats),)


def _name_from(path: Path) -> str:
    stem = path.name.split(".", 1)[0]
    return path.parent.name if stem == "graph" and path.parent.name else stem


def _tie_break(node: PipeDreamNode) -> tuple[float, int, str]:
    m = _NUMBER_SUFFIX.search(node.id)
    return (int(m[1]) if m else math.inf, node.line, node.id)


def _cycle_in(left: set[str], succ: dict[str, set[str]]) -> list[str]:
    """A cycle among the nodes Kahn's algorithm could not order, in edge direction.

    Each such node has a predecessor that is also left, so walking predecessors must repeat.
    """
    pred: dict[str, list[str]] = {n: [] for n in left}
    for src in sorted(left):
        for dst in succ[src]:
            if dst in left:
                pred[dst].append(src)
    node = min(left)
    path: list[str] = []
    seen: dict[str, int] = {}
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = min(pred[node])
    cycle = path[seen[node] :] + [node]
    return cycle[::-1]


def _ids(nodes: Sequence[PipeDreamNode]) -> str:
    return ", ".join(n.id for n in nodes)


# --- module reprs ---------------------------------------------------------------------------


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
