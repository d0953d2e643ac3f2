"""Profile a torch model into a :class:`ModelProfile` at the granularity of its torch.fx graph.

**Layers.** The model is traced with ``torch.fx.symbolic_trace``. Every *compute* node (a leaf
module call such as ``nn.Conv2d``, or a function/method such as ``torch.cat``, ``operator.add``,
``F.scaled_dot_product_attention``) opens one layer. *Trivial* nodes are folded into a
neighbour so the layer list stays meaningful:

- ``get_attr``, ``getattr``/``getitem``, shape queries (``size``, ``dim``, ``numel``) and
  integer arithmetic on them, reshapes and views (``view``, ``reshape``, ``flatten``,
  ``permute``, ``transpose``, ``unsqueeze``, ``chunk``, ...), ``nn.Identity``/``nn.Flatten``
  and tensor constructors (``arange``, ``zeros``, ...);
- a trivial node that reads the output of a layer joins the *latest* such layer (a view after
  a conv travels with the conv); one that reads only the model input or parameters joins its
  *earliest* consumer (``torch.arange`` for GPT positions joins the position embedding).

So every edge of the fx graph goes from a layer to the same or a later layer, and
:func:`layer_of_nodes` gives the split that ``torch.fx.passes.split_module`` needs for any
contiguous grouping of layers. The folding is purely structural, so the executor gets the
same answer from its own trace of the same model.

**Sizes, per sample** (shapes propagated with ``ShapeProp`` at batch 1, in eval mode; tensors
without a batch dimension, such as position embeddings, are counted as if per sample):

- FLOPs: a multiply-add counts as 2 FLOPs. Exact for conv, linear, matmul and attention
  (conv and linear also add 1 FLOP per output element for the bias; attention counts its two
  matmuls over the full score matrix, causal masking not discounted, plus the four
  projections for ``nn.MultiheadAttention``). Pools count one FLOP per input element; every
  other compute node one per output element; folded nodes none.
- ``params_bytes``: parameters of the layer's module or ``get_attr`` nodes, each counted once.
- ``activation_bytes``: bytes of the layer's values read by other layers or by the output.

**Timings.** Each layer is a small GraphModule cut from the fx graph; the layers run as a
chain, in train mode, as a stage worker runs a slice of them: every layer's forward in order
on the previous layers' outputs (detached at each layer: fresh leaves), then every layer's
backward in reverse order on the gradients its consumers returned (input gradients included,
except for the model input). So each layer is timed in the company it runs in -- its inputs
just computed, its neighbours' weights and activations in the caches -- rather than alone,
over and over. Warm-up passes, then the median of ``repeats``; one torch thread (as in a
one-thread Ray actor). Every pass starts from no parameter gradients, so a backward stores
them; adding them into a step's earlier microbatches' is the cost model's accumulation term
(rule 2, :mod:`core.costmodel`; measured by ``bench/grad_accumulation.py``). The fit is
linear in the batch size, CPU kernels are not always: ResNet-50 at 32x32 takes longer at 8
samples than at 16 here (oneDNN's 1x1 convolutions on 2x2 maps), so time the sizes a plan's
operations will see.
Fixed and per-sample parts are fitted from two batch sizes. With a ``loss`` (the training
loss of the model's output: :func:`profile_model`), the last layer's forward and backward
include it, as the last stage of a pipeline computes it (a cross-entropy over a language
model's vocabulary costs as much as a block). The clock is the wall clock
(``clock="wall"``, synchronised on CUDA) or, on CPU, this thread's CPU time
(``clock="cpu"``): the cost of the compute itself, unaffected by other processes' load on a
shared machine -- what an emulated device is slowed from (:mod:`executor.stage`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils._pytree import tree_leaves

from core.errors import PipeplanError
from core.profile import LayerProfile, LayerTiming, ModelProfile

Node = fx.Node
Assignment = dict[Node, int]

_ACTIVATIONS = frozenset({
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh",
    "ELU", "SELU", "CELU", "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus", "Softsign",
    "Softmax", "LogSoftmax", "Softmin", "GLU", "Threshold", "LogSigmoid", "Tanhshrink",
})  # fmt: skip
_TRIVIAL_MODULES = frozenset({"Identity", "Flatten", "Unflatten"})

_SCALAR_CALLS = frozenset({"getattr", "size", "dim", "numel"})
_SCALAR_ARITH = frozenset({"add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow",
                           "eq", "ne", "lt", "le", "gt", "ge", "getitem"})  # fmt: skip
_TRIVIAL_CALLS = _SCALAR_CALLS | frozenset({
    "getitem", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "contiguous",
    "permute", "transpose", "t", "movedim", "unsqueeze", "squeeze", "expand", "expand_as",
    "split", "chunk", "unbind", "narrow", "select", "type", "type_as", "to", "float", "half",
    "double", "detach", "clone", "_assert", "arange", "zeros", "ones", "full", "empty",
    "zeros_like", "ones_like", "full_like", "empty_like",
})  # fmt: skip


def _ops(op: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, op)


_CALL_OPS: dict[str, str] = {
    **_ops("conv", "conv1d", "conv2d", "conv3d",
           "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    **_ops("relu", "relu", "relu6", "leaky_relu", "prelu", "gelu", "silu", "mish", "sigmoid",
           "tanh", "elu", "selu", "celu", "hardtanh", "hardswish", "hardsigmoid", "softplus",
           "softmax", "log_softmax", "glu", "logsigmoid"),
    **_ops("pool", "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d",
           "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
           "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"),
    **_ops("fc", "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm"),
    **_ops("pad", "pad"),
    **_ops("norm", "batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm",
           "local_response_norm", "normalize"),
    **_ops("embedding", "embedding", "embedding_bag"),
    **_ops("attention", "scaled_dot_product_attention"),
    **_ops("dropout", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout"),
    **_ops("add", "add", "iadd"),
    **_ops("concat", "cat", "concat", "concatenate", "stack"),
}  # fmt: skip


# --- tracing and folding --------------------------------------------------------------------


def trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with an error that says what failed."""
    try:
        return fx.symbolic_trace(model)
    except Exception as e:
        raise PipeplanError(
            f"model {type(model).__name__}: not traceable by torch.fx ({type(e).__name__}: {e})"
        ) from e


def _call_name(node: Node) -> str:
    """Name of what a call node calls, in-place suffix removed (``relu_`` -> ``relu``)."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
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


def _node_op(gm: fx.GraphModule, node: Node, scalars: set[Node]) -> str | None:
    """Op kind of a node, or None when it is trivial and gets folded."""
    if node.op in ("placeholder", "output", "get_attr"):
        return None
    if node.op == "call_module":
        return _module_op(gm.get_submodule(str(node.target)))
    name = _call_name(node)
    if name in _TRIVIAL_CALLS or node in scalars:
        return None
    return _CALL_OPS.get(name, "other")


def _is_scalar(node: Node, scalars: set[Node]) -> bool:
    """Shape queries and integer arithmetic on them (``x.size(1) * 2``)."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = _call_name(node)
    if name in _SCALAR_CALLS:
        return True
    inputs = node.all_input_nodes
    return name in _SCALAR_ARITH and bool(inputs) and all(a in scalars for a in inputs)


def _assign(gm: fx.GraphModule) -> tuple[Assignment, list[Node]]:
    """Layer index of every node but placeholders and the output; the anchor of each layer."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    scalars: set[Node] = set()
    layer_of: Assignment = {}
    anchors: list[Node] = []
    for n in nodes:
        if _is_scalar(n, scalars):
            scalars.add(n)
        if _node_op(gm, n, scalars) is not None:
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
        if n not in layer_of:
            users = [layer_of[u] for u in n.users if u in layer_of]
            layer_of[n] = min(users) if users else len(anchors) - 1
    return layer_of, anchors


def layer_of_nodes(gm: fx.GraphModule) -> dict[str, int]:
    """Profile layer index of every fx node except placeholders and the output, by node name.

    ``split_module(gm, root, lambda n: stage_of[layer_of_nodes(gm)[n.name]])`` cuts the graph
    consistently with :func:`profile_model` (same trace, same folding).
    """
    layer_of, _ = _assign(gm)
    return {n.name: i for n, i in layer_of.items()}


def _groups(gm: fx.GraphModule, layer_of: Assignment, count: int) -> list[list[Node]]:
    groups: list[list[Node]] = [[] for _ in range(count)]
    for n in gm.graph.nodes:
        if n in layer_of:
            groups[layer_of[n]].append(n)
    return groups


def layer_nodes(gm: fx.GraphModule) -> list[list[str]]:
    """The fx node names of each profile layer, in graph order."""
    layer_of, anchors = _assign(gm)
    return [[n.name for n in g] for g in _groups(gm, layer_of, len(anchors))]


def _leaving(group: Sequence[Node], layer_of: Assignment, index: int) -> list[Node]:
    """Nodes of a layer whose value another layer or the graph output reads."""
    outside = [any(layer_of.get(u, -1) != index for u in n.users) for n in group]
    return [n for n, out in zip(group, outside, strict=True) if out and n.op != "get_attr"]


def _external_inputs(group: Sequence[Node], layer_of: Assignment, index: int) -> list[Node]:
    seen: dict[Node, None] = {}
    for n in group:
        for a in n.all_input_nodes:
            if layer_of.get(a, -1) != index:
                seen[a] = None
    return list(seen)


# --- analytic sizes -------------------------------------------------------------------------


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
    name, out = _call_name(node), _numel(node)
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
    op = _node_op(gm, anchor, set()) or "other"
    if anchor.op == "call_module":
        flops = _module_flops(gm.get_submodule(str(anchor.target)), anchor, op)
    else:
        flops = _call_flops(anchor, op)
    params_bytes = 0
    for p in _params(gm, group):
        if id(p) not in seen:
            seen.add(id(p))
            params_bytes += p.numel() * p.element_size()
    leaving = _leaving(group, layer_of, index)
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
    layer_of, anchors = _assign(gm)
    groups = _groups(gm, layer_of, len(anchors))
    seen: set[int] = set()
    return [
        _layer_profile(gm, g, a, name, layer_of, seen)
        for g, a, name in zip(groups, anchors, _layer_names(anchors), strict=True)
    ]


# --- timings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """One layer as a callable GraphModule of its external inputs."""

    module: fx.GraphModule
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]


def _piece(gm: fx.GraphModule, group: Sequence[Node], layer_of: Assignment, index: int) -> _Piece:
    inputs = _external_inputs(group, layer_of, index)
    outputs = _leaving(group, layer_of, index) or [group[-1]]
    graph = fx.Graph()
    env: dict[Node, Node] = {a: graph.placeholder(a.name) for a in inputs}
    for n in group:
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[o] for o in outputs))
    return _Piece(fx.GraphModule(gm, graph), tuple(inputs), tuple(outputs))


Clock = Literal["wall", "cpu"]


def _clock(device: torch.device, clock: Clock = "wall") -> Callable[[], float]:
    if clock == "cpu":
        if device.type != "cpu":
            raise PipeplanError(f"clock: 'cpu' times CPU compute only, not {device.type!r}")
        return time.thread_time
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    return time.perf_counter


Loss = Callable[[torch.Tensor], torch.Tensor]
"""The training loss of a model's output (a scalar), as the last pipeline stage computes it."""


def _check_one_output(gm: fx.GraphModule) -> None:
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    count = len([v for v in tree_leaves(output.args[0]) if isinstance(v, Node)])
    if count != 1:
        raise PipeplanError(f"loss: needs a model with one output tensor, this one gives {count}")


def _with_loss(forward: Callable[..., Any], loss: Loss | None) -> Callable[..., Any]:
    """``forward``, followed by ``loss`` of its one tensor output when a loss is given."""
    if loss is None:
        return forward

    def forward_and_loss(*args: Any) -> Any:
        (out,) = [t for t in tree_leaves(forward(*args)) if isinstance(t, torch.Tensor)]
        return loss(out)

    return forward_and_loss


def _time_chain(
    pieces: Sequence[_Piece],
    env: dict[Node, Any],
    params: Sequence[nn.Parameter],
    warmup: int,
    repeats: int,
    now: Callable[[], float],
    loss: Loss | None = None,
) -> list[tuple[float, float]]:
    """Median forward and backward seconds of every layer, the layers run as a chain.

    Each repeat runs every layer's forward in order, each on the previous layers' outputs
    (detached: fresh leaves, fed as clones), then every layer's backward in reverse order on
    the gradients its consumers returned -- what a stage worker does over a slice of
    layers. Inputs no layer produces (the model input, attributes) come from ``env``, a
    captured forward pass. ``loss``: the last layer's, timed with it.
    """
    fwd: list[list[float]] = [[] for _ in pieces]
    bwd: list[list[float]] = [[] for _ in pieces]
    last = len(pieces) - 1
    for r in range(warmup + repeats):
        values: dict[Node, Any] = {}
        runs: list[tuple[dict[Node, torch.Tensor], list[torch.Tensor | None]]] = []
        for i, piece in enumerate(pieces):
            leaves: dict[Node, torch.Tensor] = {}
            args = []
            for a in piece.inputs:
                value = values.get(a, env[a])
                if a in values and isinstance(value, torch.Tensor) and value.is_floating_point():
                    leaves[a] = value.detach().requires_grad_()
                    value = leaves[a].clone()
                args.append(value)
            forward = _with_loss(piece.module, loss if i == last else None)
            t0 = now()
            outs = forward(*args)
            t1 = now()
            results = list(outs) if isinstance(outs, tuple) else [outs]
            if i < last:
                values.update(zip(piece.outputs, results, strict=True))
            runs.append((leaves, results))
            if r >= warmup:
                fwd[i].append(t1 - t0)
        for p in params:
            p.grad = None
        grads: dict[Node, torch.Tensor] = {}
        for i in range(last, -1, -1):
            leaves, results = runs.pop()
            nodes = pieces[i].outputs if i < last else (None,) * len(results)
            pairs = [
                (t, grads.pop(n) if n is not None else torch.ones_like(t))
                for n, t in zip(nodes, results, strict=True)
                if isinstance(t, torch.Tensor) and t.requires_grad and (n is None or n in grads)
            ]
            t2 = now()
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            t3 = now()
            for a, leaf in leaves.items():
                if leaf.grad is not None:
                    grads[a] = grads[a] + leaf.grad if a in grads else leaf.grad
            if r >= warmup:
                bwd[i].append(t3 - t2)
            del leaves, results, pairs
    return [(statistics.median(f), statistics.median(b)) for f, b in zip(fwd, bwd, strict=True)]


def _time_whole(
    gm: fx.GraphModule,
    batch: torch.Tensor,
    params: Sequence[nn.Parameter],
    warmup: int,
    repeats: int,
    now: Callable[[], float],
    loss: Loss | None = None,
) -> tuple[float, float]:
    """Median forward and backward seconds of the whole model (and ``loss``) in one call
    each."""
    return _time_calls(_with_loss(gm, loss), lambda: [batch], params, warmup, repeats, now)


def _time_calls(
    forward: Callable[..., Any],
    make_args: Callable[[], list[Any]],
    params: Sequence[nn.Parameter],
    warmup: int,
    repeats: int,
    now: Callable[[], float],
) -> tuple[float, float]:
    """Median seconds of ``forward(*make_args())`` (the arguments made untimed) and of the
    backward of its outputs (random output gradients, drawn once), after ``warmup`` calls."""
    fwd: list[float] = []
    bwd: list[float] = []
    grads: list[torch.Tensor] | None = None
    for r in range(warmup + repeats):
        args = make_args()
        t0 = now()
        outs = forward(*args)
        t1 = now()
        tensors = [t for t in tree_leaves(outs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads is None:
            grads = [torch.randn_like(t) for t in tensors]
        for p in params:
            p.grad = None
        t2 = now()
        if tensors:
            torch.autograd.backward(tensors, grads)
        t3 = now()
        if r >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
        del outs, tensors, args
    return statistics.median(fwd), statistics.median(bwd)


def calibrated(
    layers: Sequence[tuple[float, float]], whole: tuple[float, float]
) -> list[tuple[float, float]]:
    """Layer (forward, backward) times scaled so that each direction sums to the whole
    model's time in one call (unchanged where the layers sum to 0)."""
    sums = [sum(t[k] for t in layers) for k in (0, 1)]
    ratio = [whole[k] / sums[k] if sums[k] > 0 else 1.0 for k in (0, 1)]
    return [(f * ratio[0], b * ratio[1]) for f, b in layers]


def _timing_input(sample: torch.Tensor, n: int) -> torch.Tensor:
    """A batch of n: standard-normal for floating inputs, the sample repeated otherwise."""
    shape = (n, *sample.shape[1:])
    if sample.is_floating_point():
        gen = torch.Generator().manual_seed(0)
        return torch.randn(shape, generator=gen, dtype=sample.dtype).to(sample.device)
    return sample[:1].expand(shape).contiguous()


def _capture(gm: fx.GraphModule, batch: torch.Tensor) -> dict[Node, Any]:
    """Every node's value for one train-mode forward pass of the whole graph."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(batch)
    return interp.env


def fit_fixed_per_sample(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """``(fixed, per_sample)`` through two measurements, both clipped at >= 0."""
    per_sample = max(0.0, (t2 - t1) / (n2 - n1))
    return max(0.0, t1 - n1 * per_sample), per_sample


def measure_timings(
    gm: fx.GraphModule,
    sample: torch.Tensor,
    batch_sizes: tuple[int, int],
    warmup: int,
    repeats: int,
    clock: Clock = "wall",
    calibrate: bool = False,
    loss: Loss | None = None,
) -> list[LayerTiming]:
    """Fixed + per-sample forward/backward seconds of every layer, one torch thread
    (``calibrate``, ``loss``: see :func:`profile_model`)."""
    layer_of, anchors = _assign(gm)
    groups = _groups(gm, layer_of, len(anchors))
    pieces = [_piece(gm, g, layer_of, i) for i, g in enumerate(groups)]
    params = list(gm.parameters())
    now = _clock(sample.device, clock)
    medians: list[list[tuple[float, float]]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gm.train()
        for n in batch_sizes:
            batch = _timing_input(sample, n)
            env = _capture(gm, batch)
            layer_times = _time_chain(pieces, env, params, warmup, repeats, now, loss)
            del env
            if calibrate:
                whole = _time_whole(gm, batch, params, warmup, repeats, now, loss)
                layer_times = calibrated(layer_times, whole)
            medians.append(layer_times)
    finally:
        torch.set_num_threads(threads)
        for p in params:
            p.grad = None
    (n1, n2), timings = batch_sizes, []
    for (f1, b1), (f2, b2) in zip(medians[0], medians[1], strict=True):
        fwd_fixed, fwd = fit_fixed_per_sample(n1, f1, n2, f2)
        bwd_fixed, bwd = fit_fixed_per_sample(n1, b1, n2, b2)
        timings.append(LayerTiming(fwd, bwd, fwd_fixed, bwd_fixed))
    return timings


# --- entry point ----------------------------------------------------------------------------


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Restore train/eval flags, buffers (BatchNorm statistics) and ``.grad`` afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def _check_options(
    example_input: Any, batch_sizes: Sequence[int], warmup: int, repeats: int
) -> None:
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1:
        raise PipeplanError(
            f"example_input: expected a tensor with a batch dimension, got {example_input!r}"
        )
    sizes = list(batch_sizes)
    valid = len(sizes) == 2 and all(isinstance(n, int) and n >= 1 for n in sizes)
    if not valid or sizes[0] >= sizes[1]:
        raise PipeplanError(
            f"batch_sizes: expected two increasing integers >= 1, got {batch_sizes!r}"
        )
    if warmup < 0:
        raise PipeplanError(f"warmup: must be >= 0, got {warmup!r}")
    if repeats < 1:
        raise PipeplanError(f"repeats: must be >= 1, got {repeats!r}")


def profile_model(
    model: nn.Module,
    example_input: torch.Tensor,
    name: str,
    device_type: str | None = "cpu",
    batch_sizes: tuple[int, int] = (2, 8),
    warmup: int = 2,
    repeats: int = 5,
    clock: Clock = "wall",
    calibrate: bool = False,
    loss: Loss | None = None,
) -> ModelProfile:
    """Profile ``model`` layer by layer (see the module docstring for what a layer is).

    ``example_input`` has a batch dimension (shape ``(1, ...)``; a larger batch is cut to its
    first sample); the profile's ``input_shape`` is its shape without the batch dimension.
    ``device_type`` names the timings (``timings[device_type]``); they are measured where the
    model's parameters and the input live. ``None`` skips timing: an analytic profile.
    The model is left as it was (train/eval flags, buffers, gradients). ``clock``: see the
    module docstring. ``calibrate``: also time the whole model's forward and backward in one
    call each at both batch sizes and scale the layers' times so that they sum to it -- a
    layer timed alone misses what running in a chain costs (caches, allocation, autograd
    bookkeeping), 10-35% of a stage on this machine; the shares between layers stay measured.
    ``loss``: the training loss of the model's output (one tensor) to time with the last
    layer, forward and backward (``None``: the output's backward starts from random
    gradients, as every other layer's).
    """
    _check_options(example_input, batch_sizes, warmup, repeats)
    if clock not in ("wall", "cpu"):
        raise PipeplanError(f"clock: expected 'wall' or 'cpu', got {clock!r}")
    sample = example_input[:1]
    gm = trace(model)
    with _preserved(model), torch.no_grad():
        gm.eval()
        ShapeProp(gm).propagate(sample)
    layers = analytic_layers(gm)
    profile = ModelProfile(name, tuple(sample.shape[1:]), tuple(layers))
    if device_type is None:
        return profile
    if loss is not None:
        _check_one_output(gm)
    with _preserved(model):
        timings = measure_timings(
            gm, sample, (batch_sizes[0], batch_sizes[1]), warmup, repeats, clock, calibrate, loss
        )
    return profile.with_timings(device_type, timings)
