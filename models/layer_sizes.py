"""Analytic per-sample sizes of the layers of a traced model: FLOPs, parameter and
activation bytes.

Shapes are propagated with ``ShapeProp`` at batch 1, in eval mode; tensors without a batch
dimension, such as position embeddings, are counted as if per sample. The layers are those
of :mod:`models.fx_layers`.

- FLOPs: a multiply-add counts as 2 FLOPs. Exact for conv, linear, matmul and attention
  (conv and linear also add 1 FLOP per output element for the bias; attention counts its two
  matmuls over the full score matrix, causal masking not discounted, plus the four
  projections for ``nn.MultiheadAttention``). Pools count one FLOP per input element; every
  other compute node one per output element; folded nodes none.
- ``params_bytes``: parameters of the layer's module or ``get_attr`` nodes, each counted once.
- ``activation_bytes``: bytes of the layer's values read by other layers or by the output.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from pipeplan.core.profile import LayerProfile
from pipeplan.models.fx_layers import (
    Assignment,
    Node,
    assign_layers,
    call_name,
    layer_groups,
    leaving_nodes,
    node_op,
)


def _metas(node: Any) -> list[TensorMetadata]:
    """Tensor metadata ShapeProp left on a node (flattened), [] for non-tensors."""
    found: list[TensorMetadata] = []

    def visit(x: Any) -> None:
        if isinstance(x, TensorMetadata):
            found.append(x)
        elif isinstance(x, tuple | list):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    if isinstance(node, Node):
        visit(node.meta.get("tensor_meta"))
    return found


def _numel(node: Any) -> int:
    return sum(m.shape.numel() for m in _metas(node))


def _nbytes(node: Any) -> int:
    return sum(m.shape.numel() * m.dtype.itemsize for m in _metas(node))


def _shape(node: Any) -> tuple[int, ...]:
    metas = _metas(node)
    return tuple(metas[0].shape) if metas else ()


def _arg(node: Node, index: int, key: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(key)


def _module_flops(module: nn.Module, node: Node, op: str) -> float:
    out, first = _numel(node), _arg(node, 0, "input")
    if isinstance(module, nn.modules.conv._ConvNd):
        per_out = module.weight[0].numel()
        macs = _numel(first) * per_out if module.transposed else out * per_out
        return 2.0 * macs + (out if module.bias is not None else 0)
    if isinstance(module, nn.Linear):
        return 2.0 * out * module.in_features + (out if module.bias is not None else 0)
    if isinstance(module, nn.MultiheadAttention):
        return _mha_flops(module, node)
    return float(_numel(first) if op == "pool" else out)


def _mha_flops(m: nn.MultiheadAttention, node: Node) -> float:
    """Four projections and the two attention matmuls of ``nn.MultiheadAttention``."""
    q, k = _arg(node, 0, "query"), _arg(node, 1, "key")
    e, q_tokens, k_tokens = m.embed_dim, _numel(q) // m.embed_dim, _numel(k) // m.kdim
    seq_dim = 1 if (m.batch_first and len(_shape(q)) == 3) else 0
    length = _shape(q)[seq_dim]
    batch = q_tokens // max(length, 1)
    src = k_tokens // max(batch, 1)
    macs = q_tokens * e * e + k_tokens * (m.kdim + m.vdim) * e + 2 * batch * length * src * e
    return 2.0 * (macs + q_tokens * e * e)


def _call_flops(node: Node, op: str) -> float:
    name, out = call_name(node), _numel(node)
    if op == "conv":
        per_out = _shape(_arg(node, 1, "weight"))[1:]
        inner = torch.Size(per_out).numel()
        macs = _numel(_arg(node, 0, "input")) * inner if "transpose" in name else out * inner
        return 2.0 * macs + (out if _arg(node, 2, "bias") is not None else 0)
    if name == "linear":
        inner = _shape(_arg(node, 1, "weight"))[-1]
        return 2.0 * out * inner + (out if _arg(node, 2, "bias") is not None else 0)
    if name in ("matmul", "mm", "bmm"):
        return 2.0 * out * _shape(node.args[0])[-1]
    if name in ("addmm", "baddbmm", "addbmm"):
        return 2.0 * out * _shape(node.args[1])[-1] + out
    if op == "attention":
        q, v = _shape(_arg(node, 0, "query")), _shape(_arg(node, 2, "value"))
        rows, src = torch.Size(q[:-1]).numel(), v[-2]
        return 2.0 * rows * src * (q[-1] + v[-1])
    return float(_numel(node.args[0]) if op == "pool" else out)


def _layer_profile(
    gm: fx.GraphModule,
    group: Sequence[Node],
    anchor: Node,
    name: str,
    layer_of: Assignment,
    seen: set[int],
) -> LayerProfile:
    index = layer_of[anchor]
    op = node_op(gm, anchor, set()) or "other"
    if anchor.op == "call_module":
        flops = _module_flops(gm.get_submodule(str(anchor.target)), anchor, op)
    else:
        flops = _call_flops(anchor, op)
    params_bytes = 0
    for p in _params(gm, group):
        if id(p) not in seen:
            seen.add(id(p))
            params_bytes += p.numel() * p.element_size()
    leaving = leaving_nodes(group, layer_of, index)
    activation = sum(_nbytes(n) for n in leaving) if leaving else _nbytes(anchor)
    users = [u for n in group if n.op != "get_attr" for u in n.users]
    successors = sorted({layer_of[u] for u in users if layer_of.get(u, index) != index})
    return LayerProfile(name, op, params_bytes, flops, activation, tuple(successors))


def _params(gm: fx.GraphModule, group: Sequence[Node]) -> Iterator[nn.Parameter]:
    for n in group:
        if n.op == "call_module":
            yield from gm.get_submodule(str(n.target)).parameters()
        elif n.op == "get_attr":
            value = _fetch_attr(gm, str(n.target))
            if isinstance(value, nn.Parameter):
                yield value


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _layer_names(anchors: Sequence[Node]) -> list[str]:
    """Module path for module calls (``features.0``), node name otherwise; unique."""
    names: list[str] = []
    for a in anchors:
        name = str(a.target) if a.op == "call_module" else a.name
        names.append(a.name if name in names else name)
    return names


def analytic_layers(gm: fx.GraphModule) -> list[LayerProfile]:
    """Layers of a traced graph on which ``ShapeProp`` has run at batch 1 (no timings)."""
    layer_of, anchors = assign_layers(gm)
    groups = layer_groups(gm, layer_of, len(anchors))
    seen: set[int] = set()
    return [
        _layer_profile(gm, g, a, name, layer_of, seen)
        for g, a, name in zip(groups, anchors, _layer_names(anchors), strict=True)
    ]
