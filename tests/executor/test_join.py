"""A machine joins a running cluster over the network: ``pipeplan cluster join`` / ``leave``.

One cluster for the module, on two addresses of this machine: a ``ray start`` head on
127.0.0.1 (spec node n0) and a node that joins it from 127.0.0.3 (spec node n1) with
``pipeplan cluster join`` (in-process through typer's runner; the node itself is a ``ray
start`` process). The driver connects to the head's address as ``--address`` does. A 2-stage
plan runs across the two nodes; a spec that calls a type CUDA is refused on these GPU-less
nodes before any actor starts; last, the joined node leaves in the middle of a run, which
ends with an error naming the stage, device and node.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch
from typer.testing import CliRunner

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError, StageFailedError
from pipeplan.executor.join import default_join_dir, joined_nodes, leave, parse_address, route_ip
from pipeplan.executor.live_cluster import live_nodes
from pipeplan.executor.local.persistent_cluster import start_persistent, stop_persistent
from pipeplan.executor.measured_profile import measure_profile
from pipeplan.executor.model import ModelSource
from pipeplan.executor.pipeline import Pipeline, RunConfig, run
from pipeplan.service.cli import app
from tests.executor.actors import stage_workers_alive

pytestmark = pytest.mark.ray

HETERO = ClusterSpec.load(Path(__file__).parents[2] / "examples/clusters/local-hetero.yaml")
SPEC = ClusterSpec(
    "joined",
    {t: HETERO.device_types[t] for t in ("fast", "slow")},
    (Node("n0", {"fast": 1}), Node("n1", {"slow": 1})),
)
HEAD_SPEC = replace(SPEC, nodes=SPEC.nodes[:1])
NODE_IP = "127.0.0.3"
DIGITS = ModelSource("digits_cnn", 8, seed=0)
PLAN = Plan(16, (Stage((0, 3), ("n0/fast:0",), 8), Stage((3, 8), ("n1/slow:0",), 4)))


def cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Where ``cluster join`` records its node (XDG_CACHE_HOME of the CLI calls)."""
    return {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}


@pytest.fixture(scope="module")
def joined(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Iterator[str]:
    """The head (n0, 127.0.0.1) with n1 joined from 127.0.0.3; yields the head's address
    with the driver connected to it."""
    head_dir = tmp_path_factory.mktemp("head")
    spec_file = head_dir / "spec.json"
    spec_file.write_text(json.dumps(SPEC.to_dict()))
    head = start_persistent(HEAD_SPEC, head_dir, object_store_mb=100)
    join_dir = Path(env["XDG_CACHE_HOME"]) / "pipeplan" / "joined"
    try:
        code, out = cli(
            env,
            *("cluster", "join", "--address", head.address, "--node", "n1"),
            *("--spec", str(spec_file), "--node-ip", NODE_IP),
            *("--object-store-mb", "100", "--num-cpus", "1"),
        )
        assert code == 0, out
        assert f"node 'n1' joined the cluster at {head.address} from {NODE_IP}" in out
        runtime.connect(head.address)
        try:
            yield head.address
        finally:
            runtime.shutdown()
    finally:
        leave(state_dir=join_dir, grace_s=5.0)
        stop_persistent(head_dir, grace_s=5.0)


# --- without a cluster ---------------------------------------------------------------------------


def test_addresses_are_checked_and_routed() -> None:
    assert parse_address("10.0.0.7:6380") == ("10.0.0.7", 6380)
    assert parse_address("[fd00::2]:6380") == ("fd00::2", 6380)
    for bad in ("10.0.0.7", ":6380", "head:port", "head:70000"):
        with pytest.raises(ValueError, match=f"address: expected HOST:PORT .* got '{bad}'"):
            parse_address(bad)
    assert route_ip("127.0.0.1:6380") == "127.0.0.1"


def test_join_refuses_bad_requests_before_starting_anything(env: dict[str, str]) -> None:
    code, out = cli(env, "cluster", "join", "--address", "127.0.0.1:1", "--node", "n9")
    assert code == 2 and "--spec" in out
    args = ("cluster", "join", "--address", "127.0.0.1:9", "--spec", "local-hetero")
    code, out = cli(env, *args, "--node", "n9")
    assert code == 2 and "node: 'n9' is not a node of cluster 'local-hetero'" in out
    code, out = cli(env, *args, "--node", "n0", "--node-ip", "here")
    assert code == 2 and "node_ip: expected an IP address of this machine, got 'here'" in out
    code, out = cli(env, "cluster", "leave", "--node", "n7")
    assert code == 2 and "node 'n7': not joined from this machine" in out


# --- on the joined cluster -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_joined_node_advertises_its_devices_from_its_address(joined: str) -> None:
    nodes = {n.name: n for n in live_nodes()}
    assert {name: dict(n.devices) for name, n in nodes.items()} == {
        "n0": {"fast": 1},
        "n1": {"slow": 1},
    }
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert addresses[nodes["n0"].node_id] == "127.0.0.1"
    assert addresses[nodes["n1"].node_id] == NODE_IP
    assert nodes["n1"].gpus == 0  # the spec gives n1 no CUDA device: no GPU advertised


@pytest.mark.timeout(120)
def test_a_plan_runs_across_the_head_and_the_joined_node(joined: str) -> None:
    m = run(PLAN, DIGITS, SPEC, RunConfig(steps=1, warmup=1, emulate=False, timeout_s=60))
    assert [p.node for p in m.placement] == ["n0", "n1"] and m.steps == 1
    assert all(loss == loss for loss in m.losses)  # not NaN


@pytest.mark.timeout(60)
def test_a_cuda_type_on_a_node_without_gpus_is_refused_before_any_actor(joined: str) -> None:
    cuda = replace(HETERO.device_types["fast"], accelerator="cuda")
    spec = replace(SPEC, device_types={**SPEC.device_types, "fast": cuda})
    before = stage_workers_alive()
    with pytest.raises(ExecutorError, match="device type fast needs CUDA but node n0 has none"):
        Pipeline(PLAN, DIGITS, spec).start()
    with pytest.raises(ExecutorError, match="device type fast needs CUDA but node n0 has none"):
        measure_profile(DIGITS, spec, device_types=["fast"])
    assert stage_workers_alive() == before


@pytest.mark.timeout(150)
def test_a_node_that_leaves_mid_run_ends_it_naming_stage_device_node(
    joined: str, env: dict[str, str]
) -> None:
    """Runs last: the joined node is gone afterwards."""
    join_dir = Path(env["XDG_CACHE_HOME"]) / "pipeplan" / "joined"
    (recorded,) = joined_nodes(join_dir)
    assert recorded.name == "n1" and recorded.running and recorded.node_ip == NODE_IP
    x, y = torch.randn(16, 1, 8, 8), torch.randint(10, (16,))
    started = time.monotonic()
    config = RunConfig(emulate=True, timeout_s=60)
    with pytest.raises(StageFailedError) as err, Pipeline(PLAN, DIGITS, SPEC, config) as pipe:
        pipe.step(x, y)
        leaver = threading.Timer(0.5, leave, args=("n1", join_dir), kwargs={"grace_s": 5.0})
        leaver.start()
        try:
            while time.monotonic() - started < 100:
                pipe.step(x, y)
        finally:
            leaver.join()
    e = err.value
    assert (e.stage, e.device, e.node) == (1, "n1/slow:0", "n1")
    assert "stage 1 replica 0 on device n1/slow:0 (node n1)" in str(e) and "died" in str(e)
    assert time.monotonic() - started < 90
    assert not recorded.running and joined_nodes(join_dir) == []
    code, out = cli(env, "cluster", "leave")
    assert code == 0 and "no node has joined from this machine" in out
    assert default_join_dir() != join_dir  # the test never touched the user's records
