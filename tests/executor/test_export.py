"""``pipeplan export --format torchrun``: the script cuts as pipeplan cuts, draws pipeplan's
batches and, run under torchrun, trains to the single-process reference's losses."""

from __future__ import annotations

import ast
import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from pipeplan.core.errors import PipeplanError, PlanError
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor.data import synthetic_batches
from pipeplan.executor.export import README, SCRIPT, export_torchrun
from pipeplan.executor.model import ModelSource, OptimizerConfig, train_single_process
from pipeplan.executor.partition import partition
from pipeplan.models import zoo
from pipeplan.service.cli import app

DIGITS = ModelSource("digits_cnn", 8, seed=3)
GPT = ModelSource(
    "gpt",
    4,
    seed=2,
    options={"n_layer": 1, "d_model": 8, "n_head": 2, "n_ctx": 8, "vocab_size": 16, "dropout": 0.0},
)
FACTORY = "tests.executor.test_export:tiny_factory"


def tiny_factory(width: int = 4) -> nn.Module:
    """A user's model factory (``package.module:factory``)."""
    return nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 5))


def plan(
    bounds: list[int], microbatches: list[int], schedule: str = "gpipe", batch: int = 8
) -> Plan:
    stages = [
        Stage((a, b), (f"n0/cpu:{i}",), mb)
        for i, (a, b, mb) in enumerate(zip(bounds[:-1], bounds[1:], microbatches, strict=True))
    ]
    return Plan(batch, tuple(stages), schedule)


DIGITS_BOUNDS = [0, 3, 5, 8]
GPT_BOUNDS = [0, 5, 9, 18]
"""Stage 1 relays the residual (``drop``) that stage 2 adds."""
DIGITS_PLAN = plan(DIGITS_BOUNDS, [2, 2, 2])


def imports_of(script: Path) -> set[str]:
    """The top-level packages the script's code imports (anywhere in it)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def load_script(out: Path) -> dict[str, Any]:
    """The written script's globals, its ``main`` not run."""
    return runpy.run_path(str(out / SCRIPT), run_name="exported")


# --- the writer -------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "bounds"), [(DIGITS, DIGITS_BOUNDS), (GPT, GPT_BOUNDS)])
def test_the_script_cuts_as_pipeplan_and_its_stages_chain_to_the_model(
    tmp_path: Path, source: ModelSource, bounds: list[int]
) -> None:
    written = export_torchrun(plan(bounds, [2, 2, 2]), source, tmp_path, seed=1, steps=2)
    assert written == [tmp_path / SCRIPT, tmp_path / README]
    assert "pipeplan" in imports_of(tmp_path / SCRIPT)  # a zoo model of pipeplan's own
    script = load_script(tmp_path)
    model = script["build_model"]()
    reference, example = source.build()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    part = partition(reference, example, bounds)
    stages = []
    for s, graph in enumerate(part.stages):
        body, attrs = script["cut"](model, s)
        nodes = [n.name for n in body.graph.nodes]
        assert nodes == [n.name for n in graph.module.graph.nodes]
        assert set(attrs) == set(graph.attrs)
        stage = script["EXPORT"]["stages"][s]
        assert (stage["inputs"], stage["outputs"]) == (list(graph.inputs), list(graph.outputs))
        stages.append(script["StageModule"](body, stage, attrs, s == len(part.stages) - 1))
    x = synthetic_batches(example, tuple(model(example).shape), 3, 1)[0][0]
    values: Any = (x,)
    for stage_module in stages:
        values = stage_module(*values)
        values = values if isinstance(values, tuple) else (values,)
    torch.testing.assert_close(values[0], model(x), rtol=0, atol=0)


@pytest.mark.parametrize("source", [DIGITS, GPT])
def test_the_scripts_batches_are_pipeplans(tmp_path: Path, source: ModelSource) -> None:
    bounds = GPT_BOUNDS if source is GPT else DIGITS_BOUNDS
    export_torchrun(plan(bounds, [2, 2, 2]), source, tmp_path, seed=7, steps=3)
    script = load_script(tmp_path)
    model, example = source.build()
    model.eval()
    with torch.no_grad():
        output_shape = tuple(model(example).shape)
    expected = synthetic_batches(example, output_shape, 8, 3, seed=7)
    for (x, y), (ex, ey) in zip(script["synthetic_batches"](8, 3, 7), expected, strict=True):
        assert torch.equal(x, ex) and x.dtype == ex.dtype
        assert torch.equal(y, ey) and y.dtype == ey.dtype


def test_a_model_that_traces_to_other_nodes_stops_the_script(tmp_path: Path) -> None:
    export_torchrun(DIGITS_PLAN, DIGITS, tmp_path, seed=0, steps=1)
    script = load_script(tmp_path)
    other, _ = ModelSource("gpt", 4, options=dict(GPT.options)).build()
    with pytest.raises(SystemExit) as e:
        script["cut"](other, 0)
    assert e.value.code == 2


def test_a_torchvision_model_is_built_without_pipeplan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = ModelSource("alexnet", 64, seed=4, options={"num_classes": 3})
    export_torchrun(plan([0, 6, 21], [4, 4]), source, tmp_path, seed=0, steps=1)
    assert "pipeplan" not in imports_of(tmp_path / SCRIPT)
    script = load_script(tmp_path)
    monkeypatch.setitem(sys.modules, "pipeplan", None)  # importing it now fails
    model = script["build_model"]()
    monkeypatch.undo()
    reference, _ = source.build()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_factory_model_is_imported_from_the_users_module(tmp_path: Path) -> None:
    pytest.importorskip("pipeplan.models.spec", reason="ModelSource builds factories")
    source = ModelSource(FACTORY, seed=5, options={"width": 6}, input_shape=(3,))
    export_torchrun(plan([0, 1, 3], [2, 2], batch=4), source, tmp_path, seed=0, steps=1)
    assert "pipeplan" not in imports_of(tmp_path / SCRIPT)
    model = load_script(tmp_path)["build_model"]()
    reference, _ = source.build()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("the_plan", "feature"),
    [
        (plan([0, 3, 5, 8], [2, 4, 2]), "unequal microbatches [2, 4, 2]"),
        (plan([0, 3, 5, 8], [3, 3, 3]), "microbatch 3 does not divide the global batch 8"),
        (
            Plan(8, (Stage((0, 4), ("n0/cpu:0", "n0/cpu:1"), 2), Stage((4, 8), ("n0/cpu:2",), 2))),
            "replicated stages [0]",
        ),
        (plan([0, 3, 5, 8], [4, 4, 4], "1f1b"), "1F1B with 2 microbatches for 3 stages"),
    ],
)
def test_a_plan_pipelining_cannot_run_is_refused_naming_the_feature(
    tmp_path: Path, the_plan: Plan, feature: str
) -> None:
    with pytest.raises(PlanError) as e:
        export_torchrun(the_plan, DIGITS, tmp_path / "out", seed=0, steps=1)
    message = str(e.value)
    assert message.startswith("export: torch.distributed.pipelining cannot run this plan: ")
    assert feature in message and "\n" not in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("source", "steps", "field"),
    [
        (ModelSource.custom(nn.Linear(2, 2), torch.zeros(1, 2)), 1, "module object"),
        (ModelSource("hf:GPT2LMHeadModel"), 1, "'hf:GPT2LMHeadModel': Hugging Face"),
        (DIGITS, 0, "export.steps"),
        (ModelSource("digits_cnn", 8, options={"num_classes": [1]}), 1, "'num_classes'"),
    ],
)
def test_a_model_or_setting_the_script_cannot_take_is_refused(
    tmp_path: Path, source: ModelSource, steps: int, field: str
) -> None:
    with pytest.raises(PipeplanError, match=re.escape(field)):
        export_torchrun(DIGITS_PLAN, source, tmp_path, seed=0, steps=steps)


# --- the command ------------------------------------------------------------------------------


def test_the_command_writes_the_script_and_says_how_to_run_it(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    DIGITS_PLAN.save(plan_file)
    out = tmp_path / "out"
    args = ["export", "--plan", str(plan_file), "--model", "digits_cnn", "--input-size", "8"]
    args += ["--format", "torchrun", "--out", str(out), "--steps", "3", "--optimizer", "adam"]
    result = CliRunner().invoke(app, [*args, "--lr", "0.01", "--seed", "9"])
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == [str(out / SCRIPT), str(out / README)]
    assert "torchrun --nproc-per-node 3" in result.stderr
    export = load_script(out)["EXPORT"]
    assert export["optimizer"]["kind"] == "adam" and export["optimizer"]["lr"] == 0.01
    assert (export["steps"], export["data"]["seed"], export["model"]["seed"]) == (3, 9, 9)


def test_the_command_refuses_a_plan_in_one_line(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    plan([0, 3, 5, 8], [2, 4, 2]).save(plan_file)
    args = ["export", "--plan", str(plan_file), "--model", "digits_cnn", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: export: torch.distributed.pipelining cannot run this plan: unequal "
        "microbatches [2, 4, 2]"
    ]


# --- under torchrun ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def torchrun(out: Path, stages: int, steps: int) -> list[float]:
    """Run the script with one rank per stage on loopback gloo; the printed losses."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stages)]
    command += ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, SCRIPT, "--steps", str(steps)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.findall(r"^step (\d+) loss (\S+)$", done.stdout, re.MULTILINE)
    assert [int(i) for i, _ in found] == list(range(steps)), done.stdout
    return [float(v) for _, v in found]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("source", "bounds", "schedule", "optimizer"),
    [
        (DIGITS, DIGITS_BOUNDS, "gpipe", OptimizerConfig("sgd", lr=0.1, momentum=0.5)),
        (DIGITS, DIGITS_BOUNDS, "1f1b", OptimizerConfig("adam", lr=0.01)),
        (GPT, GPT_BOUNDS, "1f1b", OptimizerConfig("sgd", lr=0.1)),
    ],
    ids=["digits-gpipe-sgd", "digits-1f1b-adam", "gpt-1f1b-sgd"],
)
def test_torchrun_trains_to_the_single_process_losses(
    tmp_path: Path,
    source: ModelSource,
    bounds: list[int],
    schedule: str,
    optimizer: OptimizerConfig,
) -> None:
    the_plan = plan(bounds, [2, 2, 2], schedule)
    export_torchrun(the_plan, source, tmp_path, optimizer=optimizer, seed=1, steps=2)
    model, example = source.build()
    model.eval()
    with torch.no_grad():
        output_shape = tuple(model(example).shape)
    batches = synthetic_batches(example, output_shape, 8, 2, seed=1)
    reference = train_single_process(source, batches, optimizer).losses
    assert torchrun(tmp_path, 3, 2) == pytest.approx(reference, abs=1e-5)


def test_the_zoo_lists_the_torchvision_models_export_builds_itself() -> None:
    from pipeplan.executor.export import TORCHVISION_EXTRA

    assert set(TORCHVISION_EXTRA) == {n for n in zoo.MODELS if n not in ("gpt", "digits_cnn")}
