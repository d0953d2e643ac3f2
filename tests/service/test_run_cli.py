"""``pipeplan run``, ``cluster``, ``profile --measure`` and ``plan --reward measured``.

The Ray tests share one small local cluster (``fast`` on n0, ``mid`` on n1, local-hetero's
device types), started without connecting this process: the commands join it with
``--address``, as they would join ``pipeplan cluster up``'s, and disconnect when done.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeplan.core.cluster import ClusterSpec, Node
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import runtime
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.measured_reward import MeasuredReward
from pipeplan.executor.model import ModelSource
from pipeplan.service.api.schemas import RunJobResult
from tests.service.runner import run_cli as cli

HETERO = ClusterSpec.load(Path(__file__).parents[2] / "examples/clusters/local-hetero.yaml")
SMALL = ClusterSpec(
    "small-hetero",
    {t: HETERO.device_types[t] for t in ("fast", "mid")},
    (Node("n0", {"fast": 1}), Node("n1", {"mid": 1})),
    HETERO.network,
)
TWO_STAGES = Plan(
    16, (Stage((0, 4), ("n0/fast:0",), 8), Stage((4, 8), ("n1/mid:0",), 8))
)  # digits_cnn has 8 layers


@pytest.fixture
def no_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty pipeplan state dir (no `cluster up` recorded)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "pipeplan" / "cluster"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("run")
    paths = {"cluster": d / "small.yaml", "plan": d / "two.plan.json"}
    SMALL.save(paths["cluster"])
    TWO_STAGES.save(paths["plan"])
    return paths


# --- without a cluster ------------------------------------------------------------------------


def test_cluster_status_without_a_cluster_says_so(monkeypatch, capsys, no_state) -> None:  # type: ignore[no-untyped-def]
    code, out, err = cli(monkeypatch, capsys, "cluster", "status")
    assert code == 1
    assert out.strip().splitlines() == [
        f"no pipeplan cluster is running (none recorded in {no_state}); start one with "
        "`pipeplan cluster up --spec C`"
    ]
    assert not err
    code, out, _ = cli(monkeypatch, capsys, "cluster", "down")
    assert code == 0 and "no pipeplan cluster is running" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--address", "auto", "--model", "digits_cnn"], "address auto: no pipeplan"),
        (["--cluster", "local-hetero", "--model", "nope"], "model: unknown 'nope'"),
        (["--cluster", "tapp-paper", "--model", "digits_cnn"], "unknown device 'n0/fast:0'"),
        (["--cluster", "local-hetero", "--model", "digits_cnn", "--steps", "0"], "steps"),
        (["--cluster", "local-hetero"], "exactly one of model (a zoo name) or profile"),
    ],
)
def test_run_refuses_bad_input_before_starting_ray(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, files, no_state, args, message
) -> None:
    code, out, err = cli(monkeypatch, capsys, "run", "--plan", str(files["plan"]), *args)
    assert code == 2
    assert not out
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("error: ") and message in err


def test_measured_reward_is_for_the_learned_planners_only(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    code, _, err = cli(
        monkeypatch, capsys, "plan", "--planner", "dp", "--reward", "measured",
        "--model", "digits_cnn", "--cluster", "local-hetero",
    )  # fmt: skip
    assert code == 2
    assert err.strip() == (
        "error: reward: measured applies to tapp and ppo (learned planners that spend few "
        "evaluations), not 'dp'"
    )


# --- on a live cluster ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with LocalCluster(SMALL, object_store_mb=100, connect=False) as cluster:
        yield cluster.address


@pytest.mark.ray
@pytest.mark.timeout(150)
def test_run_json_gives_measured_and_predicted_batch_times(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, files, address
) -> None:
    code, out, err = cli(
        monkeypatch, capsys, "run", "--plan", str(files["plan"]), "--model", "digits_cnn",
        "--cluster", str(files["cluster"]), "--address", address, "--steps", "2", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    RunJobResult.model_validate(doc)  # a run job's result is this document, as the API states
    measured, predicted = doc["measured"], doc["predicted"]
    assert doc["emulated"] is True and "EMULATED" in measured["note"]
    assert doc["profile"] == "profile measured on the cluster"
    assert measured["steps"] == 2 and len(measured["batch_times_s"]) == 2
    assert measured["batch_time_s"] > 0 and predicted["batch_time_s"] > 0
    error = doc["error"]["batch_time"]
    assert error == pytest.approx(
        (predicted["batch_time_s"] - measured["batch_time_s"]) / measured["batch_time_s"]
    )
    assert [p["node"] for p in measured["placement"]] == ["n0", "n1"]
    assert len(doc["error"]["stages"]) == 2


@pytest.mark.ray
@pytest.mark.timeout(60)
def test_a_plan_the_live_cluster_cannot_run_is_refused_before_actors_start(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, files, address, tmp_path
) -> None:
    # valid for local-hetero (the spec given), but the live cluster has no node n2
    plan = Plan(16, (Stage((0, 4), ("n0/fast:0",), 8), Stage((4, 8), ("n2/slow:0",), 8)))
    plan.save(tmp_path / "plan.json")
    code, out, err = cli(
        monkeypatch, capsys, "run", "--plan", str(tmp_path / "plan.json"),
        "--model", "digits_cnn", "--cluster", "local-hetero", "--address", address,
    )  # fmt: skip
    assert code == 2 and not out
    assert err.strip().splitlines() == [
        "error: stages[1].devices: 'n2/slow:0' needs device type 'slow', which the live "
        "cluster does not have (types: fast, mid)"
    ]


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_tapp_with_a_measured_reward_runs_plans_on_the_cluster(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, files, address
) -> None:
    code, out, err = cli(
        monkeypatch, capsys, "plan", "--planner", "tapp", "--reward", "measured",
        "--model", "digits_cnn", "--cluster", str(files["cluster"]), "--address", address,
        "--batch", "16", "--budget", "3", "--iterations", "1", "-O", "batch_size=2",
        "--repeats", "1", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc["reward"] == "measured"
    runs = doc["measured"]["evaluated"]
    assert 1 <= len(runs) <= 3 and doc["evaluations"] == len(runs)
    ran = [r for r in runs if r["batch_time_s"] is not None]
    assert ran and all(r["value"] == r["batch_time_s"] > 0 for r in ran)
    assert all(r["predicted_batch_time_s"] > 0 for r in ran)  # the cost model's, beside it
    on_mid = [r for r in ran if any("mid" in d for s in r["plan"]["stages"] for d in s["devices"])]
    assert all(r["emulated"] for r in on_mid)  # mid is emulated at 2x, fast is not
    best = min(r["value"] for r in ran)
    assert doc["measured"]["best"]["batch_time_s"] == pytest.approx(best)
    assert doc["plan"] in [r["plan"] for r in ran]


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_measured_reward_caches_plans_and_reuses_actors(address) -> None:  # type: ignore[no-untyped-def]
    other_micro = Plan(16, tuple(Stage(s.layers, s.devices, 4) for s in TWO_STAGES.stages))
    runtime.connect(address)
    try:
        with MeasuredReward(ModelSource("digits_cnn", 8), SMALL, repeats=1) as reward:
            first = [o.value for o in reward.run([TWO_STAGES, other_micro])]
            again = [o.value for o in reward.run([other_micro])]
    finally:
        runtime.shutdown()
    assert all(v > 0 for v in first) and again[0] == first[1]
    assert reward.runs == 2
    assert reward.pipelines_started == 1  # same stages: the actors were reconfigured


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_workers_cost_plans_on_the_cluster_with_the_same_answer(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, files, address
) -> None:
    common = (
        "plan", "--planner", "genetic", "--model", "digits_cnn", "--cluster",
        str(files["cluster"]), "--batch", "16", "--budget", "200", "--json",
    )  # fmt: skip
    code, out, err = cli(monkeypatch, capsys, *common)
    assert code == 0, err
    alone = json.loads(out)
    code, out, err = cli(monkeypatch, capsys, *common, "--workers", "2", "--address", address)
    assert code == 0, err
    parallel = json.loads(out)
    assert parallel["plan"] == alone["plan"]
    assert parallel["evaluations"] == alone["evaluations"] > 0


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_calibrate_fits_the_cluster_and_writes_the_spec(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, files, address, tmp_path
) -> None:
    out = tmp_path / "small.calibrated.yaml"
    # fmt: off
    code, text, err = cli(
        monkeypatch, capsys, "calibrate", "--cluster", str(files["cluster"]), "--address",
        address, "--model", "digits_cnn", "--batch", "16", "--steps", "1", "--warmup", "1",
        "--out", str(out), "--json",
    )
    # fmt: on
    assert code == 0, err
    report = json.loads(text)
    # fast and mid alone at 16 and 4 samples, the two as a pipeline and as replicas of one
    # stage (BSP): 3 of 6 held out
    assert [p["held_out"] for p in report["probes"]] == [False, True] * 3
    assert len(Plan.from_dict(report["probes"][-1]["plan"]).stages[0].devices) == 2
    assert all(p["measured_s"] > 0 for p in report["probes"])
    assert report["summary"]["held_out_plans"] == 3
    spec = ClusterSpec.load(out)
    assert spec.calibration is not None
    assert set(spec.calibration.call_overhead) == {"fast", "mid"}
    assert spec.calibration.compute_scale == {}  # the profile was measured on the cluster
    assert spec.calibration.fit["runs"] == 6
    assert "inter_node" in spec.calibration.network  # the pipeline crossed nodes
    assert spec.calibrated(None).to_dict() == SMALL.to_dict()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cluster", "nope"], "nope"),
        (["--cluster", "local-hetero", "--batch", "0"], "batch: must be >= 1, got 0"),
        (["--cluster", "local-hetero", "--model", "nope"], "model: unknown 'nope'"),
        (["--cluster", "local-hetero", "--steps", "0"], "steps"),
    ],
)
def test_calibrate_refuses_bad_input_before_starting_ray(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, no_state, args, message
) -> None:
    code, out, err = cli(monkeypatch, capsys, "calibrate", *args)
    assert code == 2 and message in err and not out
