"""The plan panel of a plan on about a hundred devices of a data-centre preset: its stages
and its measured-beside-predicted rows say the devices as counts by node kind and type,
with the ids in a details element, and its grid has a column per node, not per device."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.models.shapes import generate
from pipeplan.service.api.schemas import JobKind
from pipeplan.service.web.plan_view import plan_grid_svg
from pipeplan.service.web.run_view import comparison_of
from tests.service.api.conftest import AUTH, FakeBackend
from tests.service.api.test_dashboard import login, post_events
from tests.service.test_device_groups import SCALE_CLUSTER, SCALE_LABELS, scale_plan, scale_stages

NODES = 16
"""The nodes :func:`scale_stages` uses: a100x8-0..5, v100x8-0..3 and 6, t4x4-0..3 and 9."""
NODE_CELLS = 4 + 2 + 4 + 4 + 2
"""(stage, node) pairs of :func:`scale_stages`."""


@pytest.fixture
def browser(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as client:
        login(client)
        yield client


def _measured(estimate: dict[str, Any], factor: float) -> dict[str, Any]:
    """A measured search's best run: the prediction's stage times x ``factor``."""
    keys = ("compute_s", "transfer_s", "update_s")
    return {
        "batch_time_s": estimate["batch_time_s"] * factor,
        "batch_time_std_s": 0.0,
        "emulated": False,
        "stages": [{k: s[k] * factor for k in keys} for s in estimate["stages"]],
    }


def test_a_plan_on_a_hundred_devices_reads_by_node_kind_with_its_ids_at_hand(
    browser: TestClient, fake_backend: FakeBackend
) -> None:
    profile = generate("gpt-13b")
    cluster = ClusterSpec.load(SCALE_CLUSTER)
    plan = scale_plan(profile)
    estimate = simulate(plan, profile, cluster).to_dict()
    spec = {"profile": profile.to_dict(), "cluster": cluster.to_dict(), "batch": 512}
    r = browser.post(
        "/v1/jobs", json={"kind": "plan", "spec": {**spec, "planner": "genetic"}}, headers=AUTH
    )
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    result = {
        "plan": plan.to_dict(),
        "estimate": estimate,
        "planner": "genetic",
        "measured": {"best": _measured(estimate, 1.1)},
    }
    post_events(browser, job, fake_backend.token_of(job), [{"type": "result", "data": result}])
    panel = browser.get(f"/jobs/{job}/plan").text

    assert 'data-stages="11"' in panel and "on\n    104 devices" in panel
    groups = re.findall(r'<span class="device-groups">([^<]*)</span>', panel)
    assert groups == SCALE_LABELS * 2  # the stages table, then measured beside predicted
    summaries = re.findall(r"<summary>(\d+) device ids</summary>([^<]*)</details>", panel)
    assert [int(n) for n, _ in summaries] == [len(s) for s in scale_stages()] * 2
    assert [ids for _, ids in summaries[:11]] == [", ".join(s) for s in scale_stages()]
    assert "data-nodes='16'" in panel and panel.count("class='node-cell'") == NODE_CELLS
    assert "class='replica'" not in panel


def test_the_grid_of_a_large_plan_has_a_column_per_node_grouped_by_kind() -> None:
    profile = generate("gpt-13b")
    plan = scale_plan(profile)
    svg = plan_grid_svg(plan, ClusterSpec.load(SCALE_CLUSTER))
    assert "data-nodes='16'" in svg and "data-devices='104'" in svg
    assert svg.count("class='node-cell'") == NODE_CELLS
    width = re.search(r"viewBox='0 0 (\d+)", svg)
    assert width is not None  # a column of 56 units per node (a column per device: 104 of them)
    assert float(width.group(1)) <= 170 + 56 * NODES + 120
    kinds = re.findall(r"font-weight='bold'[^>]*>([^<]*)</text>", svg)
    assert [k for k in kinds if not k.startswith("stage")] == ["a100x8", "v100x8", "t4x4"]
    assert "stage 10 on t4x4-9: 4 t4 (t4x4-9/t4:0, t4x4-9/t4:1, t4x4-9/t4:2, t4x4-9/t4:3)" in svg
    assert ">4 v100</text>" in svg


def test_a_run_result_with_ids_the_core_refuses_shows_them_as_given() -> None:
    stage = {"index": 0, "layers": [0, 1], "compute_s": 1.0, "transfer_s": 0.0, "update_s": 0.0}
    bad = [*(f"a100x8-0/a100:{k}" for k in range(8)), "not an id"]
    result = {
        "predicted": {"batch_time_s": 1.0, "stages": [{**stage, "devices": bad}]},
        "measured": {"batch_time_s": 1.0, "stages": [stage]},
    }
    run = comparison_of(JobKind.RUN, result)
    assert run is not None and run.device_labels == [", ".join(bad)]
    good = {**result["predicted"], "stages": [{**stage, "devices": [*bad[:8], "a100x8-1/a100:0"]}]}
    run = comparison_of(JobKind.RUN, {**result, "predicted": good})
    assert run is not None and run.device_labels == ["8 a100 (a100x8-0) + 1 a100 (a100x8-1)"]
