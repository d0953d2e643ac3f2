"""``devices: free`` (API.md, "The queue"): a plan job planned on the devices no reservation
holds when it is submitted: its cluster narrowed by what the live cluster has free, its
result naming the devices it assumed; 422 naming ``devices`` when nothing is free or the
service cannot tell."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from pipeplan.core.cluster import ClusterSpec
from pipeplan.service.api.backend import ClusterState, NodeState
from pipeplan.service.api.free_devices import free_cluster
from pipeplan.service.cli.job import run_job
from pipeplan.service.tasks.requests import RequestError, cluster_spec
from tests.service.api.conftest import FakeBackend
from tests.service.api.test_events import JOB, TOKEN, JobStub

HETERO = cluster_spec("local-hetero")


def _state(in_use: dict[str, dict[str, float]]) -> ClusterState:
    """The live cluster of local-hetero with ``in_use[node][type]`` devices held."""
    return ClusterState(
        tuple(
            NodeState(
                node.name,
                f"id-{node.name}",
                True,
                devices={t: float(n) for t, n in node.devices.items()},
                devices_in_use=in_use.get(node.name, {}),
            )
            for node in HETERO.nodes
        )
    )


def _counts(cluster: ClusterSpec) -> dict[str, dict[str, int]]:
    return {n.name: dict(n.devices) for n in cluster.nodes}


def test_the_cluster_is_cut_to_what_is_free_per_node_and_type() -> None:
    everything = _counts(HETERO)
    assert _counts(free_cluster(HETERO, _state({}))) == everything
    node = next(n for n in HETERO.nodes if sum(n.devices.values()) >= 2)
    dtype, count = next(iter(node.devices.items()))
    held = {node.name: {dtype: float(count)}}
    narrowed = _counts(free_cluster(HETERO, _state(held)))
    others = {k: v for k, v in node.devices.items() if k != dtype}
    assert narrowed.get(node.name, {}) == others
    assert {k: v for k, v in narrowed.items() if k != node.name} == {
        k: v for k, v in everything.items() if k != node.name
    }
    all_held = {n.name: {t: float(c) for t, c in n.devices.items()} for n in HETERO.nodes}
    with pytest.raises(RequestError, match="devices: 'free', but no device"):
        free_cluster(HETERO, _state(all_held))


SPEC: dict[str, Any] = {
    "cluster": "local-hetero",
    "model": "alexnet",
    "planner": "dp",
    "devices": "free",
}


def test_a_free_devices_job_is_stored_with_its_cluster_narrowed(
    app_client: TestClient, fake_backend: FakeBackend
) -> None:
    node = HETERO.nodes[0]
    fake_backend.cluster = _state({node.name: {t: float(n) for t, n in node.devices.items()}})
    r = app_client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC})
    assert r.status_code == 201, r.text
    stored = ClusterSpec.from_dict(r.json()["spec"]["cluster"])
    assert node.name not in {n.name for n in stored.nodes}
    assert len(stored.device_ids) == len(HETERO.device_ids) - sum(node.devices.values())
    fake_backend.cluster = ClusterState(error="Ray dashboard at x: down")
    r = app_client.post("/v1/jobs", json={"kind": "plan", "spec": SPEC})
    assert r.status_code == 422 and r.json()["detail"].startswith("devices: 'free': cannot tell")
    plain = {k: v for k, v in SPEC.items() if k != "devices"}
    assert app_client.post("/v1/jobs", json={"kind": "plan", "spec": plain}).status_code == 201


def test_the_result_names_the_devices_it_assumed() -> None:
    narrowed = free_cluster(
        HETERO, _state({HETERO.nodes[0].name: dict.fromkeys(HETERO.nodes[0].devices, 99.0)})
    )
    spec = SPEC | {"cluster": narrowed.to_dict(), "model": "digits_cnn", "batch": 8}
    stub = JobStub("plan", spec)
    assert run_job(JOB, "http://service", TOKEN, transport=httpx.MockTransport(stub)) == 0
    result = stub.stored[-1]["data"]
    assert result["assumed_devices"] == list(narrowed.device_ids)  # type: ignore[index]
    used = {d for s in result["plan"]["stages"] for d in s["devices"]}  # type: ignore[index]
    assert used <= set(narrowed.device_ids)
