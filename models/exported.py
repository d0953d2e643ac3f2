"""Trace a model with ``torch.export`` into a plain torch.fx graph of aten ops.

``torch.fx.symbolic_trace`` cannot trace models with control flow on tensor shapes or
values, or with Python code it does not see through (Hugging Face ``transformers`` models:
transformers 5 has no fx tracer of its own). ``torch.export`` can: it runs the model on an
example input and records the aten ops it calls. :func:`export_trace` turns the exported
program into what the layer machinery (:mod:`models.fx_layers`) expects of an fx trace:

- a plain ``fx.GraphModule`` whose ``get_attr`` nodes read the model's own parameters and
  buffers (the same objects, under the model's qualified names), taking the model's input
  tensor and returning one value, with no pytree wrapping;
- the batch dimension left dynamic (exported at batch 2), so the graph runs at any batch
  size; the guards module and the metadata assertions are dropped, as is dead code (a mask
  computed and never read);
- every size that depends on the batch (``view(x, [B * T, C])``) read afresh from the model
  input where it is used (``sym_size(ids, 0) * T``), so that no batch-dependent integer
  crosses a stage boundary (:mod:`executor.partition` cannot send one): a stage that
  reshapes by the batch size receives the model input (token ids: a few bytes a token);
- every dropout a ``nn.Dropout`` submodule, so that ``eval()``/``train()`` and
  :func:`executor.model.disable_dropout` act on it as on the model (export freezes
  ``aten.dropout``'s ``train`` flag into the graph).

Batch normalisation keeps the mode the model was exported in (train), as export records it.
A model that cannot be exported is refused with one line naming its class and what failed.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import sympy
import torch
from torch import fx, nn

from pipeplan.core.errors import PipeplanError

_DROPPED = frozenset({
    "_assert_tensor_metadata", "_assert_scalar", "_assert_async", "sym_constrain_range",
    "sym_constrain_range_for_size",
})  # fmt: skip
"""aten ops that only check (shapes, dtypes): removed from the exported graph."""


def _op_name(target: Any) -> str:
    """``aten.linear.default`` -> ``linear``; anything else by its ``__name__``."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target._opname)
    return str(getattr(target, "__name__", target))


def model_label(model: nn.Module) -> str:
    """A model's name in errors: its class, or the class it wraps (``hf:`` models)."""
    return str(getattr(model, "label", type(model).__name__))


_CALL = re.compile(r'File "[^"]*", line \d+, in (\w+)\n\s*(\S[^\n]*)')
"""Where export's error says the model's code failed: the function and its source line."""


def _one_line(error: BaseException) -> str:
    """An export error in one line: its first line, and the model's code it failed at."""
    text = str(error)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = re.sub(r"\s+", " ", lines[0] if lines else "")
    if len(first) > 200:
        first = first[:197] + "..."
    calls = _CALL.findall(text)
    where = f" at {calls[-1][0]}: {calls[-1][1].strip()!r}" if calls else ""
    return f"{type(error).__name__}{where}: {first}"


def _export(model: nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    """Exported at batch 2 with a dynamic batch dimension (export specialises a size of 1)."""
    batch = example[:1].expand(2, *example.shape[1:]).contiguous()
    dynamic = ({0: torch.export.Dim.DYNAMIC},)
    try:
        return torch.export.export(model, (batch,), dynamic_shapes=dynamic)
    except Exception as e:
        raise PipeplanError(
            f"model {model_label(model)}: torch.export cannot trace it ({_one_line(e)})"
        ) from e


def _dropout_modules(gm: fx.GraphModule) -> None:
    """Replace every ``aten.dropout(x, p, train)`` by a call of a new ``nn.Dropout(p)``."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or _op_name(node.target) != "dropout":
            continue
        x, p = node.args[0], node.args[1]
        name = f"dropout_{count}" if count else "dropout"
        while hasattr(gm, name):
            count += 1
            name = f"dropout_{count}"
        count += 1
        gm.add_submodule(name, nn.Dropout(float(p)))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (x,))
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)


def _clean(graph: fx.Graph) -> None:
    """Drop the guards module call and assertions, then dead code; one output value."""
    for node in list(graph.nodes):
        dropped = node.op == "call_module" and str(node.target) == "_guards_fn"
        dropped |= node.op == "call_function" and _op_name(node.target) in _DROPPED
        if dropped and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    if isinstance(value, tuple | list) and len(value) == 1:
        output.args = (value[0],)
    graph._codegen = fx.graph.CodeGen()  # plain positional forward: no pytree wrapping


def _batch_size(graph: fx.Graph, before: fx.Node, source: fx.Node, expr: Any) -> fx.Node:
    """Nodes computing ``expr`` (``k * B`` or ``B // k``) from the batch size of ``source``,
    inserted before ``before``."""
    batch = source.meta["val"].shape[0]
    ratio = sympy.simplify(expr / batch.node.expr)
    with graph.inserting_before(before):
        size = graph.call_function(torch.ops.aten.sym_size.int, (source, 0))
        if ratio == 1:
            return size
        if ratio.is_Integer:
            return graph.call_function(operator.mul, (size, int(ratio)))
        if ratio.is_Rational and ratio.p == 1:
            return graph.call_function(operator.floordiv, (size, int(ratio.q)))
    raise PipeplanError(
        f"model: size {expr} of node {before.name!r} is not a multiple of the batch size"
    )


def _is_symint(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.SymInt)


def _local_sizes(graph: fx.Graph) -> None:
    """Each use of a batch-dependent size reads it afresh from the model input."""
    source = next(n for n in graph.nodes if n.op == "placeholder")
    for node in list(graph.nodes):
        if not _is_symint(node):
            continue
        expr = node.meta["val"].node.expr
        for user in [u for u in node.users if not _is_symint(u)]:
            user.replace_input_with(node, _batch_size(graph, user, source, expr))
    graph.eliminate_dead_code()


def export_trace(model: nn.Module, example: torch.Tensor) -> fx.GraphModule:
    """``model`` as a plain fx GraphModule of aten ops, traced by ``torch.export`` on
    ``example`` (a batch-1 input); its parameters are the model's own parameter objects."""
    exported = _export(model, example).module()
    _clean(exported.graph)
    _local_sizes(exported.graph)
    # A fresh GraphModule copies the attributes the graph reads (the same objects): a plain
    # module (export's own refuses eval()), without the guards submodule.
    gm = fx.GraphModule(exported, exported.graph, class_name=type(model).__name__)
    _dropout_modules(gm)
    gm.graph.lint()
    gm.recompile()
    return gm
