"""Cut a model at a plan's layer boundaries: one torch.fx GraphModule per stage.

The model is traced with :func:`models.fx_layers.trace` (torch.fx, or torch.export on the
example input where torch.fx fails: a graph of aten ops whose parameters are attributes read
with ``get_attr``, which stage workers take from their own model); each fx node goes to the
stage of its profile layer (:func:`models.fx_layers.layer_of_nodes`, so layer indices mean
what they mean in the profile) and ``torch.fx.passes.split_module`` builds one submodule per
stage.

Values crossing a boundary are named by their fx node names. A stage receives every value
produced before it that it or a later stage reads, and sends on every value a later stage
reads (a skip connection from stage 0 to stage 2 is *relayed* by stage 1, as the cost model
assumes), so stages only talk to their neighbours. Each boundary value has a kind:

- ``batched``: a tensor whose first dimension is the batch; split and concatenated by rows.
- ``shared``: a tensor without a batch dimension (a position embedding): every piece
  carries the same value; its gradient from each downstream piece is counted once.
- ``constant``: a Python value (an int from a shape query) that does not depend on the batch.

The kinds are found by running the model at batch sizes 2 and 3; a tuple, or a non-tensor
value that changes with the batch size, cannot cross a boundary and is refused.
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from pipeplan.core.errors import PipeplanError, PlanError
from pipeplan.models.fx_layers import layer_of_nodes, trace

ValueKind = Literal["batched", "shared", "constant"]


@dataclass(frozen=True)
class StageGraph:
    """One stage's slice of the model and the names of what flows in and out of it."""

    index: int
    module: fx.GraphModule
    """The stage's submodule; its parameters are the model's own parameter objects."""
    inputs: tuple[str, ...]
    """Values received from the previous stage (for stage 0: the model's inputs)."""
    args: tuple[str, ...]
    """The submodule's arguments, in order: some inputs and some model attributes."""
    results: tuple[str, ...]
    """The submodule's results, in order."""
    outputs: tuple[str, ...]
    """Values sent to the next stage (for the last stage: the model's output)."""
    attrs: Mapping[str, str]
    """Argument name -> qualified name of a model attribute read with ``get_attr``."""
    param_names: Mapping[str, str]
    """Submodule parameter name -> the model's parameter name."""


@dataclass(frozen=True)
class ValueMeta:
    """What a receiving stage must know of a boundary value before it arrives: a tensor's
    dtype and shape (per sample for a batched value: without the batch dimension), or a
    constant's value, which never travels (every stage finds it in its own cut)."""

    kind: ValueKind
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    constant: Any = None

    def rows_shape(self, rows: int) -> tuple[int, ...]:
        """The tensor's shape for ``rows`` samples (a shared value's own shape)."""
        return (rows, *self.shape) if self.kind == "batched" else self.shape

    @property
    def differentiable(self) -> bool:
        """A floating tensor: its gradient flows back across the boundary."""
        return self.dtype is not None and self.dtype.is_floating_point


@dataclass(frozen=True)
class Partition:
    """A model cut into stages."""

    stages: tuple[StageGraph, ...]
    kinds: Mapping[str, ValueKind]
    """Kind of every value that crosses a boundary (model inputs and output included)."""
    num_layers: int
    meta: Mapping[str, ValueMeta] = field(default_factory=dict)
    """Dtype and shape (or value) of every value that crosses a boundary."""

    @property
    def model_inputs(self) -> tuple[str, ...]:
        return self.stages[0].inputs

    @property
    def model_output(self) -> str:
        return self.stages[-1].outputs[0]


_FX_LOCK = threading.Lock()
"""torch.fx tracing patches ``nn.Module.__call__`` for the whole process while it runs, so a
model run or traced meanwhile in another thread fails ("module is not installed as a
submodule"): one cut at a time (a measured reward starts pipelines from several threads)."""


def count_layers(model: nn.Module, example: torch.Tensor | None = None) -> int:
    """Number of profile layers of a model (what a plan's last stage must end at).

    ``example`` (a batch-1 input) is needed for a model only ``torch.export`` can trace.
    """
    with _FX_LOCK:
        return max(layer_of_nodes(trace(model, example)).values()) + 1


def partition(model: nn.Module, example: torch.Tensor, bounds: Sequence[int]) -> Partition:
    """Cut ``model`` into stages ``[bounds[i], bounds[i+1])`` of profile layers."""
    with _FX_LOCK:
        return _partition(model, example, bounds)


def _partition(model: nn.Module, example: torch.Tensor, bounds: Sequence[int]) -> Partition:
    gm = trace(model, example)
    layer_of = layer_of_nodes(gm)
    n_layers = max(layer_of.values()) + 1
    _check_bounds(bounds, n_layers, type(model).__name__)
    n_stages = len(bounds) - 1

    def stage_of(node: fx.Node) -> int:
        if node.name not in layer_of:
            raise PipeplanError(f"partition: fx node {node.name!r} has no profile layer")
        return bisect.bisect_right(bounds, layer_of[node.name]) - 1

    qualnames: dict[str, str] = {}
    split = split_by_stage(gm, model, stage_of, qualnames)
    model_inputs = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    model_output = _output_name(gm)
    raw = [_raw_stage(split, s) for s in range(n_stages)]
    carried = _carried(raw, model_inputs, model_output, gm)
    stages = []
    for s, (module, args, results, attrs) in enumerate(raw):
        inputs = model_inputs if s == 0 else carried[s - 1]
        outputs = (model_output,) if s == n_stages - 1 else carried[s]
        missing = [a for a in args if a not in attrs and a not in inputs]
        if missing:
            raise PipeplanError(f"partition: stage {s} reads {missing} that no stage sends it")
        params = {p: _original_name(f"submod_{s}", p, qualnames) for p, _ in _params(module)}
        stages.append(StageGraph(s, module, inputs, args, results, outputs, attrs, params))
    _check_attrs(stages, model)
    names = {n for st in stages for n in (*st.inputs, *st.outputs)}
    meta = _meta(gm, example, names)
    kinds = {n: m.kind for n, m in meta.items()}
    return Partition(tuple(stages), kinds, n_layers, meta)


def split_by_stage(
    gm: fx.GraphModule,
    model: nn.Module,
    stage_of: Callable[[fx.Node], int],
    qualnames: dict[str, str] | None = None,
) -> fx.GraphModule:
    """``split_module`` keeping node names, with every stage's submodule returning a tuple,
    also one result. torch releases without ``split_module``'s ``tuple_return`` (the CUDA
    images of some clusters ship one) return a lone result bare: its output is wrapped in a
    tuple here, and the parent graph reads item 0 of it."""
    names = {} if qualnames is None else qualnames
    try:
        return split_module(
            gm, model, stage_of, names, keep_original_node_name=True, tuple_return=True
        )
    except TypeError as e:
        if "tuple_return" not in str(e):
            raise
    split = split_module(gm, model, stage_of, names, keep_original_node_name=True)
    for call in [n for n in split.graph.nodes if n.op == "call_module"]:
        body = split.get_submodule(str(call.target))
        if not isinstance(body, fx.GraphModule):
            continue
        out = next(n for n in body.graph.nodes if n.op == "output")
        if not isinstance(out.args[0], fx.Node):
            continue
        out.args = ((out.args[0],),)
        body.recompile()
        with split.graph.inserting_after(call):
            item = split.graph.call_function(operator.getitem, (call, 0))
        call.replace_all_uses_with(item, delete_user_cb=lambda user, it=item: user is not it)
    split.recompile()
    return split


def _check_bounds(bounds: Sequence[int], n_layers: int, model: str) -> None:
    ok = (
        len(bounds) >= 2
        and bounds[0] == 0
        and all(a < b for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    )
    if not ok:
        raise PlanError(f"stage bounds {list(bounds)}: expected 0 = b0 < b1 < ... < bS")
    if bounds[-1] != n_layers:
        raise PlanError(
            f"stages[{len(bounds) - 2}].layers: ends at {bounds[-1]} but model {model} has "
            f"{n_layers} layers"
        )


def _output_name(gm: fx.GraphModule) -> str:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node):
        raise PipeplanError(
            f"model {type(gm).__name__}: returns {type(out).__name__}; the executor needs a "
            "single output tensor (the logits)"
        )
    return out.name


RawStage = tuple[fx.GraphModule, tuple[str, ...], tuple[str, ...], dict[str, str]]


def _raw_stage(split: fx.GraphModule, s: int) -> RawStage:
    """Submodule ``s``, its argument names, result names and attribute arguments."""
    name = f"submod_{s}"
    module = split.get_submodule(name)
    if not isinstance(module, fx.GraphModule):
        raise PipeplanError(f"partition: {name} is not a GraphModule")
    args = tuple(n.name for n in module.graph.nodes if n.op == "placeholder")
    out = next(n for n in module.graph.nodes if n.op == "output").args[0]
    results = tuple(n.name for n in out) if isinstance(out, tuple | list) else (out.name,)
    call = next(n for n in split.graph.nodes if n.op == "call_module" and n.target == name)
    attrs = {
        arg: str(src.target)
        for arg, src in zip(args, call.args, strict=True)
        if isinstance(src, fx.Node) and src.op == "get_attr"
    }
    return module, args, results, attrs


def _carried(
    raw: Sequence[RawStage], model_inputs: tuple[str, ...], output: str, gm: fx.GraphModule
) -> list[tuple[str, ...]]:
    """``carried[s]``: values produced up to stage ``s`` and read after it, in graph order."""
    produced = dict.fromkeys(model_inputs, -1)
    last_use: dict[str, int] = {}
    for s, (_, args, results, attrs) in enumerate(raw):
        produced.update(dict.fromkeys(results, s))
        for a in args:
            if a not in attrs:
                last_use[a] = max(last_use.get(a, -1), s)
    last_use[output] = len(raw)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    names = sorted(produced, key=lambda n: order.get(n, -1))
    return [
        tuple(n for n in names if produced[n] <= s < last_use.get(n, -1))
        for s in range(len(raw) - 1)
    ]


def _params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters())


def _original_name(prefix: str, param: str, qualnames: Mapping[str, str]) -> str:
    """``features_0.weight`` of ``submod_0`` -> ``features.0.weight`` (split_module's map)."""
    full = f"{prefix}.{param}"
    parts = full.split(".")
    for cut in range(len(parts), 1, -1):
        head = ".".join(parts[:cut])
        if head in qualnames:
            return ".".join([qualnames[head], *parts[cut:]])
    return param


def _check_attrs(stages: Sequence[StageGraph], model: nn.Module) -> None:
    """A trainable attribute read with ``get_attr`` must belong to one stage only."""
    users: dict[str, list[int]] = {}
    for st in stages:
        for target in st.attrs.values():
            users.setdefault(target, []).append(st.index)
    for target, where in users.items():
        value = fetch_attr(model, target)
        if len(where) > 1 and isinstance(value, nn.Parameter) and value.requires_grad:
            raise PlanError(
                f"parameter {target!r} is read by stages {where}; a trainable parameter must "
                "sit in one stage (cut elsewhere)"
            )


def fetch_attr(model: nn.Module, target: str) -> Any:
    value: Any = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Capture(fx.Interpreter):
    """Runs the graph and keeps the value (tensor shape, or the value) of some nodes."""

    def __init__(self, gm: fx.GraphModule, names: set[str]) -> None:
        super().__init__(gm)
        self.names = names
        self.seen: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.names:
            self.seen[n.name] = (
                _Shape(tuple(result.shape), result.dtype)
                if isinstance(result, torch.Tensor)
                else result
            )
        return result


def _meta(gm: fx.GraphModule, example: torch.Tensor, names: set[str]) -> dict[str, ValueMeta]:
    runs = {}
    flags = {m: m.training for m in gm.modules()}
    try:
        gm.eval()  # shapes only: no batch-norm statistics updated, no dropout
        with torch.no_grad():
            for b in (2, 3):
                cap = _Capture(gm, names)
                cap.run(example.expand(b, *example.shape[1:]).contiguous())
                runs[b] = cap.seen
    finally:
        for m, training in flags.items():
            m.train(training)
    meta: dict[str, ValueMeta] = {}
    for name in names:
        two, three = runs[2][name], runs[3][name]
        if isinstance(two, _Shape) and isinstance(three, _Shape):
            shape2, shape3 = two.shape, three.shape
            if shape2[:1] == (2,) and shape3[:1] == (3,) and shape2[1:] == shape3[1:]:
                meta[name] = ValueMeta("batched", two.dtype, shape2[1:])
                continue
            if shape2 == shape3:
                meta[name] = ValueMeta("shared", two.dtype, shape2)
                continue
        elif not isinstance(two, torch.Tensor | tuple | list | dict) and two == three:
            meta[name] = ValueMeta("constant", constant=two)
            continue
        raise PlanError(
            f"value {name!r} crosses a stage boundary but is neither a batch-major tensor nor "
            f"independent of the batch (batch 2: {two!r}, batch 3: {three!r}); cut elsewhere"
        )
    return meta
