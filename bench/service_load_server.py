"""The service processes of ``bench.service_load``: the real app under uvicorn with a bench
backend (run as ``python -m bench.service_load_server``), and :class:`ServerProcess`, which
starts one such process (or ``pipeplan serve``), waits for it to answer, kills it with
SIGKILL or stops it with SIGTERM, always by its own pid.

The bench backend accepts every submission and starts nothing: it appends ``JOB_ID TOKEN``
to a file (so that the bench can post a job's events with the job's own token) and says
every job is running (so the reconcile leaves them be, across restarts too).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from pydantic import SecretStr

from pipeplan.service.api.app import create_app
from pipeplan.service.api.backend import BackendState, BackendStatus, Submission
from pipeplan.service.api.settings import Settings

HOST = "127.0.0.1"
TOKEN_ENV = "PIPEPLAN_API_TOKEN"


def free_port() -> int:
    """A free TCP port on loopback (the kernel's pick: never Ray's defaults by design)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class BenchBackend:
    """The jobs backend protocol for the bench: accepts, records the token, runs nothing."""

    tokens_file: Path

    def submit(self, submission: Submission) -> str:
        with open(self.tokens_file, "a") as f:
            f.write(f"{submission.job_id} {submission.job_token}\n")
        return submission.job_id

    def stop(self, job_id: str) -> None:
        return None

    def status(self, job_id: str) -> BackendStatus:
        return BackendStatus(BackendState.RUNNING)

    def logs(self, job_id: str) -> str:
        return ""

    def ready(self) -> str | None:
        return None


def serve(db: str, port: int, tokens_file: Path) -> None:
    """The app on uvicorn, configured as ``pipeplan serve`` runs it, until killed."""
    settings = Settings(host=HOST, port=port, db=db, api_token=SecretStr(os.environ[TOKEN_ENV]))
    app = create_app(settings, backend=BenchBackend(tokens_file))
    uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="info")).run()


@dataclass
class ServerProcess:
    """One service process: ``argv`` run with ``env``, its output appended to ``log``."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    port: int
    token: str
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def client(self, timeout_s: float = 30.0) -> httpx.Client:
        """A client of the service sending the API token."""
        auth = {"Authorization": f"Bearer {self.token}"}
        return httpx.Client(base_url=self.url, headers=auth, timeout=timeout_s)

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=out)

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until ``/healthz`` answers 200; raises if the process ends or times out."""
        assert self.proc is not None
        t0 = time.perf_counter()
        with httpx.Client(base_url=self.url, timeout=2.0) as c:
            while time.perf_counter() - t0 < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"service exited {self.proc.returncode}:\n{self.tail()}")
                try:
                    if c.get("/healthz").status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"service did not answer in {timeout_s:.0f} s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL, no shutdown of anything (``kill -9``), and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (a clean shutdown), SIGKILL after ``timeout_s``; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def bench_server(tmp: Path, db: str, token: str) -> ServerProcess:
    """A (not yet started) bench service on a free port, on database ``db``."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.service_load_server", "--db", db, "--port", str(port)]
    argv += ["--tokens", str(tmp / "tokens.txt")]
    env = {**os.environ, TOKEN_ENV: token}
    return ServerProcess(argv, env, tmp / "service.log", port, token)


def job_tokens(tmp: Path) -> dict[str, str]:
    """Every job token the bench backend of ``tmp`` was handed, by job id."""
    path = tmp / "tokens.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return dict(line.split(" ", 1) for line in lines if " " in line)


def main() -> None:
    ap = argparse.ArgumentParser(description="the app with the bench backend (bench only)")
    ap.add_argument("--db", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokens", type=Path, required=True)
    a = ap.parse_args()
    serve(a.db, a.port, a.tokens)


if __name__ == "__main__":
    main()
