"""deploy/compose, offline: both files pass the compose-spec schema (``check-jsonschema``,
with the schema vendored beside them and with the one check-jsonschema ships), and so does
the project Compose builds from them (.env's ``COMPOSE_FILE``); every reference resolves; the
service reaches the Ray head and jobs reach the service; the monitoring profile serves
deploy/monitoring's files as they are."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pipeplan.service.api.settings import Settings
from pipeplan.service.tasks.deploy import (
    COMPOSE_HEAD,
    COMPOSE_RAY_TMP,
    PORTS,
    SERVICE_PORT,
    SPEC_DIR,
)
from tests.deploy.common import COMPOSE, COMPOSE_SCHEMA, DEPLOY, compose_validator, need_tool, tool

RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365, 8080}


def env_file() -> dict[str, str]:
    lines = (COMPOSE / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def compose_files() -> list[Path]:
    """The files ``docker compose`` reads in deploy/compose, in order."""
    return [COMPOSE / name for name in env_file()["COMPOSE_FILE"].split(":")]


@cache
def project() -> dict[str, Any]:
    """The files merged as Compose merges them: services and top-level entries by name (a
    later file's entry of the same name must say the same here)."""
    merged: dict[str, Any] = {}
    for path in compose_files():
        doc = yaml.safe_load(path.read_text())
        for key, value in doc.items():
            if not isinstance(value, dict):
                assert merged.setdefault(key, value) == value, key
                continue
            section = merged.setdefault(key, {})
            for name, entry in value.items():
                assert section.setdefault(name, entry) == entry, f"{key}.{name} differs"
    return merged


def services() -> dict[str, Any]:
    return dict(project()["services"])


def bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's bind mounts (sources starting with . or /)."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = source
    return out


# --- the schema -------------------------------------------------------------------------------


def test_the_files_are_the_ones_compose_reads() -> None:
    assert [p.name for p in compose_files()] == ["compose.yaml", "ray-cluster.yaml"]


@pytest.mark.parametrize("schema", ["vendored", "check-jsonschema's"])
def test_check_jsonschema_accepts_both_files(schema: str) -> None:
    cli = need_tool("check-jsonschema", "check-jsonschema")
    which = (
        ["--schemafile", str(COMPOSE_SCHEMA)]
        if schema == "vendored"
        else ["--builtin-schema", "vendor.compose-spec"]
    )
    files = [str(p) for p in compose_files()]
    res = subprocess.run([cli, *which, *files], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_merged_project_passes_the_schema() -> None:
    compose_validator().validate(project())


def test_the_schema_rejects_what_compose_would() -> None:
    bad = {"services": {"x": {"image": "a", "comand": ["b"]}}}
    with pytest.raises(jsonschema.ValidationError, match="comand"):
        compose_validator().validate(bad)
    gpus = {"devices": [{"driver": "nvidia", "device_ids": [0], "capabilities": ["gpu"]}]}
    with pytest.raises(jsonschema.ValidationError, match="0 is not of type 'string'"):
        compose_validator().validate(
            {"services": {"x": {"deploy": {"resources": {"reservations": gpus}}}}}
        )


def test_the_vendored_schema_names_its_source() -> None:
    readme = (DEPLOY / "README.md").read_text()
    assert "compose-spec.schema.json" in readme and "check-jsonschema" in readme
    assert (COMPOSE / "compose-spec.LICENSE").read_text().lstrip().startswith("Apache License")


# --- references -------------------------------------------------------------------------------


def test_every_reference_resolves() -> None:
    doc = project()
    for name, service in services().items():
        for secret in service.get("secrets", []):
            assert secret in doc["secrets"], (name, secret)
        for spec in service.get("volumes", []):
            source = spec.split(":")[0]
            if source.startswith("./secrets/"):
                continue  # the user's token files (git-ignored)
            if source.startswith("."):
                assert (COMPOSE / source).exists(), (name, source)
            else:
                assert source in doc["volumes"], (name, source)
        for dep in service.get("depends_on", {}):
            assert dep in services(), (name, dep)
        mode = service.get("network_mode", "")
        if mode.startswith("service:"):
            assert mode.removeprefix("service:") in services()
    for secret in doc["secrets"].values():
        assert secret["file"].startswith("./secrets/")
    assert "secrets/" in (COMPOSE / ".gitignore").read_text().split()


def test_the_service_reaches_the_head_and_jobs_reach_the_service() -> None:
    found = services()
    env = found["pipeplan"]["environment"]
    assert env["PIPEPLAN_RAY_ADDRESS"] == f"http://{COMPOSE_HEAD}:{PORTS.dashboard}"
    assert env["PIPEPLAN_SERVER_URL"] == f"http://pipeplan:{SERVICE_PORT}"
    assert int(env["PIPEPLAN_PORT"]) == SERVICE_PORT
    settings = {f"PIPEPLAN_{name.upper()}" for name in Settings.model_fields}
    assert {k for k in env if k.startswith("PIPEPLAN_")} <= settings
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"].startswith(
        "/run/secrets/"
    )
    head = found[COMPOSE_HEAD]["command"]
    assert f"--dashboard-port={PORTS.dashboard}" in head and f"--port={PORTS.gcs}" in head
    for name, service in found.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)  # the host's loopback only


def test_ray_keeps_token_auth_and_no_default_port() -> None:
    for name, service in services().items():
        if not name.startswith("ray-"):
            continue
        assert service["environment"]["RAY_AUTH_MODE"] == "token", name
        ports = {
            int(a.split("=")[1]) for a in service["command"] if a.split("=")[0].endswith("port")
        }
        assert ports and not ports & RAY_DEFAULT_PORTS, name


# --- monitoring -------------------------------------------------------------------------------


def test_the_monitoring_profile_serves_deploy_monitoring_as_it_is() -> None:
    found = services()
    prometheus, grafana = found["prometheus"], found["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]
    mounts = bind_mounts(prometheus)
    assert mounts["/etc/prometheus/prometheus.yml"] == "../monitoring/prometheus.yml"
    config = yaml.safe_load((DEPLOY / "monitoring/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # The service's token file, named as the config names it, beside the config.
    token = jobs["pipeplan"]["authorization"]["credentials_file"]
    assert mounts[f"/etc/prometheus/{token}"] == "./secrets/pipeplan_api_token"
    # The service at 127.0.0.1:8321: Prometheus shares the service's network namespace.
    assert prometheus["network_mode"] == "service:pipeplan"
    assert jobs["pipeplan"]["static_configs"][0]["targets"] == [f"127.0.0.1:{SERVICE_PORT}"]
    # Ray's service-discovery file: in the head's temp dir, shared at the same path.
    (sd_file,) = jobs["ray"]["file_sd_configs"][0]["files"]
    assert f"{COMPOSE_RAY_TMP}:/tmp/ray:ro" in prometheus["volumes"]
    assert f"{COMPOSE_RAY_TMP}:/tmp/ray" in found[COMPOSE_HEAD]["volumes"]
    assert sd_file.startswith("/tmp/ray/")
    # Grafana: the dashboard JSON and a data source at Prometheus' listen address.
    dashboards = bind_mounts(grafana)
    assert (COMPOSE / dashboards["/var/lib/grafana/dashboards/pipeplan.json"]).is_file()
    source = yaml.safe_load((COMPOSE / "grafana/datasources.yaml").read_text())
    port = next(a for a in prometheus["command"] if a.startswith("--web.listen-address="))
    assert source["datasources"][0]["url"] == f"http://pipeplan:{port.rsplit(':', 1)[1]}"
    assert dashboards["/etc/grafana/provisioning/datasources/pipeplan.yaml"] == (
        "./grafana/datasources.yaml"
    )


def test_the_head_mounts_the_spec_where_jobs_read_it() -> None:
    head = bind_mounts(services()[COMPOSE_HEAD])
    assert head[f"{SPEC_DIR}/cluster.yaml"] == "./cluster.yaml"


def test_docker_compose_config_accepts_the_project(tmp_path: Path) -> None:
    """Where the Compose plugin is installed: Compose itself reads the project."""
    docker = tool("docker")
    if (
        docker is None
        or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0
    ):
        pytest.skip("docker compose (the Compose plugin) is not installed here")
    shutil.copytree(COMPOSE, tmp_path / "compose")
    shutil.copytree(DEPLOY / "monitoring", tmp_path / "monitoring")
    (tmp_path / "compose/secrets").mkdir()
    for name in ("pipeplan_api_token", "ray_auth_token"):
        (tmp_path / "compose/secrets" / name).write_text("a-token\n")
    res = subprocess.run(
        [docker, "compose", "--profile", "monitoring", "config", "--quiet"],
        cwd=tmp_path / "compose",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
