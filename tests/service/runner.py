"""Run the ``pipeplan`` CLI in-process, as a shell would, and collect what it printed."""

from __future__ import annotations

import sys

import pytest

from pipeplan.service.cli import main


def run_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """``pipeplan ARGS...``: exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["pipeplan", *args])
    with pytest.raises(SystemExit) as e:
        main()
    cap = capsys.readouterr()
    return int(e.value.code or 0), cap.out, cap.err
