"""``pipeplan plan`` and ``pipeplan compare``, called in-process like tests/service/test_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.agents import PLANNERS, Problem, ProblemError
from pipeplan.agents.compare import default_planners
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search
from pipeplan.core.costmodel import simulate
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.service.tasks.common import cluster_spec
from tests.service.runner import run_cli as run

ROOT = Path(__file__).resolve().parents[2]


class FailingPlanner(Planner):
    """Stands in for a planner that refuses a problem (like brute over its size limit)."""

    name = "failing"

    def search(self, problem: Problem, search: Search) -> None:
        raise ProblemError("failing: the space has 10^12 plans, more than max_space 10^6")


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "alexnet.json"
    load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100").save(path)
    return path


# --- plan ---------------------------------------------------------------------------------------


def test_plan_json_and_plan_file(monkeypatch, capsys, profile_path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    saved = tmp_path / "plan.json"
    code, out, err = run(
        monkeypatch,
        capsys,
        "plan",
        "--profile",
        str(profile_path),
        "--cluster",
        "cloud-mix",
        "--planner",
        "greedy",
        "--batch",
        "32",
        "-o",
        str(saved),
        "--json",
    )
    assert code == 0, err
    doc = json.loads(out)
    keys = {"plan", "estimate", "planner", "evaluations", "wall_time_s"}
    assert set(doc) == keys | {"lower_bound_s", "ratio_to_bound", "bound"}
    assert doc["planner"] == "greedy" and doc["evaluations"] > 0
    plan = Plan.load(saved)
    assert plan.to_dict() == doc["plan"] and plan.global_batch == 32
    profile, cluster = ModelProfile.load(profile_path), cluster_spec("cloud-mix")
    plan.validate(profile, cluster)
    est = simulate(plan, profile, cluster)
    assert est.fits and doc["estimate"]["batch_time_s"] == est.batch_time_s


def test_plan_options_and_learning_curve(monkeypatch, capsys, profile_path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "curve.png"
    code, out, _ = run(
        monkeypatch,
        capsys,
        "plan",
        "--profile",
        str(profile_path),
        "--cluster",
        "local-hetero",
        "--planner",
        "brute",
        "-O",
        "max_stages=2",
        "-O",
        "max_replicas=1",
        "--curve",
        str(png),
        "--json",
    )
    assert code == 0
    assert len(json.loads(out)["plan"]["stages"]) <= 2
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_table_for_the_cost_objective(monkeypatch, capsys, profile_path) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run(
        monkeypatch,
        capsys,
        "plan",
        "--profile",
        str(profile_path),
        "--cluster",
        "cloud-mix",
        "--planner",
        "data_parallel",
        "--objective",
        "cost",
        "--min-throughput",
        "1000",
        "--microbatches",
        "4",
        "--budget",
        "100",
    )
    assert code == 0, err
    assert "batch time" in out and "/sample" in out and "search " in out
    assert "cost at >= 1000 samples/s" in out
    assert " x4 " in out  # the fixed microbatch count


def test_plan_a_zoo_model(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torchvision")
    code, out, err = run(
        monkeypatch,
        capsys,
        "plan",
        "--model",
        "digits_cnn",
        "--cluster",
        "local-hetero",
        "--planner",
        "uniform",
        "--batch",
        "16",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["plan"]["stages"][-1]["layers"][1] == 8  # digits_cnn has 8 layers


# --- compare ------------------------------------------------------------------------------------


def test_compare_lists_every_planner_and_the_reasons_of_failures(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, profile_path, tmp_path
) -> None:
    monkeypatch.setitem(PLANNERS, "failing", f"{__name__}:FailingPlanner")
    monkeypatch.setitem(PLANNERS, "missing", "pipeplan.agents.baselines.no_such_module:Nope")
    chart = tmp_path / "chart.png"
    code, out, err = run(
        monkeypatch,
        capsys,
        "compare",
        "--profile",
        str(profile_path),
        "--cluster",
        "tapp-paper",
        "--planners",
        "uniform,data_parallel,failing,missing,greedy",
        "--objective",
        "cost",
        "--min-throughput",
        "3000",
        "--chart",
        str(chart),
    )
    assert code == 0, err
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│ ")}
    assert {"uniform", "data_parallel", "failing", "missing", "greedy"} <= set(rows)
    assert "failed: no plan reaches min_throughput 3000" in rows["data_parallel"]
    assert "failed: the space has 10^12 plans" in rows["failing"]
    assert "failed: not available" in rows["missing"]
    assert "failed" not in rows["uniform"] + rows["greedy"]
    # whole reasons under the table
    assert "data_parallel failed: data_parallel on 'alexnet'" in out
    assert "no exact reference" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_json_ratios_to_best_and_to_exact(monkeypatch, capsys, profile_path) -> None:  # type: ignore[no-untyped-def]
    # stand-in exact planner: uniform under the name brute (the real one may refuse alexnet)
    monkeypatch.setitem(PLANNERS, "brute", "pipeplan.agents.baselines.uniform:UniformPlanner")
    code, out, err = run(
        monkeypatch,
        capsys,
        "compare",
        "--profile",
        str(profile_path),
        "--cluster",
        "local-hetero",
        "--planners",
        "brute,balanced,greedy",
        "--batch",
        "16",
        "--json",
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["objective"] == "time" and doc["exact_reference"] == "brute"
    results = {r["planner"]: r for r in doc["results"]}
    assert set(results) == {"brute", "balanced", "greedy"}
    assert all(r["ok"] for r in results.values())
    assert results["brute"]["ratio_to_exact"] == 1.0
    best = min(r["value"] for r in results.values())
    for r in results.values():
        assert r["ratio_to_best"] == pytest.approx(r["value"] / best)
        assert r["ratio_to_exact"] == pytest.approx(r["value"] / results["brute"]["value"])
    assert results[doc["best"]]["ratio_to_best"] == 1.0


def test_default_planners_are_the_registered_baselines() -> None:
    names = default_planners()
    assert {"uniform", "balanced", "data_parallel", "greedy"} <= set(names)
    assert "tapp" not in names and "ppo" not in names


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--planner", "nosuch"], "error: planner: unknown planner 'nosuch'"),
        (["plan", "--objective", "speed"], "error: Invalid value for '--objective'"),
        (
            ["plan", "--objective", "cost"],
            "error: min_throughput: required with objective cost",
        ),
        (
            ["plan", "--min-throughput", "10"],
            "error: min_throughput: only applies to the cost objective, not 'time'",
        ),
        (
            ["plan", "--model", "alexnet"],
            "error: model, profile: give exactly one of model (a zoo name) or profile",
        ),
        (["plan", "--batch", "0"], "error: global_batch: must be an integer >= 1, got 0"),
        (["plan", "--microbatches", "5"], "error: microbatches: 5 does not divide global_batch"),
        (["plan", "--budget", "0"], "error: budget.evaluations: must be >= 1, got 0"),
        (
            ["plan", "--objective", "cost", "--min-throughput", "1e9", "--planner", "balanced"],
            "no plan reaches min_throughput 1e+09 samples/s",
        ),
        (["compare", "--planners", "uniform,nosuch"], "error: planners: unknown planner"),
        (
            ["plan", "--planner", "tapp", "--workers", "2", "--reward", "measured"],
            "error: --workers: not with --reward measured",
        ),
        (["plan", "--planner", "greedy", "--workers", "0"], "error: workers: must be >= 1, got 0"),
        (
            ["plan", "--planner", "greedy", "--address", "127.0.0.1:1"],
            "error: address: only applies where the search uses a Ray cluster",
        ),
        (
            ["plan", "--planner", "greedy", "--reward", "measured"],
            "error: reward: measured applies to tapp and ppo",
        ),
        (["plan", "--planner", "brute", "-O", "max_space"], "error: --option: expected KEY=VALUE"),
        (["plan", "--planner", "brute", "-O", "nosuch=1"], "planner 'brute': bad options"),
        (["compare", "--planners", ","], "error: planners: no planner named"),
    ],
)
def test_errors_are_one_line_and_exit_2(monkeypatch, capsys, profile_path, args, message) -> None:  # type: ignore[no-untyped-def]
    base = ["--profile", str(profile_path), "--cluster", "cloud-mix"]
    if args[0] == "plan" and "--planner" not in args:
        base += ["--planner", "uniform"]
    code, _, err = run(monkeypatch, capsys, *args, *base)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
