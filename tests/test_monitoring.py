"""deploy/monitoring: the Prometheus scrape config passes ``promtool check config`` and scrapes
the service and Ray's service-discovery file; the Grafana dashboard queries only metrics the
code defines (the service's ``/metrics`` families and :data:`executor.metrics.HISTOGRAMS`),
and every one of them, so it cannot silently go stale."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

from pipeplan.executor import metrics
from pipeplan.service.api.app import create_app
from tests.service.api.conftest import AUTH, FakeBackend, make_settings

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "deploy/monitoring"
PROMETHEUS = MONITORING / "prometheus.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
SUFFIXES = {  # the sample names Prometheus stores for a family of each type
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}
NAME = re.compile(r"\b(?:ray_)?pipeplan_[A-Za-z0-9_]+\b")
"""A metric of this project in a PromQL expression."""


def promtool() -> str | None:
    """promtool on PATH, else where ``.ci/run`` unpacks it."""
    found = shutil.which("promtool")
    local = ROOT / "build/tools/promtool"
    return found or (str(local) if local.exists() else None)


def scrape_configs() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load(PROMETHEUS.read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_promtool_checks_the_scrape_config(tmp_path: Path) -> None:
    tool = promtool()
    if tool is None:
        pytest.skip(
            "promtool is neither on PATH nor at build/tools/promtool (.ci/run puts it there)"
        )
    # The config reads the API token from a file beside it, which a checkout does not hold.
    shutil.copy(PROMETHEUS, tmp_path / PROMETHEUS.name)
    token = scrape_configs()["pipeplan"]["authorization"]["credentials_file"]
    (tmp_path / token).write_text("a-token")
    done = subprocess.run(
        [tool, "check", "config", str(tmp_path / PROMETHEUS.name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_refuses_a_broken_config(tmp_path: Path) -> None:
    """The check above can fail: a scrape job without a name is refused."""
    tool = promtool()
    if tool is None:
        pytest.skip(
            "promtool is neither on PATH nor at build/tools/promtool (.ci/run puts it there)"
        )
    broken = tmp_path / "broken.yml"
    broken.write_text("scrape_configs:\n  - static_configs:\n      - targets: ['127.0.0.1:1']\n")
    done = subprocess.run([tool, "check", "config", str(broken)], capture_output=True, timeout=60)
    assert done.returncode != 0


def test_the_config_scrapes_the_service_and_rays_discovery_file() -> None:
    jobs = scrape_configs()
    service = jobs["pipeplan"]
    assert service["metrics_path"] == "/metrics"
    assert service["static_configs"] == [{"targets": ["127.0.0.1:8321"]}]
    assert service["authorization"]["type"] == "Bearer"
    assert not Path(service["authorization"]["credentials_file"]).is_absolute()
    (files,) = [sd["files"] for sd in jobs["ray"]["file_sd_configs"]]
    assert files == [f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"]
    ignored = (MONITORING / ".gitignore").read_text().split()
    assert service["authorization"]["credentials_file"] in ignored


# --- the Grafana dashboard ------------------------------------------------------------------


def service_families(tmp_path: Path) -> dict[str, str]:
    """The families the service's ``/metrics`` serves (name -> type), from a fresh app."""
    app = create_app(make_settings(tmp_path), backend=FakeBackend())
    with TestClient(app, headers=AUTH) as client:
        text = client.get("/metrics").text
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def defined_names(tmp_path: Path) -> dict[str, str]:
    """Every sample name the code can produce -> its family."""
    families = service_families(tmp_path)
    families |= {spec.exported: "histogram" for spec in metrics.HISTOGRAMS}
    return {
        family + suffix: family for family, kind in families.items() for suffix in SUFFIXES[kind]
    }


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) of every query."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_the_dashboard_queries_only_metrics_the_code_defines(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = defined_names(tmp_path)
    assert "pipeplan_job_best_value" in names  # the per-job gauges, served per scrape
    unknown = [
        f"{title}: {name}"
        for title, expr in expressions(dashboard)
        for name in NAME.findall(expr)
        if name not in names
    ]
    assert not unknown, "the dashboard queries metrics no code defines:\n" + "\n".join(unknown)
    blind = [title for title, expr in expressions(dashboard) if not NAME.search(expr)]
    assert not blind, f"queries naming none of the project's metrics: {blind}"
    used = {names[n] for _, expr in expressions(dashboard) for n in NAME.findall(expr)}
    assert used == set(names.values()), f"metrics on no panel: {set(names.values()) - used}"


def test_the_dashboard_is_one_grafana_imports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    all_panels = list(panels(dashboard))
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert all(p.get("title") and "gridPos" in p for p in all_panels)
    (variable,) = dashboard["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    for panel in all_panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${" + variable["name"] + "}", panel["title"]
            assert panel["targets"], f"{panel['title']}: no query"
    assert dashboard["uid"] == "pipeplan" and dashboard["schemaVersion"] >= 36


def test_the_name_pattern_finds_names_and_skips_the_rest() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le, stage) (rate(ray_pipeplan_stage_compute_seconds_"
        'bucket{op="forward"}[$__rate_interval]))) / on() pipeplan_jobs'
    )
    assert NAME.findall(expr) == ["ray_pipeplan_stage_compute_seconds_bucket", "pipeplan_jobs"]
