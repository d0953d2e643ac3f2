"""The ``deploy render`` use-case: the parts of a deployment that depend on the cluster spec.

From one cluster spec (DESIGN.md, "Data formats") it writes

- for Kubernetes (``k8s/``): the KubeRay ``RayCluster`` (a head without devices and **one
  worker group per device type**), a ``ConfigMap`` holding the spec, and a
  ``kustomization.yaml`` listing both, for an overlay of ``deploy/k8s`` to include;
- for Docker Compose (``compose/``): ``ray-cluster.yaml``, a Ray head and **one Ray node per
  spec node**, and ``cluster.yaml``, the spec the head mounts.

A Ray node advertises its devices as ``device:TYPE`` resources; the names come from
:mod:`executor.live_cluster` (the functions the local clusters use), so a deployment and the
executor cannot disagree on them. The two targets differ where their platforms do:

- A KubeRay worker group is a set of identical pods, so every pod of a group advertises the
  same devices: the group of type ``T`` has pods of ``g`` devices, ``g`` the greatest common
  divisor of ``T``'s count on the nodes holding it (when every such node holds the same
  count, one pod per spec node, as in every preset), and as many pods as make ``T``'s total.
  A node holding several types becomes one pod per type. Pods carry no ``pipeplan_node:NAME``
  marker (pods of a group cannot differ): the executor names them ``node-<id>``
  (:func:`executor.live_cluster.discover`). GPU groups (a type with ``accelerator: cuda``)
  request ``nvidia.com/gpu``; with ``node_selectors`` every group asks for Kubernetes nodes
  labelled ``device.pipeplan.io/<type>=true``.
- Compose runs every container on one host, so each spec node is one container with its
  marker, and its GPUs are the host's, numbered in spec order.

A node's ``count: N`` (DESIGN.md: ``N`` identical nodes ``NAME-0 .. NAME-(N-1)``) is expanded
before anything else, so a catalogue deploys as the nodes it stands for.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from pipeplan.core import _io
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.executor.live_cluster import device_resource, node_resources
from pipeplan.service.api.settings import Settings
from pipeplan.service.tasks.common import PRESETS_DIR, ClusterRef, Document, Request, presets

Manifest = dict[str, Any]

# --- what the hand-written parts of deploy/ rely on (tests/deploy checks they agree) --------

RAY_VERSION = metadata.version("ray")
"""The installed Ray, which pyproject pins: every image and ``rayVersion`` must run it."""
IMAGE_TAG = metadata.version("pipeplan")
VENV = "/opt/pipeplan/venv"
"""Where the images install pipeplan (``pipeplan`` is ``VENV/bin/pipeplan`` in every image:
the service submits Ray Jobs with that absolute path)."""
USER_ID = 1000
"""The images' unprivileged user and group."""

RAYCLUSTER = "pipeplan"
"""The ``RayCluster``'s name; KubeRay names its head Service ``<name>-head-svc``."""
HEAD_SERVICE = f"{RAYCLUSTER}-head-svc"
RAY_SECRET = "pipeplan-ray-token"
RAY_SECRET_KEY = "auth_token"
"""KubeRay's key for the token in the Secret ``authOptions.secretName`` names."""
SPEC_CONFIGMAP = "pipeplan-cluster-spec"
SPEC_DIR = "/etc/pipeplan"
SPEC_FILE = "cluster.yaml"
DEVICE_LABEL = "device.pipeplan.io/"
"""Kubernetes node label prefix: ``device.pipeplan.io/<type>=true`` on nodes with that type."""
PLACEHOLDER = "REPLACE-ME"
"""Marks the committed placeholder tokens; pods refuse to start while a token holds it."""
SERVICE_PORT: int = Settings.model_fields["port"].default
COMPOSE_HEAD = "ray-head"
COMPOSE_SECRET = "ray_auth_token"
COMPOSE_RAY_TMP = "ray-tmp"
"""The head's Ray temp dir, shared with Prometheus (its service-discovery file is there)."""


@dataclass(frozen=True)
class RayPorts:
    """The ports a deployed Ray cluster listens on, all given explicitly.

    Ray's defaults (GCS 6379, dashboard 8265, client 10001, dashboard agent 52365, metrics
    8080) are avoided: 6379 is Redis's port on the machines this project runs on, and a second
    Ray on a host holds the others. Each port here also lies outside Ray's default range for
    its worker processes (10002-19999) and below Linux's ephemeral range (32768-60999), so
    neither a Ray worker nor an outgoing connection can take it first.
    """

    gcs: int = 26379
    dashboard: int = 28265
    """The dashboard, where Ray's Jobs API lives (the service submits jobs there)."""
    client: int = 20001
    dashboard_agent: int = 25365
    """Each node's agent: its ``/api/healthz`` is what the health checks ask."""
    metrics: int = 28080
    """Each node's Prometheus export (listed in the head's service-discovery file)."""


PORTS = RayPorts()
RAY_ENV_COMMON = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
"""Every Ray container: token authentication stays on (Ray 2.60's default, made explicit)."""


class DeployError(PipeplanError):
    """A spec that cannot be deployed as it is; the message names the field and the value."""


class DeployTarget(StrEnum):
    """What to render: both targets (each in its own folder), or one (straight into ``out``)."""

    ALL = "all"
    K8S = "k8s"
    COMPOSE = "compose"


class DeployRenderRequest(Request):
    """The spec to deploy (a document or a preset's name) and how to size what runs it."""

    spec: ClusterRef
    target: DeployTarget = DeployTarget.ALL
    image_cpu: str = Field(f"pipeplan-cpu:{IMAGE_TAG}", pattern=r"^\S+$")
    """Image of the head, the CPU workers and (compose) the service."""
    image_cuda: str = Field(f"pipeplan-cuda:{IMAGE_TAG}", pattern=r"^\S+$")
    """Image of the workers of ``accelerator: cuda`` device types."""
    cpus_per_device: int = Field(2, ge=1, le=1024)
    """CPU cores a pod or container gets for each device it holds."""
    memory_gib_per_device: int = Field(8, ge=1, le=65536)
    """Memory (GiB) a Kubernetes pod gets for each device it holds."""
    object_store_mb: int = Field(1024, ge=75, le=2**20)
    """Object store of each Compose Ray node (its ``/dev/shm`` gets 512 MB more)."""
    node_selectors: bool = True
    """Pin each worker group to nodes labelled ``device.pipeplan.io/<type>=true``."""


@dataclass(frozen=True)
class Rendered:
    """The files of one render: relative POSIX path -> text."""

    spec_name: str
    files: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.spec_name, "files": sorted(self.files)}

    def write(self, out: Path) -> list[Path]:
        """Write every file under ``out`` (created if missing); the paths written."""
        if out.exists() and not out.is_dir():
            raise DeployError(f"out: {str(out)!r} is a file, not a directory")
        written = []
        for rel, text in sorted(self.files.items()):
            path = out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
        return written


# --- the spec --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeploySpec:
    """A spec ready to deploy: its core form, each type's accelerator, each used type's
    Kubernetes name and the document the deployment ships."""

    spec: ClusterSpec
    accelerators: Mapping[str, str | None]
    k8s_names: Mapping[str, str]
    document: Document

    @property
    def used_types(self) -> list[str]:
        """Device types some node holds, in the spec's order."""
        counts = self.spec.counts_by_type()
        return [t for t in self.spec.device_types if counts.get(t, 0) > 0]

    def is_gpu(self, device_type: str) -> bool:
        return self.accelerators.get(device_type) == "cuda"


def spec_document(ref: ClusterRef) -> Document:
    """The document ``ref`` names: itself, or a preset's by name."""
    if isinstance(ref, str):
        if ref not in presets():
            raise DeployError(f"spec: unknown preset {ref!r} (one of {', '.join(presets())})")
        doc: Document = _io.read_document(PRESETS_DIR / f"{ref}.yaml")
        return doc
    return ref


_RESOURCE_SAFE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_NOT_DNS = re.compile(r"[^a-z0-9]+")
MAX_K8S_NAME = 63
"""A Kubernetes label value, and a worker group's name (KubeRay labels pods with it)."""


def k8s_name(name: str) -> str:
    """``name`` as a DNS label: lower case, each run of other characters one ``-``, none at
    either end (``A100_80GB`` -> ``a100-80gb``); may come out empty."""
    return _NOT_DNS.sub("-", name.lower()).strip("-")


def _k8s_names(spec: ClusterSpec, used: list[str]) -> dict[str, str]:
    """Every used type's Kubernetes name, each checked to be one and to be unique."""
    names: dict[str, str] = {}
    for t in used:
        where = f"device_types.{t}"
        if not _RESOURCE_SAFE.match(t):
            raise DeployError(
                f"{where}: the name {t!r} may hold only letters, digits, '_', '.' and '-' to "
                "be deployed (it becomes a Ray resource name on a shell command line)"
            )
        name = k8s_name(t)
        if not name or len(name) > MAX_K8S_NAME:
            raise DeployError(
                f"{where}: {t!r} is not a valid Kubernetes name after normalisation "
                f"({name!r}: 1 to {MAX_K8S_NAME} of a-z, 0-9 and '-', starting and ending "
                "with a letter or digit)"
            )
        clash = next((u for u, n in names.items() if n == name), None)
        if clash is not None:
            raise DeployError(
                f"{where}: {t!r} and {clash!r} both become the Kubernetes name {name!r}; rename one"
            )
        names[t] = name
    return names


def load_spec(ref: ClusterRef) -> DeploySpec:
    """The spec ``ref`` names, checked for deployment (see :class:`DeploySpec`)."""
    spec = ClusterSpec.from_dict(spec_document(ref))  # counts expanded, accelerators checked
    accelerators = {t: d.accelerator for t, d in spec.device_types.items()}
    counts = spec.counts_by_type()
    used = [t for t in spec.device_types if counts.get(t, 0) > 0]
    return DeploySpec(spec, accelerators, _k8s_names(spec, used), spec.to_dict())


# --- YAML ------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Block style, keys in the order written, multi-line strings as literal blocks, and
    no anchors: a value written twice is spelled out twice."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)


def to_yaml(*docs: Any, header: str = "") -> str:
    """``docs`` as one YAML stream, under ``header`` (comment lines)."""
    body = yaml.dump_all(
        docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096
    )
    return header + body


RENDERED_BY = "Written by `pipeplan deploy render`: do not edit; render again from the spec"
"""How a header says a file of ``deploy render`` was made (another use-case names itself)."""


def _header(dep: DeploySpec, what: str, made_by: str = RENDERED_BY) -> str:
    """Comment lines: what the file is, of which spec, and how it was made."""
    spec = dep.spec
    devices = sum(spec.counts_by_type().values())
    return (
        f"# {what} of the cluster spec {spec.name!r} ({len(spec.nodes)} nodes, {devices} "
        f"devices).\n# {made_by} (deploy/README.md).\n"
    )


# --- Kubernetes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerGroup:
    """One KubeRay worker group: a device type, how many devices a pod holds, how many pods."""

    device_type: str
    name: str
    per_pod: int
    replicas: int
    gpu: bool

    @property
    def resources(self) -> dict[str, int]:
        """The Ray resources each pod advertises."""
        return {device_resource(self.device_type): self.per_pod}


def worker_groups(dep: DeploySpec) -> list[WorkerGroup]:
    """One group per device type some node holds (module docstring: pod sizes)."""
    groups = []
    for t in dep.used_types:
        counts = [c for n in dep.spec.nodes if (c := n.devices.get(t, 0)) > 0]
        per_pod = math.gcd(*counts)
        total = sum(counts)
        groups.append(WorkerGroup(t, dep.k8s_names[t], per_pod, total // per_pod, dep.is_gpu(t)))
    return groups


def _secret_env(name: str, secret: str, key: str) -> Manifest:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _ray_env() -> list[Manifest]:
    plain = [{"name": k, "value": v} for k, v in RAY_ENV_COMMON.items()]
    return [*plain, _secret_env("RAY_AUTH_TOKEN", RAY_SECRET, RAY_SECRET_KEY)]


def _health_probe(failures: int) -> Manifest:
    """Ray's agent health (raylet; GCS too on the head); unauthenticated by Ray's design."""
    return {
        "httpGet": {"path": "/api/healthz", "port": PORTS.dashboard_agent},
        "initialDelaySeconds": 10,
        "periodSeconds": 5,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def _resources(cpus: int, memory_gib: int, gpus: int = 0) -> Manifest:
    amounts: Manifest = {"cpu": str(cpus), "memory": f"{memory_gib}Gi"}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _shm(memory_gib: int) -> Manifest:
    """``/dev/shm`` in memory: Ray's object store lives there (the default is 64 MB)."""
    return {"name": "shared-mem", "emptyDir": {"medium": "Memory", "sizeLimit": f"{memory_gib}Gi"}}


POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": USER_ID,
    "runAsGroup": USER_ID,
    "fsGroup": USER_ID,
}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
CHECK_TOKEN = (
    'case "$RAY_AUTH_TOKEN" in ""|*' + PLACEHOLDER + '*) echo "Secret ' + RAY_SECRET + ": "
    "set " + RAY_SECRET_KEY + ' to a random token (deploy/README.md)" >&2; exit 1;; esac'
)
"""The head's init check: no cluster starts with the committed placeholder token."""


def _head_group(request: DeployRenderRequest) -> Manifest:
    head_cpus, head_gib = 2, 8
    container = {
        "name": "ray-head",
        "image": request.image_cpu,
        "ports": [
            {"name": "gcs-server", "containerPort": PORTS.gcs},
            {"name": "dashboard", "containerPort": PORTS.dashboard},
            {"name": "client", "containerPort": PORTS.client},
            {"name": "metrics", "containerPort": PORTS.metrics},
        ],
        "env": _ray_env(),
        "resources": _resources(head_cpus, head_gib),
        "readinessProbe": _health_probe(10),
        "livenessProbe": _health_probe(120),
        "volumeMounts": [
            {"name": "cluster-spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "shared-mem", "mountPath": "/dev/shm"},
        ],
        "securityContext": CONTAINER_SECURITY,
    }
    check = {
        "name": "check-ray-token",
        "image": request.image_cpu,
        "command": ["sh", "-c", CHECK_TOKEN],
        "env": [_secret_env("RAY_AUTH_TOKEN", RAY_SECRET, RAY_SECRET_KEY)],
        "securityContext": CONTAINER_SECURITY,
    }
    return {
        "serviceType": "ClusterIP",
        "rayStartParams": {
            "port": str(PORTS.gcs),
            "dashboard-host": "0.0.0.0",
            "dashboard-port": str(PORTS.dashboard),
            "ray-client-server-port": str(PORTS.client),
            "dashboard-agent-listen-port": str(PORTS.dashboard_agent),
            "metrics-export-port": str(PORTS.metrics),
            "num-cpus": "0",
        },
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/component": "ray-head"}},
            "spec": {
                "securityContext": POD_SECURITY,
                "initContainers": [check],
                "containers": [container],
                "volumes": [
                    {"name": "cluster-spec", "configMap": {"name": SPEC_CONFIGMAP}},
                    _shm(head_gib),
                ],
            },
        },
    }


@dataclass(frozen=True)
class Replicas:
    """A worker group's pod count: at start, and the autoscaler's bounds (all equal when the
    cluster has a fixed size)."""

    replicas: int
    least: int
    most: int

    @classmethod
    def fixed(cls, n: int) -> Replicas:
        return cls(n, n, n)


def group_spec(
    name: str,
    devices: Mapping[str, int],
    gpus: int,
    replicas: Replicas,
    request: DeployRenderRequest,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
) -> Manifest:
    """A KubeRay worker group whose pods each hold ``devices`` (type -> count), ``gpus`` of
    them GPUs: Ray resources ``device:TYPE``, cores and memory per device, the CUDA image
    and ``nvidia.com/gpu`` when ``gpus``, Kubernetes node labels asked for by ``selector``
    (when the request pins groups)."""
    held = sum(devices.values())
    cpus = request.cpus_per_device * held
    gib = request.memory_gib_per_device * held
    params = {
        "num-cpus": str(cpus),
        "resources": "'" + json.dumps({device_resource(t): c for t, c in devices.items()}) + "'",
        "dashboard-agent-listen-port": str(PORTS.dashboard_agent),
        "metrics-export-port": str(PORTS.metrics),
    }
    if gpus:
        params["num-gpus"] = str(gpus)
    container = {
        "name": "ray-worker",
        "image": request.image_cuda if gpus else request.image_cpu,
        "ports": [{"name": "metrics", "containerPort": PORTS.metrics}],
        "env": _ray_env(),
        "resources": _resources(cpus, gib, gpus),
        "readinessProbe": _health_probe(10),
        "livenessProbe": _health_probe(120),
        "volumeMounts": [{"name": "shared-mem", "mountPath": "/dev/shm"}],
        "securityContext": CONTAINER_SECURITY,
    }
    pod: Manifest = {"securityContext": POD_SECURITY}
    if request.node_selectors:
        pod["nodeSelector"] = dict(selector)
    if gpus:
        pod["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    pod |= {"containers": [container], "volumes": [_shm(gib)]}
    return {
        "groupName": name,
        "replicas": replicas.replicas,
        "minReplicas": replicas.least,
        "maxReplicas": replicas.most,
        "rayStartParams": params,
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
    }


def _worker_group(group: WorkerGroup, request: DeployRenderRequest) -> Manifest:
    """The group of one device type (module docstring), fixed in size."""
    labels = {"app.kubernetes.io/component": "ray-worker", "pipeplan.io/device-type": group.name}
    return group_spec(
        group.name,
        {group.device_type: group.per_pod},
        group.per_pod if group.gpu else 0,
        Replicas.fixed(group.replicas),
        request,
        labels,
        {DEVICE_LABEL + group.name: "true"},
    )


def raycluster(
    dep: DeploySpec,
    request: DeployRenderRequest,
    groups: list[Manifest] | None = None,
    autoscaler: Manifest | None = None,
) -> Manifest:
    """The KubeRay ``RayCluster`` for the spec, token auth: by default one fixed-size group
    per device type; else ``groups``, with in-tree autoscaling when ``autoscaler`` holds its
    ``autoscalerOptions``."""
    spec: Manifest = {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": autoscaler is not None,
    }
    if autoscaler is not None:
        spec["autoscalerOptions"] = autoscaler
    spec |= {
        "authOptions": {"mode": "token", "secretName": RAY_SECRET},
        "headGroupSpec": _head_group(request),
        "workerGroupSpecs": (
            [_worker_group(g, request) for g in worker_groups(dep)] if groups is None else groups
        ),
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {
            "name": RAYCLUSTER,
            "labels": {"app.kubernetes.io/name": "pipeplan", "app.kubernetes.io/component": "ray"},
            "annotations": {"pipeplan.io/cluster-spec": dep.spec.name},
        },
        "spec": spec,
    }


AUTOSCALER_IDLE_S = 60
"""Seconds a worker pod holds no Ray resource before the autoscaler removes it (KubeRay's
default, written out)."""


def autoscaler_options() -> Manifest:
    """``autoscalerOptions`` of a RayCluster with in-tree autoscaling: the sidecar in the
    head pod, with the Ray token (it talks to the head's GCS), KubeRay's default size, no
    privileges, and upscaling without a rate limit."""
    return {
        "upscalingMode": "Default",
        "idleTimeoutSeconds": AUTOSCALER_IDLE_S,
        "env": _ray_env(),
        "resources": {
            "requests": {"cpu": "500m", "memory": "512Mi"},
            "limits": {"cpu": "500m", "memory": "512Mi"},
        },
        "securityContext": CONTAINER_SECURITY,
    }


def spec_configmap(dep: DeploySpec) -> Manifest:
    """The spec, for the head (``SPEC_DIR/SPEC_FILE``): jobs plan for it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": SPEC_CONFIGMAP,
            "labels": {"app.kubernetes.io/name": "pipeplan"},
            "annotations": {"pipeplan.io/cluster-spec": dep.spec.name},
        },
        "data": {SPEC_FILE: to_yaml(dep.document)},
    }


def k8s_files(
    dep: DeploySpec,
    request: DeployRenderRequest,
    cluster: Manifest | None = None,
    made_by: str = RENDERED_BY,
) -> dict[str, str]:
    """The overlay's part: the Kustomization, the RayCluster (``cluster``, else the spec's
    own :func:`raycluster`) and the spec's ConfigMap."""
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["raycluster.yaml", "cluster-spec.yaml"],
    }
    rc = raycluster(dep, request) if cluster is None else cluster
    return {
        "kustomization.yaml": to_yaml(
            kustomization, header=_header(dep, "The Kustomization", made_by)
        ),
        "raycluster.yaml": to_yaml(rc, header=_header(dep, "The KubeRay RayCluster", made_by)),
        "cluster-spec.yaml": to_yaml(
            spec_configmap(dep), header=_header(dep, "The ConfigMap", made_by)
        ),
    }


# --- Compose ---------------------------------------------------------------------------------


def compose_image(variable: str, default: str) -> str:
    """An image overridable from the environment without rendering again."""
    return "${" + variable + ":-" + default + "}"


def _compose_env() -> dict[str, str]:
    return {**RAY_ENV_COMMON, "RAY_AUTH_TOKEN_PATH": f"/run/secrets/{COMPOSE_SECRET}"}


def _node_flags() -> list[str]:
    return [
        f"--dashboard-agent-listen-port={PORTS.dashboard_agent}",
        f"--metrics-export-port={PORTS.metrics}",
        "--disable-usage-stats",
    ]


HEALTH_CHECK = (
    "import urllib.request; "
    f"urllib.request.urlopen('http://127.0.0.1:{PORTS.dashboard_agent}/api/healthz', timeout=3)"
)


def _compose_head(request: DeployRenderRequest) -> Manifest:
    command = [
        "ray",
        "start",
        "--head",
        "--block",
        f"--port={PORTS.gcs}",
        "--dashboard-host=0.0.0.0",
        f"--dashboard-port={PORTS.dashboard}",
        f"--ray-client-server-port={PORTS.client}",
        "--num-cpus=0",
        *_node_flags(),
    ]
    return {
        "image": compose_image("PIPEPLAN_IMAGE_CPU", request.image_cpu),
        "command": command,
        "environment": _compose_env(),
        "secrets": [COMPOSE_SECRET],
        "shm_size": "512m",
        "volumes": [f"{COMPOSE_RAY_TMP}:/tmp/ray", f"./{SPEC_FILE}:{SPEC_DIR}/{SPEC_FILE}:ro"],
        "ports": [f"127.0.0.1:{PORTS.dashboard}:{PORTS.dashboard}"],
        "healthcheck": {
            "test": ["CMD", "python", "-c", HEALTH_CHECK],
            "interval": "5s",
            "timeout": "5s",
            "retries": 60,
        },
        "restart": "unless-stopped",
    }


def _compose_node(
    dep: DeploySpec, i: int, gpu_ids: list[str], request: DeployRenderRequest
) -> Manifest:
    node = dep.spec.nodes[i]
    devices = sum(node.devices.values())
    gpus = len(gpu_ids)
    command = [
        "ray",
        "start",
        "--block",
        f"--address={COMPOSE_HEAD}:{PORTS.gcs}",
        f"--num-cpus={request.cpus_per_device * max(devices, 1)}",
        *([f"--num-gpus={gpus}"] if gpus else []),
        f"--object-store-memory={request.object_store_mb * 2**20}",
        "--resources=" + json.dumps(node_resources(node), sort_keys=True),
        *_node_flags(),
    ]
    image = ("PIPEPLAN_IMAGE_CUDA", request.image_cuda) if gpus else None
    service: Manifest = {
        "image": compose_image(*(image or ("PIPEPLAN_IMAGE_CPU", request.image_cpu))),
        "command": command,
        "environment": _compose_env(),
        "secrets": [COMPOSE_SECRET],
        "shm_size": f"{request.object_store_mb + 512}m",
        "depends_on": {COMPOSE_HEAD: {"condition": "service_healthy"}},
        "restart": "unless-stopped",
    }
    if gpus:
        reservation = {"driver": "nvidia", "device_ids": gpu_ids, "capabilities": ["gpu"]}
        service["deploy"] = {"resources": {"reservations": {"devices": [reservation]}}}
    return service


def compose_services(dep: DeploySpec, request: DeployRenderRequest) -> Manifest:
    """The Compose file of the Ray cluster: the head, then one service per spec node."""
    services: Manifest = {COMPOSE_HEAD: _compose_head(request)}
    next_gpu = 0
    for i, node in enumerate(dep.spec.nodes):
        gpus = sum(c for t, c in node.devices.items() if dep.is_gpu(t))
        ids = [str(k) for k in range(next_gpu, next_gpu + gpus)]
        next_gpu += gpus
        services[f"ray-node-{node.name}"] = _compose_node(dep, i, ids, request)
    return {
        "name": "pipeplan",
        "services": services,
        "secrets": {COMPOSE_SECRET: {"file": f"./secrets/{COMPOSE_SECRET}"}},
        "volumes": {COMPOSE_RAY_TMP: {}},
    }


def compose_files(
    dep: DeploySpec, request: DeployRenderRequest, made_by: str = RENDERED_BY
) -> dict[str, str]:
    head = _header(dep, "The Docker Compose file of the Ray cluster", made_by)
    return {
        "ray-cluster.yaml": to_yaml(compose_services(dep, request), header=head),
        SPEC_FILE: to_yaml(dep.document, header=_header(dep, "The deployed copy", made_by)),
    }


# --- the use-case ----------------------------------------------------------------------------


def render(request: DeployRenderRequest) -> Rendered:
    """The cluster-dependent files for ``request.spec``, nothing written yet."""
    dep = load_spec(request.spec)
    parts: dict[DeployTarget, Callable[[DeploySpec, DeployRenderRequest], dict[str, str]]] = {
        DeployTarget.K8S: k8s_files,
        DeployTarget.COMPOSE: compose_files,
    }
    files: dict[str, str] = {}
    for target, make in parts.items():
        if request.target is DeployTarget.ALL:
            files |= {f"{target.value}/{k}": v for k, v in make(dep, request).items()}
        elif request.target is target:
            files |= make(dep, request)
    return Rendered(dep.spec.name, files)
