"""The lazy ``pipeplan`` group: ``--help`` lists every command from its table, and a command's
module is imported only when that command runs (tests/test_architecture.py checks that the
light commands start without torch or Ray)."""

from __future__ import annotations

import importlib

import pytest
import typer
from typer.main import get_group

from pipeplan.service.cli import COMMANDS, load_command
from tests.service.runner import run_cli as run


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_table_lists_each_command_with_its_own_help(name: str) -> None:
    command = load_command(name)
    assert command.name == name
    assert _first_paragraph(command.short_help or command.help or "") == COMMANDS[name][1]


def test_every_command_a_module_registers_is_in_the_table() -> None:
    for target in {t for t, _ in COMMANDS.values()}:
        module_name, _, attr = target.partition(":")
        app = typer.Typer()
        getattr(importlib.import_module(module_name), attr)(app)
        for name in get_group(app).commands:
            assert COMMANDS[name][0] == target, name


def test_help_lists_every_command_in_the_table_order(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = run(monkeypatch, capsys, "--help")
    assert code == 0
    listed = [line.split()[1] for line in out.splitlines() if line.startswith("│ ") and
              len(line.split()) > 1 and line.split()[1] in COMMANDS]  # fmt: skip
    assert listed == list(COMMANDS)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("simlate",), "error: No such command 'simlate'. Did you mean 'simulate'?"),
        (("jobs", "lss"), "error: No such command 'lss'. Did you mean 'ls'?"),
    ],
)
def test_a_mistyped_command_is_one_line_with_a_suggestion(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, args, message
) -> None:
    code, _, err = run(monkeypatch, capsys, *args)
    assert code == 2
    assert err.strip() == message
