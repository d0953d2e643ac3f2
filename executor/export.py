"""A plan as a script that trains without pipeplan: ``torchrun`` and torch.distributed.pipelining.

:func:`export_torchrun` writes ``train_pipeline.py`` and a ``README.md`` into a folder. The
script runs one rank per stage, cuts the model as pipeplan does and trains it with PyTorch's
``ScheduleGPipe`` or ``Schedule1F1B`` on the plan's microbatches, printing ``step N loss L``
after every step (from the last rank).

The cut is pipeplan's, not a look-alike: the export traces the model with torch.fx, maps
every node to its stage (:func:`models.fx_layers.layer_of_nodes` and the plan's layer bounds)
and embeds that map by node name. Splitting the graph with it (``split_module``, as
:func:`executor.partition.partition` does) must give partition's stages, argument for
argument, or the export is refused; the script makes the same split of its own trace, stops
on a model whose nodes differ, and checks its stages' arguments and results again. What
crosses each boundary (values relayed to a later stage included) is embedded too.

The data recipe is :func:`executor.data.synthetic_batches`' few lines with the shapes, dtype
and vocabulary fixed at export, so the script's batches for a seed are pipeplan's; a
``--data MODULE:FUNCTION`` hook replaces them with the user's. The loss is pipeplan's:
cross-entropy over every prediction averaged over the global batch (each microbatch's mean,
the schedule scaling the gradients by ``1 / M``).

The script imports pipeplan only to build one of pipeplan's own zoo models (``gpt``,
``digits_cnn``); a torchvision zoo model is built straight from torchvision with the zoo's
arguments and seed, and a ``package.module:factory`` model from the user's module. Plans
PyTorch's schedules cannot run are refused with :func:`executor.torch_engine.unsupported`'s
reason, and 1F1B with fewer microbatches than stages (``Schedule1F1B`` refuses it).
"""

from __future__ import annotations

import bisect
import pprint
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from pipeplan.core.code import is_code_ref
from pipeplan.core.errors import PipeplanError, PlanError
from pipeplan.core.plan import Plan
from pipeplan.executor.model import ModelSource, OptimizerConfig
from pipeplan.executor.partition import Partition, partition, split_by_stage
from pipeplan.executor.torch_engine import unsupported
from pipeplan.models import zoo
from pipeplan.models.fx_layers import layer_of_nodes

SCRIPT = "train_pipeline.py"
README = "README.md"

TORCHVISION_EXTRA: Mapping[str, Mapping[str, Any]] = {
    "alexnet": {},
    "vgg16": {},
    "resnet50": {},
    "inception_v3": {"aux_logits": False, "init_weights": False},
}
"""The zoo's torchvision models and the arguments the zoo builds them with besides
``weights=None`` and ``num_classes`` (:mod:`models.zoo`)."""

Spec = dict[str, Any]
SGD = OptimizerConfig()
"""The default optimizer: pipeplan's (SGD, lr 0.05)."""


def export_torchrun(
    plan: Plan,
    model: ModelSource,
    out_dir: str | Path,
    *,
    optimizer: OptimizerConfig = SGD,
    seed: int = 0,
    steps: int = 5,
) -> list[Path]:
    """Write ``train_pipeline.py`` and ``README.md`` into ``out_dir``; their paths.

    ``seed`` is the data's (the model's weights come from ``model.seed``); ``steps`` the
    script's default ``--steps``. A plan pipelining cannot run, or a model the script could
    not rebuild, is refused before anything is written.
    """
    spec = export_spec(plan, model, optimizer=optimizer, seed=seed, steps=steps)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PipeplanError(f"export.out_dir: {str(out)!r} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    script, readme = out / SCRIPT, out / README
    script.write_text(render_script(spec))
    readme.write_text(render_readme(spec))
    return [script, readme]


def export_spec(
    plan: Plan, model: ModelSource, *, optimizer: OptimizerConfig, seed: int, steps: int
) -> Spec:
    """Everything the script embeds: the model recipe, the cut, the schedule, the optimizer
    and the data recipe (plain values only, written as a Python literal)."""
    _check_int("export.steps", steps, 1)
    _check_int("export.seed", seed, 0)
    recipe = _model_recipe(model)
    built, example = model.build()
    part = partition(built, example, [0, *(s.end for s in plan.stages)])
    _check_runnable(plan, part)
    stage_of = _stage_of(built, plan, part)
    built.eval()
    with torch.no_grad():
        output_shape = tuple(built(example).shape)
    return {
        "model": recipe,
        "global_batch": plan.global_batch,
        "microbatches": plan.microbatches(0),
        "schedule": plan.schedule.value,
        "stages": _stages(plan, part),
        "stage_of": stage_of,
        "optimizer": {
            "kind": optimizer.kind,
            "lr": optimizer.lr,
            "momentum": optimizer.momentum,
            "weight_decay": optimizer.weight_decay,
        },
        "data": _data_recipe(example, output_shape, seed),
        "steps": steps,
    }


def _check_int(field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PipeplanError(f"{field}: must be an integer >= {minimum}, got {value!r}")


def _check_runnable(plan: Plan, part: Partition) -> None:
    why = unsupported(plan, part.meta, emulated=False)
    if why is not None:
        raise PlanError(f"export: torch.distributed.pipelining cannot run this plan: {why}")


# --- the model ------------------------------------------------------------------------------


def _model_recipe(source: ModelSource) -> Spec:
    """How the script rebuilds ``source``'s model with the same weights: pipeplan's zoo, a
    torchvision builder with the zoo's arguments, or the user's ``package.module:factory``
    called with the options (seeded as :func:`models.zoo.build` and a factory's build are)."""
    if source.module is not None:
        raise PipeplanError(
            f"export: model {source.name!r} is a module object, which a script cannot rebuild; "
            "name its factory as package.module:factory"
        )
    options = dict(source.options)
    for key, value in options.items():
        if not isinstance(value, bool | int | float | str | type(None)):
            raise PipeplanError(
                f"export: model option {key!r} = {value!r} is not a plain value "
                "(bool, int, float, str or None) the script can embed"
            )
    if source.name.startswith("hf:"):
        raise PipeplanError(
            f"export: model {source.name!r}: Hugging Face models are cut from torch.export "
            "graphs, and the script splits torch.fx graphs only"
        )
    if is_code_ref(source.name):
        return {"kind": "code", "ref": source.name, "seed": source.seed, "options": options}
    if source.name in TORCHVISION_EXTRA:
        args = {"num_classes": options.get("num_classes", 10), **TORCHVISION_EXTRA[source.name]}
        return {"kind": "torchvision", "name": source.name, "seed": source.seed, "options": args}
    if source.name not in zoo.MODELS:
        raise PipeplanError(
            f"export: model {source.name!r} is neither a zoo model ({', '.join(zoo.MODELS)}) "
            "nor a package.module:factory the script can import"
        )
    return {
        "kind": "zoo",
        "name": source.name,
        "input_size": source.input_size,
        "seed": source.seed,
        "options": options,
    }


# --- the cut --------------------------------------------------------------------------------


def _stage_of(model: nn.Module, plan: Plan, part: Partition) -> dict[str, int]:
    """The stage of every fx node by name: its profile layer's stage under the plan's bounds
    (what :func:`executor.partition.partition` hands ``split_module``), checked to give
    ``part``'s stages when the script splits ``torch.fx.symbolic_trace``'s graph with it."""
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:
        raise PipeplanError(
            f"export: model {type(model).__name__} is not traceable by torch.fx, which the "
            f"script cuts with ({type(e).__name__}: {e})"
        ) from e
    starts = [s.start for s in plan.stages]
    stage_of = {
        name: bisect.bisect_right(starts, layer) - 1 for name, layer in layer_of_nodes(gm).items()
    }
    split = split_by_stage(gm, model, lambda n: stage_of[n.name])
    for graph in part.stages:
        body = split.get_submodule(f"submod_{graph.index}")
        assert isinstance(body, fx.GraphModule)
        args = tuple(n.name for n in body.graph.nodes if n.op == "placeholder")
        out = next(n for n in body.graph.nodes if n.op == "output").args[0]
        if args != graph.args or tuple(n.name for n in out) != graph.results:
            raise PipeplanError(
                f"export: stage {graph.index} of the script's torch.fx cut differs from "
                f"pipeplan's (arguments {args}, pipeplan's {graph.args})"
            )
    return stage_of


def _stages(plan: Plan, part: Partition) -> list[Spec]:
    return [
        {
            "layers": list(stage.layers),
            "devices": list(stage.devices),
            "microbatch": stage.microbatch,
            "inputs": list(graph.inputs),
            "args": list(graph.args),
            "results": list(graph.results),
            "outputs": list(graph.outputs),
        }
        for stage, graph in zip(plan.stages, part.stages, strict=True)
    ]


# --- the data -------------------------------------------------------------------------------


def _data_recipe(example: torch.Tensor, output_shape: tuple[int, ...], seed: int) -> Spec:
    """What :func:`executor.data.synthetic_batches` reads of the example and the output."""
    classes = output_shape[-1]
    floating = example.is_floating_point()
    return {
        "seed": seed,
        "input_shape": list(example.shape[1:]),
        "floating": floating,
        "dtype": str(example.dtype).removeprefix("torch."),
        "high": None if floating else max(int(example.max()) + 1, classes),
        "label_shape": list(output_shape[1:-1]),
        "classes": classes,
    }


# --- the files ------------------------------------------------------------------------------


def render_script(spec: Spec) -> str:
    """``train_pipeline.py`` with ``spec`` embedded as ``EXPORT``."""
    literal = pprint.pformat(spec, indent=1, width=96, sort_dicts=False)
    build = _BUILD_MODEL[spec["model"]["kind"]]
    return _SCRIPT_TEMPLATE.replace("__BUILD_MODEL__", build).replace("__EXPORT__", literal)


def torchrun_command(stages: int, steps: int) -> str:
    """The command line that runs the script on one machine's CPU, one rank per stage."""
    return (
        f"GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node {stages} --nnodes 1 "
        f"--master-addr 127.0.0.1 --master-port 29500 {SCRIPT} --steps {steps}"
    )


def render_readme(spec: Spec) -> str:
    """The README snippet: what the script trains and how to run it."""
    model, opt = spec["model"], spec["optimizer"]
    name = model.get("name", model.get("ref"))
    stages = spec["stages"]
    needs = {
        "zoo": "torch, and pipeplan (it builds the model from pipeplan's zoo)",
        "torchvision": "torch and torchvision (not pipeplan)",
        "code": f"torch and the module of {name!r} on PYTHONPATH (not pipeplan)",
    }[model["kind"]]
    rows = "\n".join(
        f"| {i} | {i} | [{s['layers'][0]}, {s['layers'][1]}) | {', '.join(s['devices'])} |"
        for i, s in enumerate(stages)
    )
    intro = textwrap.fill(
        f"`{SCRIPT}` trains `{name}` cut into {len(stages)} stages as the plan says, with "
        f"`torch.distributed.pipelining` ({spec['schedule']}, {spec['microbatches']} "
        f"microbatches of {stages[0]['microbatch']} samples, global batch "
        f"{spec['global_batch']}) and {opt['kind']} (lr {opt['lr']}). It needs {needs}.",
        width=92,
    )
    return f"""# {name}: a pipeplan plan under torchrun

{intro}

    {torchrun_command(len(stages), spec["steps"])}

On GPUs add `--device cuda` (NCCL; one GPU per rank, `LOCAL_RANK`). Across machines use
torchrun's `--nnodes`/`--node-rank`/`--rdzv-endpoint`, ordering the nodes so that rank `s`
lands on stage `s`'s device:

| rank | stage | layers | plan device |
|-----:|------:|--------|-------------|
{rows}

The last rank prints `step N loss L` after every step: the cross-entropy over every
prediction averaged over the global batch. The default batches are pipeplan's synthetic
ones for `--seed` (default {spec["data"]["seed"]}); `--data MODULE:FUNCTION` trains on
`FUNCTION(batch=..., steps=..., seed=...)`'s `(inputs, labels)` pairs instead.
`--deterministic` turns dropout off. `python {SCRIPT} --help` lists the flags.
"""


_SCRIPT_TEMPLATE = r'''#!/usr/bin/env python3
"""Train a model cut into pipeline stages by a pipeplan plan, under torchrun.

Written by ``pipeplan export``; README.md says what it trains and how to start it. One rank
per stage: rank ``s`` runs stage ``s`` with torch.distributed.pipelining (gloo on the CPU,
NCCL with ``--device cuda``). The cut is pipeplan's: every fx node of the traced model goes
to the stage ``EXPORT["stage_of"]`` names and ``torch.fx.passes.split_module`` builds the
stages; a model that traces to other nodes, or a stage whose arguments or results differ
from the exported ones, stops the run. The loss is the cross-entropy over every prediction
averaged over the global batch; the last rank prints ``step N loss L`` after every step.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.fx.passes.split_module import split_module

EXPORT = __EXPORT__


def fail(message):
    """Stop with one line on stderr."""
    print(f"{os.path.basename(__file__)}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def import_ref(ref, flag):
    """``package.module:attribute`` imported from the user's code."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        fail(f"{flag}: {ref!r} is not of the form package.module:attribute")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


__BUILD_MODEL__


def fetch_attr(model, target):
    value = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


def cut(model, stage):
    """Stage ``stage``'s submodule of the exported cut and the model attributes it reads
    (argument name -> value)."""
    stage_of = EXPORT["stage_of"]
    gm = fx.symbolic_trace(model)
    nodes = {n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    if nodes != set(stage_of):
        fail(f"model: traces to other fx nodes than the exported one "
             f"({sorted(nodes ^ set(stage_of))[:5]}); export the plan again")
    split = split_module(gm, model, lambda n: stage_of[n.name], {},
                         keep_original_node_name=True, tuple_return=True)
    name = f"submod_{stage}"
    body = split.get_submodule(name)
    args = tuple(n.name for n in body.graph.nodes if n.op == "placeholder")
    out = next(n for n in body.graph.nodes if n.op == "output").args[0]
    results = tuple(n.name for n in out)
    spec = EXPORT["stages"][stage]
    if args != tuple(spec["args"]) or results != tuple(spec["results"]):
        fail(f"stage {stage}: takes {args} and gives {results}, the export says "
             f"{tuple(spec['args'])} and {tuple(spec['results'])}; export the plan again")
    call = next(n for n in split.graph.nodes if n.op == "call_module" and n.target == name)
    attrs = {
        arg: fetch_attr(model, str(src.target))
        for arg, src in zip(args, call.args, strict=True)
        if isinstance(src, fx.Node) and src.op == "get_attr"
    }
    return body, attrs


class StageModule(nn.Module):
    """One stage as PyTorch's pipeline expects it: the tensors it receives in, the tensors
    it sends on out (values a later stage reads are relayed); the last stage: the logits."""

    def __init__(self, body, spec, attrs, last):
        super().__init__()
        self.body = body
        self.inputs, self.args = tuple(spec["inputs"]), tuple(spec["args"])
        self.results, self.outputs = tuple(spec["results"]), tuple(spec["outputs"])
        self.last = last
        self.slots = {}
        for i, (arg, value) in enumerate(attrs.items()):
            slot = f"attr_{i}"
            if isinstance(value, nn.Parameter):
                self.register_parameter(slot, value)
            elif isinstance(value, torch.Tensor):
                self.register_buffer(slot, value)
            else:
                setattr(self, slot, value)
            self.slots[arg] = slot
        missing = [a for a in self.args if a not in self.slots and a not in self.inputs]
        if missing:
            fail(f"stage: reads {missing} that no stage sends it")

    def forward(self, *tensors):
        values = dict(zip(self.inputs, tensors, strict=True))
        # Clones: an in-place op (ReLU(inplace=True)) may not touch a received leaf.
        feed = {n: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v
                for n, v in values.items()}
        args = [feed[a] if a in feed else getattr(self, self.slots[a]) for a in self.args]
        produced = dict(zip(self.results, self.body(*args), strict=True))
        outputs = tuple(produced[n] if n in produced else values[n] for n in self.outputs)
        return outputs[0] if self.last else outputs


def mean_cross_entropy(logits, labels):
    """A microbatch's mean cross-entropy; the schedule scales the gradients by 1/M, so a
    step's gradient is that of the mean over the global batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long())


def synthetic_batches(batch, count, seed):
    """pipeplan's synthetic batches: standard normal inputs (token ids below the
    vocabulary for integer inputs) and random labels, from one generator seeded ``seed``."""
    d = EXPORT["data"]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        shape = (batch, *d["input_shape"])
        if d["floating"]:
            x = torch.randn(shape, generator=gen, dtype=getattr(torch, d["dtype"]))
        else:
            x = torch.randint(d["high"], shape, generator=gen)
        out.append((x, torch.randint(d["classes"], (batch, *d["label_shape"]), generator=gen)))
    return out


def make_optimizer(params):
    """The exported optimizer; None for a stage without parameters (a pooling stage)."""
    params = list(params)
    if not params:
        return None
    o = EXPORT["optimizer"]
    if o["kind"] == "adam":
        return torch.optim.Adam(params, lr=o["lr"], weight_decay=o["weight_decay"])
    return torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"],
                           weight_decay=o["weight_decay"])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=EXPORT["steps"], help="training steps")
    p.add_argument("--seed", type=int, default=EXPORT["data"]["seed"],
                   help="seed of the synthetic batches")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo) or cuda (NCCL, the GPU of LOCAL_RANK)")
    p.add_argument("--data", metavar="MODULE:FUNCTION", default=None,
                   help="FUNCTION(batch=, steps=, seed=) -> [(inputs, labels), ...] instead "
                        "of the synthetic batches")
    p.add_argument("--deterministic", action="store_true", help="turn dropout off")
    args = p.parse_args(argv)
    if args.steps < 1:
        fail(f"--steps: must be >= 1, got {args.steps}")
    return args


def train(args, rank, device):
    stages = len(EXPORT["stages"])
    last = rank == stages - 1
    model = build_model()
    if args.deterministic:
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.p = 0.0
    model.train()
    body, attrs = cut(model, rank)
    module = StageModule(body, EXPORT["stages"][rank], attrs, last).to(device)
    stage = PipelineStage(module, rank, stages, device)
    kind = ScheduleGPipe if EXPORT["schedule"] == "gpipe" else Schedule1F1B
    schedule = kind(stage, EXPORT["microbatches"], loss_fn=mean_cross_entropy, scale_grads=True)
    opt = make_optimizer(module.parameters())
    batch = EXPORT["global_batch"]
    if args.data is None:
        batches = synthetic_batches(batch, args.steps, args.seed)
    else:
        batches = list(import_ref(args.data, "--data")(batch=batch, steps=args.steps,
                                                       seed=args.seed))
    for step, (x, y) in enumerate(batches[: args.steps]):
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        inputs = (x.to(device),) if rank == 0 else ()
        if last:
            losses = []
            schedule.step(*inputs, target=y.to(device), losses=losses)
            loss = torch.stack([v.detach() for v in losses]).mean().item()
            print(f"step {step} loss {loss:.8f}", flush=True)
        else:
            schedule.step(*inputs)
        if opt is not None:
            opt.step()


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        fail("RANK: not set; start the script with torchrun, one rank per stage (README.md)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stages = len(EXPORT["stages"])
    if world != stages:
        fail(f"WORLD_SIZE: the plan has {stages} stages, one rank each; got {world} ranks")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        train(args, rank, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

_BUILD_MODEL = {
    "zoo": '''def build_model():
    """The exported model, built by pipeplan's zoo (its weights from the seed)."""
    from pipeplan.models import zoo

    spec = EXPORT["model"]
    model, _ = zoo.build(spec["name"], spec["input_size"], seed=spec["seed"], **spec["options"])
    return model''',
    "torchvision": '''def build_model():
    """The exported torchvision model with the weights pipeplan's zoo gives it: no weights
    downloaded, initialised under ``torch.manual_seed(seed)``."""
    import torchvision

    spec = EXPORT["model"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        return getattr(torchvision.models, spec["name"])(weights=None, **spec["options"])''',
    "code": '''def build_model():
    """The exported model: the user's factory called with its options under
    ``torch.manual_seed(seed)``, as pipeplan builds it."""
    spec = EXPORT["model"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        return import_ref(spec["ref"], "model")(**spec["options"])''',
}
"""The script's ``build_model`` for each kind of model: only a zoo model imports pipeplan."""
