"""``pipeplan provision`` and ``pipeplan plan --objective cost`` on a catalogue, in-process;
a service ``plan`` job with a catalogue passes validation and its result carries the rental;
bad input named by field and value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.core.errors import PipeplanError
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.service.api.schemas import JobCreate
from pipeplan.service.api.validation import validate_job
from pipeplan.service.tasks.plan import PlanRequest, plan
from pipeplan.service.tasks.provision import ProvisionRequest, pareto, targets
from tests.service.runner import run_cli as run

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = str(ROOT / "examples/clusters/cloud-catalogue.yaml")


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "alexnet.json"
    load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100").save(path)
    return path


def test_plan_cost_on_a_catalogue_answers_with_the_rental(
    monkeypatch, capsys, profile_path
) -> None:  # type: ignore[no-untyped-def]
    args = ["plan", "--profile", str(profile_path), "--cluster", CATALOGUE, "--planner",
            "provision_dp", "--objective", "cost", "--min-throughput", "200"]  # fmt: skip
    code, out, err = run(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    doc = json.loads(out)
    hired = doc["rental"]
    assert hired["throughput"] >= 200
    assert set(hired["nodes"]) <= {"c5", "g4dn", "g5", "p3", "p4d"} and hired["nodes"]
    assert hired["cost_per_sample"] == pytest.approx(doc["estimate"]["cost_per_sample"])
    used_nodes = {d.split("/")[0] for st in doc["plan"]["stages"] for d in st["devices"]}
    assert sum(hired["nodes"].values()) == len(used_nodes)
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "rental" in out and "/sample at" in out


@pytest.mark.slow
def test_provision_prints_the_rental_and_the_front(
    monkeypatch, capsys, profile_path, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """One sweep of three targets answers the JSON and draws the PNG; the tables are read
    off a sweep of one target (a search per target: the text needs no more)."""
    png = tmp_path / "front.png"
    code, out, err = run(monkeypatch, capsys, "provision", "--profile", str(profile_path),
                         "--cluster", CATALOGUE, "--min-throughput", "200", "--targets", "3",
                         "--out", str(png), "--json")  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert [p["target"] for p in doc["front"]] == pytest.approx([50.0, 200.0, 800.0])
    assert any(p["on_front"] for p in doc["front"])
    assert doc["rental"]["throughput"] >= 200
    assert png.stat().st_size > 1000
    code, out, err = run(monkeypatch, capsys, "provision", "--profile", str(profile_path),
                         "--cluster", CATALOGUE, "--min-throughput", "200",
                         "--targets", "1")  # fmt: skip
    assert code == 0, err
    assert "rental" in out and "Pareto front" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-throughput", "0"], "min_throughput: required and > 0 for provision"),
        (["--min-throughput", "10", "--targets", "0"], "targets: must be 1 to 64, got 0"),
        (["--min-throughput", "10", "--spread", "0.5"], "spread: must be >= 1, got 0.5"),
        (["--min-throughput", "10", "--planner", "nope"], "unknown planner 'nope'"),
    ],
)
def test_provision_refuses_bad_input_naming_field_and_value(
    monkeypatch, capsys, profile_path, args, message
) -> None:  # type: ignore[no-untyped-def]
    code, _, err = run(monkeypatch, capsys, "provision", "--profile", str(profile_path),
                       "--cluster", CATALOGUE, *args)  # fmt: skip
    assert code != 0 and message in err


def test_a_bad_count_in_a_catalogue_file_is_named(
    monkeypatch, capsys, profile_path, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(CATALOGUE).read_text().replace("count: 16", "count: 0", 1))
    code, _, err = run(monkeypatch, capsys, "provision", "--profile", str(profile_path),
                       "--cluster", str(bad), "--min-throughput", "10")  # fmt: skip
    assert code != 0 and "nodes[0].count: must be >= 1, got 0" in err


def test_a_plan_job_with_a_catalogue_and_cost_returns_the_rental(profile_path: Path) -> None:
    spec = {"profile": json.loads(profile_path.read_text()), "cluster": "cloud-catalogue",
            "planner": "provision_dp", "objective": "cost", "min_throughput": 100}  # fmt: skip
    request = validate_job(JobCreate(kind="plan", spec=spec))
    assert isinstance(request, PlanRequest)
    result = plan(request).to_dict()  # what the job posts as its result
    assert result["rental"]["throughput"] >= 100 and result["rental"]["nodes"]
    bad = spec | {
        "cluster": {**spec_cluster(), "nodes": [{"name": "g", "devices": {"t4": 1}, "count": -1}]}
    }
    with pytest.raises(PipeplanError, match=r"nodes\[0\]\.count: must be >= 1, got -1"):
        validate_job(JobCreate(kind="plan", spec=bad))


def spec_cluster() -> dict[str, object]:
    from pipeplan.core._io import read_document

    doc: dict[str, object] = read_document(CATALOGUE)
    return doc


def test_targets_and_the_front() -> None:
    request = ProvisionRequest(cluster="cloud-catalogue", model="alexnet", min_throughput=100,
                               targets=4, spread=8)  # fmt: skip
    got = targets(request)
    assert got[0] == pytest.approx(12.5) and got[-1] == pytest.approx(800) and 100 in got
    assert pareto([(1.0, 10.0), (2.0, 5.0), (2.0, 20.0), (1.0, 10.0)]) == [True, False, True, True]
