"""Apply a provisioning plan: the deployment of the nodes a rental holds.

``pipeplan provision --apply`` hands the rental (``{node kind: count}``, as
:mod:`agents.provision.rental` counts it) and the catalogue it was chosen from to
:func:`render_rental`, which writes what ``deploy render`` writes (:mod:`service.tasks.deploy`),
for the rented cluster instead of the whole catalogue:

- the **rented spec**: the catalogue with each kind's ``count`` set to the rental's (the
  first nodes of the kind, ``KIND-0 ..``), the kinds not rented left out, so the jobs of the
  deployed cluster plan for what runs;
- for Kubernetes, **one worker group per rented kind**, a pod being one node of the kind: its
  devices as ``device:TYPE`` resources, its GPUs as ``nvidia.com/gpu``, and ``replicas`` the
  rented count. A rental counts whole nodes and a cloud adds whole nodes, so a group is a
  kind here, where ``deploy render`` makes a group per device type. As there, the pods of a
  group cannot differ, so they carry no ``pipeplan_node:NAME`` marker. On request the
  RayCluster has in-tree autoscaling: each group between ``minReplicas`` (the rented count,
  or 0) and ``maxReplicas`` (the catalogue's count of the kind);
- for Compose, one service per rented node, with its ``pipeplan_node:NAME`` marker (the
  Compose render's shape: Compose has no autoscaler).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeplan.agents.provision.rental import kind_of
from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.service.tasks.deploy import (
    DEVICE_LABEL,
    MAX_K8S_NAME,
    DeployError,
    DeployRenderRequest,
    DeploySpec,
    DeployTarget,
    Manifest,
    Rendered,
    Replicas,
    autoscaler_options,
    compose_files,
    group_spec,
    k8s_files,
    k8s_name,
    load_spec,
    raycluster,
    spec_document,
)

APPLIED_BY = (
    "Written by `pipeplan provision --apply` for the rental it chose: do not edit; provision again"
)
KIND_LABEL = "pipeplan.io/node-kind"
"""The pod label that names a worker group's node kind."""


class RentalRenderRequest(DeployRenderRequest):
    """A catalogue (``spec``), the rental chosen from it and how to deploy it: the sizes of
    :class:`~service.tasks.deploy.DeployRenderRequest`, and for Kubernetes, autoscaling."""

    nodes: dict[str, int] = {}
    """The rental: node kind -> nodes rented."""
    autoscale: bool = False
    """Render the RayCluster with in-tree autoscaling, each group up to the catalogue's
    count of its kind."""
    scale_to_zero: bool = False
    """With ``autoscale``: each group's ``minReplicas`` is 0 instead of the rented count."""


@dataclass(frozen=True)
class KindGroup:
    """The worker group of one rented node kind."""

    kind: str
    name: str
    node: Node
    replicas: Replicas


def catalogue_counts(spec: ClusterSpec) -> dict[str, int]:
    """Node kind -> how many nodes of it the catalogue holds, in the spec's order."""
    counts: dict[str, int] = {}
    for node in spec.nodes:
        counts[kind_of(node)] = counts.get(kind_of(node), 0) + 1
    return counts


def check_options(request: RentalRenderRequest) -> None:
    """The options fit the target (checked before a rental is chosen)."""
    if request.scale_to_zero and not request.autoscale:
        raise DeployError("scale_to_zero: only applies with autoscale")
    if request.autoscale and request.target is DeployTarget.COMPOSE:
        raise DeployError(
            "autoscale: only for the k8s target (Compose has no autoscaler), not 'compose'"
        )


def check_rental(spec: ClusterSpec, request: RentalRenderRequest) -> None:
    """The options fit the target; the rental names kinds of the catalogue, each within its
    count and holding devices. Errors name the field and the value."""
    check_options(request)
    if not request.nodes:
        raise DeployError("nodes: the rental holds no node; nothing to deploy")
    have = catalogue_counts(spec)
    first = {kind_of(n): n for n in reversed(spec.nodes)}
    for kind, n in request.nodes.items():
        if kind not in have:
            raise DeployError(
                f"nodes.{kind}: no node kind {kind!r} in cluster {spec.name!r} "
                f"(kinds: {', '.join(have)})"
            )
        if isinstance(n, bool) or not 1 <= n <= have[kind]:
            raise DeployError(
                f"nodes.{kind}: must be 1 to {have[kind]} (the catalogue's count), got {n!r}"
            )
        if not any(first[kind].devices.values()):
            raise DeployError(f"nodes.{kind}: kind {kind!r} holds no devices to deploy")


def rented_spec(spec: ClusterSpec, nodes: dict[str, int]) -> ClusterSpec:
    """The catalogue narrowed to the rental: the first ``nodes[kind]`` nodes of each kind,
    named ``<catalogue>-rental``."""
    taken: dict[str, int] = {}
    kept = []
    for node in spec.nodes:
        kind = kind_of(node)
        if taken.get(kind, 0) < nodes.get(kind, 0):
            taken[kind] = taken.get(kind, 0) + 1
            kept.append(node)
    return replace(spec, name=f"{spec.name}-rental", nodes=tuple(kept))


def kind_groups(catalogue: ClusterSpec, request: RentalRenderRequest) -> list[KindGroup]:
    """One group per rented kind, in the catalogue's order; names checked as Kubernetes
    names and unique."""
    have = catalogue_counts(catalogue)
    first = {kind_of(n): n for n in reversed(catalogue.nodes)}
    groups: list[KindGroup] = []
    for kind in have:
        n = request.nodes.get(kind, 0)
        if n == 0:
            continue
        name = k8s_name(kind)
        if not name or len(name) > MAX_K8S_NAME:
            raise DeployError(
                f"nodes.{kind}: {kind!r} is not a valid Kubernetes name after normalisation "
                f"({name!r}: 1 to {MAX_K8S_NAME} of a-z, 0-9 and '-')"
            )
        clash = next((g.kind for g in groups if g.name == name), None)
        if clash is not None:
            raise DeployError(
                f"nodes.{kind}: {kind!r} and {clash!r} both become the Kubernetes name "
                f"{name!r}; rename one"
            )
        if request.autoscale:
            sizes = Replicas(n, 0 if request.scale_to_zero else n, have[kind])
        else:
            sizes = Replicas.fixed(n)
        groups.append(KindGroup(kind, name, first[kind], sizes))
    return groups


def kind_group_spec(dep: DeploySpec, group: KindGroup, request: RentalRenderRequest) -> Manifest:
    """The KubeRay worker group of a kind: a pod holds one node's devices; it asks for
    Kubernetes nodes labelled with each of its device types."""
    devices = {t: c for t, c in group.node.devices.items() if c > 0}
    gpus = sum(c for t, c in devices.items() if dep.is_gpu(t))
    labels = {"app.kubernetes.io/component": "ray-worker", KIND_LABEL: group.name}
    selector = {DEVICE_LABEL + dep.k8s_names[t]: "true" for t in devices}
    return group_spec(group.name, devices, gpus, group.replicas, request, labels, selector)


def rental_k8s(
    dep: DeploySpec, catalogue: ClusterSpec, request: RentalRenderRequest
) -> dict[str, str]:
    """The overlay's part for the rental: Kustomization, RayCluster, the rented spec."""
    groups = [kind_group_spec(dep, g, request) for g in kind_groups(catalogue, request)]
    options = autoscaler_options() if request.autoscale else None
    cluster = raycluster(dep, request, groups, options)
    return k8s_files(dep, request, cluster, APPLIED_BY)


def render_rental(request: RentalRenderRequest) -> Rendered:
    """The deployment of the rental, nothing written yet: for ``k8s`` or ``compose``
    straight into the output folder, for ``all`` each in its own folder."""
    catalogue = ClusterSpec.from_dict(spec_document(request.spec))
    check_rental(catalogue, request)
    dep = load_spec(rented_spec(catalogue, request.nodes).to_dict())
    parts: dict[DeployTarget, dict[str, str]] = {}
    if request.target in (DeployTarget.ALL, DeployTarget.K8S):
        parts[DeployTarget.K8S] = rental_k8s(dep, catalogue, request)
    if request.target in (DeployTarget.ALL, DeployTarget.COMPOSE):
        parts[DeployTarget.COMPOSE] = compose_files(dep, request, APPLIED_BY)
    files: dict[str, str] = {}
    for target, made in parts.items():
        prefix = f"{target.value}/" if request.target is DeployTarget.ALL else ""
        files |= {prefix + k: v for k, v in made.items()}
    return Rendered(dep.spec.name, files)
