"""Where a benchmark run came from: one JSON file per run, with its provenance.

Every benchmark writes ``bench/results/<bench>/<UTC date-time>.json``; the file holds the
run's own payload beside ``provenance``: the git commit (and whether the tree had
uncommitted changes), the machine (cores, memory, CPU model, Python and torch versions), the
load average before and after, the wall time and the command line (paths inside the
checkout written relative to it). Old runs stay as files; the newest is the one a page
quotes (:func:`newest`), and ``python -m bench.index`` lists them in each folder's README.

A variant of a benchmark (``--quick``, another cluster) is a benchmark of its own name
(``fidelity_quick``), so that the newest file of a folder is always comparable with the
ones before it. A figure a run draws goes beside its JSON, with the same stem.

    run = BenchRun("runtime")  # the load and the clock, before the measuring
    ...measure...
    path = run.write({"rows": rows})
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> dict[str, Any]:
    """The checkout's commit and whether it had uncommitted changes (``dirty``)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain")),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb() -> float:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return round(pages * size / 1e9, 1)
    except (ValueError, OSError):
        return 0.0


def machine() -> dict[str, Any]:
    """Cores, memory, CPU model and the versions that shape a measurement."""
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")  # only when the bench itself imported it
    if torch is not None:
        info["torch"] = torch.__version__
    return info


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def utc_stamp(when: dt.datetime | None = None) -> str:
    """``2026-11-28T07-05-09Z``: sortable, and a valid file name everywhere."""
    when = when or dt.datetime.now(dt.UTC)
    return when.strftime("%Y-%m-%dT%H-%M-%SZ")


class BenchRun:
    """One run of benchmark ``name``: captures the load before and after and the wall time,
    and writes the result file (:meth:`write`)."""

    def __init__(self, name: str, argv: list[str] | None = None) -> None:
        self.name = name
        self.argv = list(sys.argv if argv is None else argv)
        self.started = dt.datetime.now(dt.UTC)
        self.load_before = load_average()
        self._t0 = time.perf_counter()

    def provenance(self) -> dict[str, Any]:
        return {
            "bench": self.name,
            "started_utc": self.started.isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - self._t0, 2),
            "command": command(self.argv, self.name),
            "git": git_commit(),
            "machine": machine(),
            "load_before": self.load_before,
            "load_after": load_average(),
        }

    def path(self, results: Path = RESULTS) -> Path:
        """Where :meth:`write` puts the run: ``results/<name>/<UTC start>.json``."""
        return results / self.name / f"{utc_stamp(self.started)}.json"

    def write(
        self,
        payload: dict[str, Any],
        results: Path = RESULTS,
        out: Path | None = None,
        indent: int = 2,
    ) -> Path:
        """``payload`` and ``provenance`` into :meth:`path` (or ``out``, a file named on the
        command line); returns where."""
        path = Path(out) if out is not None else self.path(results)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"provenance": self.provenance(), **payload}
        path.write_text(json.dumps(doc, indent=indent, default=str) + "\n")
        return path


def command(argv: list[str], name: str) -> str:
    """The command line as ``python -m bench.MODULE ARGS``, paths inside the checkout relative
    to it (so that a result file names no folder of the machine that ran it)."""
    script = Path(argv[0]) if argv else Path()
    module = f"bench.{script.stem}" if script.parent.name == "bench" else f"bench.{name}"
    root = f"{ROOT}{os.sep}"
    return " ".join(["python -m", module, *(a.replace(root, "") for a in argv[1:])])


def display(path: Path) -> str:
    """``path`` relative to the checkout where it is inside it (what a bench prints)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def newest(name: str, results: Path = RESULTS) -> Path | None:
    """The newest result file of benchmark ``name``, if any."""
    files = sorted((results / name).glob("*.json"))
    return files[-1] if files else None
