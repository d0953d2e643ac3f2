"""``pipeplan provision --apply``: the deployment written for the rental the command chose
holds that rental's counts, for a ``cost`` objective with a throughput floor and for a
``throughput`` objective with a budget, and passes the deploy renders' offline checks; the
budget search keeps within the budget; bad flags are refused naming the flag and the value."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeplan.agents.problem import InfeasibleError
from pipeplan.agents.provision.rental import Rental
from pipeplan.core._io import read_document
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.service.tasks.apply import catalogue_counts, rented_spec
from pipeplan.service.tasks.deploy import load_spec
from pipeplan.service.tasks.provision import ProvisionRequest, within_budget
from tests.deploy.common import check_compose
from tests.deploy.test_apply import check_files_validate, check_rental_k8s, raycluster_of
from tests.service.runner import run_cli as run

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE_FILE = ROOT / "examples/clusters/cloud-catalogue.yaml"
CATALOGUE = str(CATALOGUE_FILE)
BATCH = "256"
FLOOR = 8000.0
"""samples/s the cost objective must reach (more than one node of the cheapest kind does)."""
BUDGET = 20.0
"""$/hour the throughput objective may spend on rented nodes."""


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "alexnet.json"
    load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100").save(path)
    return path


@pytest.fixture(scope="module")
def catalogue() -> ClusterSpec:
    return ClusterSpec.from_dict(read_document(CATALOGUE_FILE))


def provision(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], profile: Path, *args: str
) -> tuple[dict[str, Any], str]:
    code, out, err = run(monkeypatch, capsys, "provision", "--profile", str(profile),
                         "--cluster", CATALOGUE, "--batch", BATCH, *args, "--json")  # fmt: skip
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc, err


# --- the two objectives, applied ----------------------------------------------------------------


@pytest.mark.slow
def test_cost_with_a_floor_deploys_the_rental_it_chose(
    monkeypatch, capsys, profile_path, catalogue, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "deploy"
    doc, err = provision(monkeypatch, capsys, profile_path, "--min-throughput", str(FLOOR),
                         "--targets", "1", "--apply", "all", "--out", str(folder))  # fmt: skip
    rental = doc["rental"]
    nodes = rental["nodes"]
    assert rental["throughput"] >= FLOOR and sum(nodes.values()) > 1
    assert doc["applied"]["files"] == sorted(
        f"{t}/{f}"
        for t, names in {
            "k8s": ["kustomization.yaml", "raycluster.yaml", "cluster-spec.yaml"],
            "compose": ["ray-cluster.yaml", "cluster.yaml"],
        }.items()
        for f in names
    )
    assert f"wrote 5 files under {folder}" in err
    k8s = {p.name: p.read_text() for p in (folder / "k8s").iterdir()}
    groups = check_rental_k8s(catalogue, nodes, k8s)
    assert {k: g["replicas"] for k, g in groups.items()} == nodes
    check_files_validate(k8s, tmp_path / "overlay")
    compose = {p.name: p.read_text() for p in (folder / "compose").iterdir()}
    check_compose(load_spec(rented_spec(catalogue, nodes).to_dict()), compose)
    services = yaml.safe_load(compose["ray-cluster.yaml"])["services"]
    assert len([s for s in services if s.startswith("ray-node-")]) == sum(nodes.values())


@pytest.mark.slow
def test_throughput_within_a_budget_deploys_an_autoscaling_rental(
    monkeypatch, capsys, profile_path, catalogue, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "rendered"
    doc, _ = provision(monkeypatch, capsys, profile_path, "--objective", "throughput",
                       "--max-price", str(BUDGET), "--targets", "3", "--apply", "k8s",
                       "--autoscale", "--out", str(folder))  # fmt: skip
    rental = doc["rental"]
    nodes = rental["nodes"]
    assert rental["node_price_per_hour"] <= BUDGET and nodes
    cheapest = doc["front"][0]["rental"]  # target 0: the cheapest rental per sample
    assert rental["throughput"] >= cheapest["throughput"]
    within = [
        p["rental"]
        for p in doc["front"]
        if p["rental"] and p["rental"]["node_price_per_hour"] <= BUDGET
    ]
    assert rental["throughput"] == max(r["throughput"] for r in within)
    assert len(doc["front"]) == 3  # the cheapest rental, then two targets
    files = {p.name: p.read_text() for p in folder.iterdir()}
    groups = check_rental_k8s(catalogue, nodes, files)
    have = catalogue_counts(catalogue)
    assert {k: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for k, g in groups.items()} == {
        k: (n, n, have[k]) for k, n in nodes.items()
    }
    assert raycluster_of(files)["spec"]["enableInTreeAutoscaling"] is True
    check_files_validate(files, tmp_path / "overlay")


# --- the budget search, on answers made up for the test -----------------------------------------


class Answer:
    """A made-up planner: the rental at target T runs at 1.05 T samples/s (10 at T = 0) and
    its nodes cost $1/h per 10 samples/s; no plan reaches over 1,000 samples/s."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def __call__(self, target: float) -> Any:
        self.asked.append(target)
        if target > 1000:
            raise InfeasibleError(f"no plan reaches {target}")
        tp = max(10.0, 1.05 * target)
        price = tp / 10
        hired = Rental({"g5": 1}, {"a10g": 1}, price, price, price / tp / 3600, tp)
        return type("Fake", (), {"rental": hired})()


def budget_request(budget: float, targets: int = 24) -> ProvisionRequest:
    return ProvisionRequest(cluster="cloud-catalogue", model="alexnet", objective="throughput",
                            max_price_per_hour=budget, targets=targets)  # fmt: skip


@pytest.mark.parametrize("budget", [3.0, 50.0, 500.0])
def test_the_budget_search_finds_the_fastest_rental_within_the_budget(budget: float) -> None:
    answer = Answer()
    done = within_budget(budget_request(budget), answer)
    best = done.planned.rental
    assert best is not None and best.node_price_per_hour <= budget
    reachable = min(10 * budget, 1.05 * 1000)  # the most samples/s the budget and plans allow
    assert best.throughput >= reachable / (1.05 * 1.03)
    assert [p.target for p in done.front] == sorted(answer.asked)
    assert len(answer.asked) <= 24


def test_the_budget_search_asks_at_most_targets() -> None:
    answer = Answer()
    done = within_budget(budget_request(500.0, targets=3), answer)
    assert answer.asked == pytest.approx([0.0, 20.0, 42.0])  # the cheapest, then doubling
    assert done.planned.rental is not None
    assert done.planned.rental.throughput == pytest.approx(44.1)


def test_a_budget_below_the_cheapest_rental_is_refused() -> None:
    with pytest.raises(InfeasibleError, match=r"max_price_per_hour: 0.5 is below the cheapest"):
        within_budget(budget_request(0.5), Answer())


# --- refused ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-throughput", "10", "--apply", "helm", "--out", "{dir}"], "'helm'"),
        (["--min-throughput", "10", "--apply", "k8s", "--out", "{file}"],
         "--out: '{file}' is a file; --apply writes a folder"),
        (["--min-throughput", "10", "--apply", "k8s"], "--apply k8s: needs --out"),
        (["--min-throughput", "10", "--autoscale"], "--autoscale: only applies with --apply"),
        (["--min-throughput", "10", "--scale-to-zero"],
         "--scale-to-zero: only applies with --apply"),
        (["--min-throughput", "10", "--apply", "compose", "--autoscale", "--out", "{dir}"],
         "autoscale: only for the k8s target (Compose has no autoscaler), not 'compose'"),
        (["--min-throughput", "10", "--apply", "k8s", "--scale-to-zero", "--out", "{dir}"],
         "scale_to_zero: only applies with autoscale"),
        (["--objective", "time"], "objective: provision answers 'cost' (with min_throughput) "
         "or 'throughput' (with max_price_per_hour), not 'time'"),
        (["--objective", "throughput"], "max_price_per_hour: required and > 0 for provision "
         "with objective throughput ($/hour of the rented nodes), got None"),
        (["--objective", "throughput", "--max-price", "-1"],
         "max_price_per_hour: required and > 0 for provision with objective throughput"),
        (["--min-throughput", "10", "--max-price", "5"],
         "max_price_per_hour: only applies to the throughput objective, not 'cost'"),
        (["--objective", "throughput", "--max-price", "5", "--min-throughput", "10"],
         "min_throughput: only applies to the cost objective, not 'throughput'"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused_naming_the_flag_and_value(
    monkeypatch, capsys, profile_path, tmp_path, args, message
) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "taken"
    file.write_text("not a folder")
    folder = tmp_path / "never"
    given = [a.format(dir=folder, file=file) for a in args]
    code, _, err = run(monkeypatch, capsys, "provision", "--profile", str(profile_path),
                       "--cluster", CATALOGUE, *given)  # fmt: skip
    assert code != 0
    assert re.sub(r"\s+", " ", message.format(file=file)) in re.sub(r"\s+", " ", err)
    assert not folder.exists()  # nothing written, no search run
