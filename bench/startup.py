"""How long ``pipeplan`` takes to answer: each command run as a shell runs it, in a fresh
process, the median of ``--runs`` runs (default 5).

- ``python -c pass``: the interpreter alone, the floor under every other row;
- ``pipeplan --help``, ``pipeplan validate examples/clusters/local-hetero.yaml`` and
  ``pipeplan simulate`` (a uniform plan of a profile in tests/data): from the start of the
  process to its exit;
- ``pipeplan jobs ls`` against a running service (one ``pipeplan serve --ray-address``,
  started once for these runs), and with no service listening (to the connection error);
- ``pipeplan serve`` until ``GET /healthz`` answers 200: ``--ray-address`` of a cluster that
  is not there (the API process alone: no Ray starts, and ``/healthz`` asks nothing of the
  backend), and with its embedded one-node Ray cluster (``ray start`` on free loopback
  ports, as ``make serve`` runs it). Each service runs on a free loopback port with its
  database, config and state in a temporary folder, and is stopped with SIGTERM by its own
  pid (an embedded cluster stops with it).

The bench itself imports neither torch nor Ray. ``python -m bench.startup [--runs N]``;
the result goes to ``bench/results/startup/<UTC>.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.record import ROOT, BenchRun, display
from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.service.tasks.requests import cluster_spec

HOST = "127.0.0.1"
TOKEN = "startup-bench-token"
PIPEPLAN = str(Path(sys.executable).with_name("pipeplan"))
CLUSTER_FILE = "examples/clusters/local-hetero.yaml"
PROFILE_FILE = "tests/data/alexnet224_local_pipeline.profile.json"
SERVE_TIMEOUT_S = 240.0
POLL_S = 0.02


def free_port() -> int:
    """A free TCP port on loopback (the kernel's pick: never Ray's defaults)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Row:
    """One measured command: what was run, its times (seconds) and exit codes."""

    name: str
    command: str
    times_s: list[float]
    exit_codes: list[int]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        t = self.times_s
        return {
            "name": self.name,
            "command": self.command,
            "runs": len(t),
            "median_s": round(statistics.median(t), 4),
            "min_s": round(min(t), 4),
            "max_s": round(max(t), 4),
            "times_s": [round(x, 4) for x in t],
            "exit_codes": self.exit_codes,
            "note": self.note,
        }


def environment(tmp: Path) -> dict[str, str]:
    """The commands' environment: config and data under ``tmp``, the token given."""
    return {
        **os.environ,
        "PIPEPLAN_API_TOKEN": TOKEN,
        "XDG_CONFIG_HOME": str(tmp / "config"),
        "XDG_DATA_HOME": str(tmp / "data"),
    }


def time_process(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Seconds from starting ``args`` to its exit, and its exit code."""
    t0 = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, check=False)
    return time.perf_counter() - t0, done.returncode


def repeat(name: str, args: list[str], env: dict[str, str], runs: int, note: str = "") -> Row:
    """``args`` run ``runs`` times (after one unmeasured run that warms the file cache)."""
    time_process(args, env)
    times, codes = [], []
    for _ in range(runs):
        seconds, code = time_process(args, env)
        times.append(seconds)
        codes.append(code)
    shown = " ".join(["pipeplan" if a == PIPEPLAN else a for a in args])
    return Row(name, shown.replace(sys.executable, "python"), times, codes, note)


class Service:
    """``pipeplan serve`` on a free loopback port, everything of it under ``tmp``; started
    by :meth:`start` (returns the seconds until ``/healthz`` answered), stopped by its pid."""

    def __init__(self, tmp: Path, embedded: bool) -> None:
        self.tmp, self.port = tmp, free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.args = [PIPEPLAN, "serve", "--port", str(self.port)]
        self.args += ["--db", f"sqlite:///{tmp / 'jobs.db'}"]
        if embedded:
            solo = tmp / "solo.yaml"
            hetero = cluster_spec("local-hetero")
            ClusterSpec("solo", hetero.device_types, (Node("n0", {"fast": 1}),)).save(solo)
            self.args += ["--cluster", str(solo), "--state-dir", str(tmp / "state")]
        else:  # nothing listens there: the API process alone
            self.args += ["--ray-address", f"http://{HOST}:{free_port()}"]
        self.log = tmp / "serve.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        t0 = time.perf_counter()
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.args, cwd=ROOT, env=environment(self.tmp), stdout=out, stderr=out
            )
        with httpx.Client(base_url=self.url, timeout=1.0) as client:
            while time.perf_counter() - t0 < SERVE_TIMEOUT_S:
                if self.process.poll() is not None:
                    raise RuntimeError(f"serve exited {self.process.returncode}: see {self.log}")
                try:
                    if client.get("/healthz").status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
                time.sleep(POLL_S)
        raise RuntimeError(f"serve did not answer in {SERVE_TIMEOUT_S:.0f} s: see {self.log}")

    def stop(self) -> int:
        """SIGTERM to the service's own pid (it stops its embedded cluster), then its code."""
        proc = self.process
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()


def time_serve(name: str, embedded: bool, runs: int, note: str) -> Row:
    times, codes = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="pipeplan-startup-") as tmp:
            service = Service(Path(tmp), embedded)
            try:
                times.append(service.start())
            finally:
                codes.append(service.stop())
    shown = ["pipeplan", "serve", "--port", "PORT", "--db", "sqlite:///TMP/jobs.db"]
    if embedded:
        shown += ["--cluster", "TMP/solo.yaml", "--state-dir", "TMP/state"]
    else:
        shown += ["--ray-address", "http://127.0.0.1:UNUSED"]
    return Row(name, " ".join(shown), times, codes, note)


def measure(runs: int) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipeplan-startup-") as name:
        tmp = Path(name)
        env = environment(tmp)
        rows.append(repeat("interpreter", [sys.executable, "-c", "pass"], env, runs,
                           "the floor under every other row"))  # fmt: skip
        rows.append(repeat("--help", [PIPEPLAN, "--help"], env, runs))
        rows.append(repeat("validate", [PIPEPLAN, "validate", CLUSTER_FILE], env, runs))
        simulate = [PIPEPLAN, "simulate", "--profile", PROFILE_FILE, "--cluster",
                    "local-pipeline", "--uniform", "2", "--batch", "32", "--json"]  # fmt: skip
        rows.append(repeat("simulate", simulate, env, runs, "a uniform 2-stage plan"))
        unused = f"http://{HOST}:{free_port()}"
        row = repeat("jobs ls (no service)", [PIPEPLAN, "jobs", "ls", "--server", unused], env,
                     runs, "to the connection error (exit 2)")  # fmt: skip
        row.command = row.command.replace(unused, "http://127.0.0.1:UNUSED")
        rows.append(row)
        service = Service(tmp, embedded=False)
        try:
            service.start()
            ls = [PIPEPLAN, "jobs", "ls", "--server", service.url]
            row = repeat("jobs ls", ls, env, runs, "against a running service (no jobs)")
            row.command = row.command.replace(service.url, "http://127.0.0.1:PORT")
            rows.append(row)
        finally:
            service.stop()
    rows.append(time_serve("serve (API only)", False, runs,
                           "until /healthz answers; --ray-address of no cluster"))  # fmt: skip
    rows.append(time_serve("serve (embedded cluster)", True, runs,
                           "until /healthz answers; starts a 1-node Ray cluster"))  # fmt: skip
    return rows


def table(rows: list[Row]) -> Table:
    t = Table(title="pipeplan start-up: median of runs, seconds", title_justify="left")
    for col in ("command", "median s", "min s", "max s", "exit", "note"):
        t.add_column(col, justify="left" if col in ("command", "note") else "right")
    for r in rows:
        d = r.to_dict()
        codes = ",".join(sorted({str(c) for c in r.exit_codes}))
        t.add_row(r.name, f"{d['median_s']:.3f}", f"{d['min_s']:.3f}", f"{d['max_s']:.3f}",
                  codes, r.note)  # fmt: skip
    return t


def main(argv: list[str] | None = None, run: Callable[[int], list[Row]] = measure) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each command (median)")
    args = parser.parse_args(argv)
    bench = BenchRun("startup")
    rows = run(args.runs)
    Console().print(table(rows))
    payload = {"runs": args.runs, "rows": [r.to_dict() for r in rows]}
    print(f"wrote {display(bench.write(payload))}")


if __name__ == "__main__":
    main()
