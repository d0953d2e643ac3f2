"""``ray start`` clusters that outlive a command: up, status, connect and discover, down."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import discover
from pipeplan.executor.local import persistent_cluster as persistent
from pipeplan.executor.local.persistent_cluster import (
    start_persistent,
    status_persistent,
    stop_persistent,
)
from pipeplan.executor.runtime import connect

pytestmark = pytest.mark.ray

HETERO = ClusterSpec.load(Path(__file__).parents[2] / "examples/clusters/local-hetero.yaml")
SPEC = ClusterSpec("duo", HETERO.device_types, (Node("n0", {"fast": 1}), Node("n2", {"slow": 2})))


@pytest.mark.timeout(240)
def test_up_status_connect_down(tmp_path: Path) -> None:
    state = start_persistent(SPEC, tmp_path, object_store_mb=100)
    try:
        assert state.address.startswith("127.0.0.1:")
        assert state.dashboard_url.startswith("http://127.0.0.1:")
        assert (tmp_path / persistent.STATE_FILE).exists()
        assert persistent.is_running(state)
        # Ray Jobs' drivers find this cluster in its own temp folder, not Ray's shared one
        recorded = Path(state.temp_dir, "ray_current_cluster").read_text()
        assert state.address in recorded
        assert persistent.read_state(tmp_path).temp_dir == state.temp_dir
        assert status_persistent(tmp_path).count("node_") >= 2
        with pytest.raises(ExecutorError, match="already running"):
            start_persistent(SPEC, tmp_path)
        connect(state.address)
        try:
            found = discover(SPEC)
        finally:
            runtime.shutdown()
        assert {n.name: dict(n.devices) for n in found.nodes} == {
            "n0": {"fast": 1},
            "n2": {"slow": 2},
        }
    finally:
        stopped = stop_persistent(tmp_path)
    assert stopped >= len(state.processes)
    assert not persistent.is_running(state)
    assert not (tmp_path / persistent.STATE_FILE).exists()
    assert not Path(state.temp_dir).exists()
