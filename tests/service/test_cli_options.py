"""The planning commands' problem options are declared once (``ProblemFlags``): ``plan``,
``compare``, ``provision`` and ``submit plan|compare`` take the same flags, save where a
command declares one its own way."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from pipeplan.agents.problem import Objective
from pipeplan.core.plan import Schedule
from pipeplan.service.cli import load_command
from pipeplan.service.cli.options import ProblemFlags, problem_options

COMMANDS = ("plan", "compare", "provision", "submit plan", "submit compare")
OWN_WAY = {  # command -> the problem options it declares otherwise (or lacks)
    "provision": {"objective", "min_throughput"},
    "submit plan": {"cluster"},
    "submit compare": {"cluster"},
}


def _options(command: str) -> dict[str, Any]:
    names = command.split()
    cmd = load_command(names[0])
    for sub in names[1:]:
        cmd = cmd.commands[sub]  # type: ignore[attr-defined]
    return {p.name: p for p in cmd.params}


def _described(option: Any) -> tuple[Any, ...]:
    kind = option.type_descriptor.annotation
    return (tuple(option.opts), option.help, option.default, option.required, kind)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_planning_command_takes_the_problem_options_as_declared(command: str) -> None:
    reference, options = _options("plan"), _options(command)
    for f in fields(ProblemFlags):
        if f.name in OWN_WAY.get(command, set()):
            continue
        assert _described(options[f.name]) == _described(reference[f.name]), f.name


def test_the_variants_keep_their_own_declarations() -> None:
    provision, submit = _options("provision"), _options("submit plan")
    assert provision["objective"].default == Objective.COST
    assert not provision["min_throughput"].required and provision["min_throughput"].help == (
        "cost: samples/s to reach"
    )
    assert _options("plan")["cluster"].required
    assert not submit["cluster"].required and submit["cluster"].default is None


def test_a_command_gets_the_options_as_one_problem() -> None:
    seen: list[Any] = []

    @problem_options(fixed={"objective": Objective.COST})
    def command(problem: ProblemFlags, extra: int = 1) -> None:
        seen.append((problem, extra))

    command(cluster="c", model="m", profile=None, input_size=None, min_throughput=2.0,
            batch=8, schedule=Schedule.ONE_F_ONE_B, microbatches=None, seed=3, budget=None,
            seconds=None, extra=5)  # fmt: skip
    [(problem, extra)] = seen
    assert extra == 5
    assert problem == ProblemFlags("c", "m", None, None, Objective.COST, 2.0, 8,
                                   Schedule.ONE_F_ONE_B, None, 3, None, None)  # fmt: skip
