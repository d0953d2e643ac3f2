"""executor.runtime: the one owner of Ray (start, connect, shut down, loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:6380", True),
        ("localhost:6380", True),
        ("http://127.0.0.1:8265", True),
        ("10.0.0.5:6380", False),
        ("raycluster-head-svc:6379", False),
        ("auto", False),
    ],
)
def test_loopback_addresses_are_recognised(address: str, loopback: bool) -> None:
    assert runtime._is_loopback(address) is loopback


def test_start_local_refuses_bad_sizes_before_starting_anything() -> None:
    with pytest.raises(ExecutorError, match="num_cpus: must be >= 1, got 0"):
        runtime.start_local(num_cpus=0)
    with pytest.raises(ExecutorError, match="object_store_memory: Ray needs >= "):
        runtime.start_local(object_store_memory=2**20)
    assert not runtime.is_connected()


def test_connect_in_job_needs_the_job_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ExecutorError, match="RAY_ADDRESS is not set"):
        runtime.connect_in_job()


@pytest.mark.slow
def test_importing_the_executor_has_no_side_effect() -> None:
    env = {k: v for k, v in os.environ.items() if k != runtime.LOOPBACK_ENV}
    code = (
        "import os, pipeplan.executor, pipeplan.executor.pipeline, pipeplan.executor.local_cluster;"
        "import pipeplan.executor.runtime;"
        f"print(os.environ.get({runtime.LOOPBACK_ENV!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


_START_LOCAL = """
import json, ray  # Ray first: it reads its loopback switch now, unset
from pipeplan.executor import runtime
started = runtime.ensure(num_cpus=1)
again = runtime.ensure(num_cpus=1)
nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
gcs = ray.get_runtime_context().gcs_address
runtime.shutdown()
print(json.dumps({"started": started, "again": again, "nodes": nodes, "gcs": gcs,
                  "connected": runtime.is_connected()}))
"""


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_start_local_binds_loopback_even_when_ray_was_imported_first(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (runtime.LOOPBACK_ENV, "RAY_ADDRESS")}
    env["HOME"] = str(tmp_path)  # a token of its own
    out = subprocess.run(
        [sys.executable, "-c", _START_LOCAL],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["started"] is True and got["again"] is False
    assert got["nodes"] == ["127.0.0.1"]
    assert got["gcs"].startswith("127.0.0.1:")
    assert got["connected"] is False
