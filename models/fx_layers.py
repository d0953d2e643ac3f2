"""Trace a torch model with torch.fx and fold its nodes into the layers of a profile.

The model is traced with ``torch.fx.symbolic_trace``; a model it cannot trace (control flow
on tensors, Hugging Face models) is traced with ``torch.export`` on an example input
(:mod:`models.exported`), which gives a graph of aten ops whose parameters are ``get_attr``
nodes; the ops are classified by their names alike (``aten.linear.default`` is ``linear``).
Every *compute* node (a leaf module call such as ``nn.Conv2d``, or a function/method such as
``torch.cat``, ``operator.add``, ``F.scaled_dot_product_attention``) opens one layer.
*Trivial* nodes are folded into a neighbour so the layer list stays meaningful:

- ``get_attr``, ``getattr``/``getitem``, shape queries (``size``, ``dim``, ``numel``) and
  whatever is computed from them alone (constants: ``arange(T) + 0`` of export's position
  ids, integer arithmetic on sizes), reshapes and views (``view``, ``reshape``, ``flatten``,
  ``permute``, ``transpose``, ``unsqueeze``, ``chunk``, ...), ``nn.Identity``/``nn.Flatten``
  and tensor constructors (``arange``, ``zeros``, ...);
- a trivial node that reads the output of a layer joins the *latest* such layer (a
  ``getitem`` of a split travels with the split); one that reads only the model input or
  parameters joins its *earliest* consumer (``torch.arange`` for GPT positions joins the
  position embedding);
- a reshape or view of one tensor (``view``, ``flatten``, ``permute``, ...) joins the
  earliest layer that reads it, so what crosses a cut is a layer's own batch-major output,
  never a ``(B x T, C)`` flattening or a head-major permutation of it.

So every edge of the fx graph goes from a layer to the same or a later layer, and
:func:`layer_of_nodes` gives the split that ``torch.fx.passes.split_module`` needs for any
contiguous grouping of layers. The folding is purely structural, so the executor gets the
same answer from its own trace of the same model. Sizes (:mod:`models.layer_sizes`) and
timings (:mod:`models.layer_timing`) are taken over the layers this module assigns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx, nn

from pipeplan.core.errors import PipeplanError
from pipeplan.models.exported import export_trace, model_label

Node = fx.Node
Assignment = dict[Node, int]

_ACTIVATIONS = frozenset({
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh",
    "ELU", "SELU", "CELU", "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus", "Softsign",
    "Softmax", "LogSoftmax", "Softmin", "GLU", "Threshold", "LogSigmoid", "Tanhshrink",
})  # fmt: skip
_TRIVIAL_MODULES = frozenset({"Identity", "Flatten", "Unflatten"})

_SCALAR_CALLS = frozenset({"getattr", "size", "dim", "numel", "sym_size", "sym_numel",
                           "sym_stride"})  # fmt: skip
_TRIVIAL_CALLS = _SCALAR_CALLS | frozenset({
    "getitem", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "contiguous",
    "permute", "transpose", "t", "movedim", "unsqueeze", "squeeze", "expand", "expand_as",
    "split", "chunk", "unbind", "narrow", "select", "type", "type_as", "to", "float", "half",
    "double", "detach", "clone", "_assert", "arange", "zeros", "ones", "full", "empty",
    "zeros_like", "ones_like", "full_like", "empty_like",
    # aten names (torch.export graphs)
    "alias", "slice", "_unsafe_view", "as_strided", "split_with_sizes", "_to_copy",
    "lift_fresh_copy", "new_ones", "new_zeros", "new_empty", "new_full", "scalar_tensor",
    "_assert_tensor_metadata", "_assert_scalar",
})  # fmt: skip


def _ops(op: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, op)


_CALL_OPS: dict[str, str] = {
    **_ops("conv", "conv1d", "conv2d", "conv3d", "convolution", "_convolution",
           "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    **_ops("relu", "relu", "relu6", "leaky_relu", "prelu", "gelu", "silu", "mish", "sigmoid",
           "tanh", "elu", "selu", "celu", "hardtanh", "hardswish", "hardsigmoid", "softplus",
           "softmax", "log_softmax", "glu", "logsigmoid", "_softmax", "_log_softmax"),
    **_ops("pool", "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d",
           "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
           "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
           "max_pool2d_with_indices", "max_pool3d_with_indices", "_adaptive_avg_pool2d"),
    **_ops("fc", "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm"),
    **_ops("pad", "pad", "constant_pad_nd"),
    **_ops("norm", "batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm",
           "local_response_norm", "normalize", "native_layer_norm", "native_batch_norm",
           "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
           "native_group_norm", "_fused_rms_norm"),
    **_ops("embedding", "embedding", "embedding_bag", "_embedding_bag"),
    **_ops("attention", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_flash_attention_for_cpu"),
    **_ops("dropout", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
           "native_dropout", "feature_dropout"),
    **_ops("add", "add", "iadd"),
    **_ops("concat", "cat", "concat", "concatenate", "stack"),
}  # fmt: skip


def trace(model: nn.Module, example: torch.Tensor | None = None) -> fx.GraphModule:
    """``torch.fx.symbolic_trace``, else ``torch.export`` on ``example`` (a batch-1 input).

    Without an example, a model symbolic tracing fails on is refused, saying what failed.
    """
    try:
        return fx.symbolic_trace(model)
    except Exception as e:
        if example is None:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise PipeplanError(
                f"model {model_label(model)}: not traceable by torch.fx "
                f"({type(e).__name__}: {first}) and no example input to export it with"
            ) from e
    return export_trace(model, example)


def call_name(node: Node) -> str:
    """Name of what a call node calls, in-place suffix removed (``relu_`` -> ``relu``);
    an aten op by its name without namespace and overload (``aten.add_.Tensor`` -> ``add``)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = str(target._opname)
    elif isinstance(target, str):
        name = target
    else:
        name = getattr(target, "__name__", str(target))
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


def _module_op(module: nn.Module) -> str | None:
    """Op kind of a leaf module by its class (or a base class); None for a trivial module."""
    for cls in type(module).__mro__:
        n = cls.__name__
        if n in _TRIVIAL_MODULES:
            return None
        if n in _ACTIVATIONS:
            return "relu"
        for op, hit in (
            ("attention", n == "MultiheadAttention"),
            ("embedding", "Embedding" in n),
            ("conv", n.startswith("Conv") or n == "_ConvNd"),
            ("pool", "Pool" in n),
            ("norm", "Norm" in n),
            ("pad", "Pad" in n),
            ("dropout", "Dropout" in n),
            ("fc", n in ("Linear", "Bilinear", "LazyLinear")),
        ):
            if hit:
                return op
    return "other"


def node_op(gm: fx.GraphModule, node: Node, scalars: set[Node]) -> str | None:
    """Op kind of a node, or None when it is trivial and gets folded."""
    if node.op in ("placeholder", "output", "get_attr"):
        return None
    if node.op == "call_module":
        return _module_op(gm.get_submodule(str(node.target)))
    name = call_name(node)
    if name in _TRIVIAL_CALLS or node in scalars:
        return None
    return _CALL_OPS.get(name, "other")


def _is_scalar(node: Node, scalars: set[Node]) -> bool:
    """Shape queries and what is computed from them alone, constants included: integer
    arithmetic on sizes (``x.size(1) * 2``), ``arange(T) + 0``, a tensor constructor."""
    if node.op not in ("call_function", "call_method"):
        return False
    if call_name(node) in _SCALAR_CALLS:
        return True
    return all(a in scalars for a in node.all_input_nodes)


def assign_layers(gm: fx.GraphModule) -> tuple[Assignment, list[Node]]:
    """Layer index of every node but placeholders and the output; the anchor of each layer."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    scalars: set[Node] = set()
    layer_of: Assignment = {}
    anchors: list[Node] = []
    for n in nodes:
        if _is_scalar(n, scalars):
            scalars.add(n)
        if node_op(gm, n, scalars) is not None:
            layer_of[n] = len(anchors)
            anchors.append(n)
            continue
        known = [layer_of[a] for a in n.all_input_nodes if a in layer_of]
        if known:
            layer_of[n] = max(known)
    if not anchors:
        raise PipeplanError(
            f"model {type(gm).__name__}: no compute node to profile, only {len(nodes)} "
            "trivial nodes (views, shape queries, attributes)"
        )
    for n in reversed(nodes):
        users = [layer_of[u] for u in n.users if u in layer_of]
        if n not in layer_of:
            layer_of[n] = min(users) if users else len(anchors) - 1
        elif _is_reshape(n) and users and min(users) > layer_of[n]:
            layer_of[n] = min(users)  # a reshape travels with what reads it (docstring)
    return layer_of, anchors


_RESHAPES = frozenset({
    "view", "reshape", "flatten", "unflatten", "contiguous", "permute", "transpose", "t",
    "movedim", "unsqueeze", "squeeze", "expand", "view_as", "reshape_as", "expand_as",
    "_unsafe_view", "alias",
})  # fmt: skip


def _is_reshape(node: Node) -> bool:
    """A view or reshape of one tensor. Folded into the layer of its first reader rather
    than of its producer, so a cut between the two sends the producer's own output (a
    batch-major activation) rather than a flattened ``(B x T, C)`` or permuted
    ``(3, B, H, T, D)`` view that no stage could slice by samples."""
    return node.op in ("call_function", "call_method") and call_name(node) in _RESHAPES


def layer_of_nodes(gm: fx.GraphModule) -> dict[str, int]:
    """Profile layer index of every fx node except placeholders and the output, by node name.

    ``split_module(gm, root, lambda n: stage_of[layer_of_nodes(gm)[n.name]])`` cuts the graph
    consistently with :func:`models.profiler.profile_model` (same trace, same folding).
    """
    layer_of, _ = assign_layers(gm)
    return {n.name: i for n, i in layer_of.items()}


def layer_groups(gm: fx.GraphModule, layer_of: Assignment, count: int) -> list[list[Node]]:
    groups: list[list[Node]] = [[] for _ in range(count)]
    for n in gm.graph.nodes:
        if n in layer_of:
            groups[layer_of[n]].append(n)
    return groups


def layer_nodes(gm: fx.GraphModule) -> list[list[str]]:
    """The fx node names of each profile layer, in graph order."""
    layer_of, anchors = assign_layers(gm)
    return [[n.name for n in g] for g in layer_groups(gm, layer_of, len(anchors))]


def leaving_nodes(group: Sequence[Node], layer_of: Assignment, index: int) -> list[Node]:
    """Nodes of a layer whose value another layer or the graph output reads."""
    outside = [any(layer_of.get(u, -1) != index for u in n.users) for n in group]
    return [n for n, out in zip(group, outside, strict=True) if out and n.op != "get_attr"]


def external_inputs(group: Sequence[Node], layer_of: Assignment, index: int) -> list[Node]:
    seen: dict[Node, None] = {}
    for n in group:
        for a in n.all_input_nodes:
            if layer_of.get(a, -1) != index:
                seen[a] = None
    return list(seen)
