"""The model flags (``--model``, ``-M``, ``--input-shape``, ``--input-dtype``,
``--example``), declared once and taken by every command that names a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeplan.service.cli import load_command
from pipeplan.service.cli.options import InputDtype, ModelFlags
from tests.service.runner import run_cli as run

MLP = "tests.models.factories:mlp"
COMMANDS = (
    "profile", "run", "plan", "compare", "provision", "train", "export", "submit plan",
    "submit compare", "submit profile", "submit run", "submit train",
)  # fmt: skip
FLAGS = ("model_option", "input_shape", "input_dtype", "example")


def _options(command: str) -> dict[str, Any]:
    names = command.split()
    cmd = load_command(names[0])
    for sub in names[1:]:
        cmd = cmd.commands[sub]  # type: ignore[attr-defined]
    return {p.name: p for p in cmd.params}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_naming_a_model_takes_the_model_flags_as_declared(command: str) -> None:
    reference, options = _options("profile"), _options(command)
    for name in FLAGS:
        mine, theirs = options[name], reference[name]
        assert (mine.opts, mine.help, mine.default) == (theirs.opts, theirs.help, theirs.default)
    assert _options("profile")["model_option"].opts == ["--model-option", "-M"]
    if "model" in options and command not in ("profile", "export"):  # export: no hf: models
        assert "hf:ClassName" in options["model"].help and "package.module:factory" in (
            options["model"].help
        )


def test_flags_become_request_fields_and_source_arguments() -> None:
    flags = ModelFlags(["n_layer=48", "dropout=0.0", "tied=false", "act=gelu"], "3,8,8",
                       InputDtype.INT64, None)  # fmt: skip
    assert flags.fields() == {
        "model_options": {"n_layer": 48, "dropout": 0.0, "tied": False, "act": "gelu"},
        "input_shape": [3, 8, 8],
        "input_dtype": "int64",
        "example": None,
    }
    assert flags.source_kwargs()["input_shape"] == (3, 8, 8)
    assert ModelFlags().fields()["model_options"] == {}


def test_profile_a_factory_with_options(monkeypatch, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "p.json"
    args = ("profile", MLP, "-M", "depth=3", "-M", "classes=5", "--input-shape", "8")
    code, _, err = run(monkeypatch, capsys, *args, "-o", str(out))
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["name"] == MLP and doc["input_shape"] == [8]
    assert [layer["op"] for layer in doc["layers"]] == ["fc", "relu", "fc", "relu", "fc"]


def test_profile_a_factory_with_an_example_function(monkeypatch, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "p.json"
    example = "tests.models.factories:mlp_example"
    code, _, err = run(monkeypatch, capsys, "profile", MLP, "--example", example, "-o", str(out))
    assert code == 0, err
    assert len(json.loads(out.read_text())["layers"]) == 3


def test_plan_a_factory_model(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run(
        monkeypatch, capsys, "plan", "--planner", "dp", "--cluster", "local-hetero",
        "--model", MLP, "--input-shape", "8", "-M", "depth=4", "--batch", "8", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["plan"]["stages"][-1]["layers"][1] == 7  # 4 linear, 3 ReLU


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("profile", MLP, "-M", "depth"), "error: -M: expected key=value with a name for key, "
         "got 'depth'"),
        (("profile", MLP, "--input-shape", "8,x"), "error: --input-shape: expected sizes >= 1 "
         "separated by commas, got '8,x'"),
        (("profile", MLP), f"error: input_shape: model '{MLP}' needs its input's shape"),
        (("profile", "alexnet", "--input-shape", "3,8,8"), "error: input_shape: [3, 8, 8] only "
         "applies to a package.module:factory model"),
        (("profile", "tests.models.factories:nope", "--input-shape", "8"),
         "error: model: module 'tests.models.factories' has no attribute 'nope'"),
        (("plan", "--planner", "dp", "--cluster", "local-hetero", "--model", "hf:GPT-2"),
         "error: model: 'hf:GPT-2' is not hf:ClassName"),
        (("compare", "--cluster", "local-hetero", "--model", MLP, "-M", "=1"),
         "error: -M: expected key=value with a name for key, got '=1'"),
    ],
)  # fmt: skip
def test_bad_model_flags_are_one_line_naming_the_flag(monkeypatch, capsys, args, message) -> None:  # type: ignore[no-untyped-def]
    code, _, err = run(monkeypatch, capsys, *args)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(message), err


def test_a_bad_input_dtype_is_a_usage_error(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    code, _, err = run(monkeypatch, capsys, "profile", MLP, "--input-dtype", "float16")
    assert code == 2 and "float16" in err
