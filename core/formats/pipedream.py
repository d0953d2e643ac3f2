"""Import PipeDream layer profiles (``graph.txt``) as a :class:`ModelProfile`.

PipeDream's profiler (msr-fiddle/pipedream) writes one line per node -- an id, the module's
repr, ``forward_compute_time``, ``backward_compute_time``, ``activation_size`` and
``parameter_size`` -- then one indented line per edge (the format:
:mod:`core.formats.pipedream_graph`). Times are milliseconds for one whole minibatch, sizes
are bytes for the whole minibatch (activations) or the whole model (parameters).

The import drops the ``Input`` nodes (data loading, not compute), orders the rest with Kahn's
algorithm (ties broken by node number: :func:`~core.formats.pipedream_graph.topological_order`),
turns minibatch figures into per-sample ones and derives each layer's op and FLOPs per sample
from its module repr and output size (:mod:`core.formats.pipedream_ops`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from pipeplan.core.errors import FormatError
from pipeplan.core.formats.pipedream_graph import PipeDreamNode, read_graph, topological_order
from pipeplan.core.formats.pipedream_ops import BYTES_PER_FLOAT, layer_flops, op_kind
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile


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
    """Parse the text of a PipeDream ``graph.txt`` (format: :mod:`core.formats.pipedream_graph`)."""
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


def _ids(nodes: Sequence[PipeDreamNode]) -> str:
    return ", ".join(n.id for n in nodes)
