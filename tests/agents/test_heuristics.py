"""The heuristic baselines: ``balanced``, ``data_parallel`` and ``greedy``."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from pipeplan.agents import InfeasibleError, Objective, Problem, ProblemError, make_planner
from pipeplan.agents.baselines.balanced import balanced_bounds
from pipeplan.agents.baselines.data_parallel import provisioning_sets
from pipeplan.agents.baselines.greedy import data_intensive, initial_structure, ridge_point, runs
from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.profile import LayerProfile, ModelProfile

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "examples" / "clusters").glob("*.yaml"))
HEURISTICS = ("uniform", "balanced", "data_parallel", "greedy")


@pytest.fixture(scope="module")
def alexnet() -> ModelProfile:
    return load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")


def chain(*layers: tuple[str, int, float, int]) -> ModelProfile:
    """A chain of (op, params bytes, flops, activation bytes) layers, no timings."""
    n = len(layers)
    return ModelProfile(
        "synthetic",
        (8,),
        tuple(
            LayerProfile(f"l{i}", op, params, flops, act, (i + 1,) if i + 1 < n else ())
            for i, (op, params, flops, act) in enumerate(layers)
        ),
    )


def cpu_gpu_cluster(gpus: int = 2) -> ClusterSpec:
    return ClusterSpec(
        "cpu-gpu",
        {
            "cpu": DeviceType("cpu", 1e11, 64, 50, 0.2),
            "gpu": DeviceType("gpu", 1e13, 16, 900, 2.0),
        },
        (Node("n0", {"cpu": 1}), Node("n1", {"gpu": gpus})),
    )


# --- every planner, every preset ----------------------------------------------------------------


@pytest.mark.parametrize("objective", list(Objective))
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
@pytest.mark.parametrize("name", HEURISTICS)
def test_valid_memory_feasible_plan_on_every_preset(
    name: str, preset: Path, objective: Objective, alexnet: ModelProfile
) -> None:
    cluster = ClusterSpec.load(preset)
    problem = Problem(alexnet, cluster, objective, global_batch=32)
    result = make_planner(name).plan(problem)
    result.plan.validate(alexnet, cluster)
    est = simulate(result.plan, alexnet, cluster)
    assert est.fits
    assert est.batch_time_s == pytest.approx(result.estimate.batch_time_s, rel=1e-9)
    assert result.value == pytest.approx(problem.score_estimate(est), rel=1e-9)
    assert result.planner == name and result.evaluations > 0


@pytest.mark.parametrize("name", HEURISTICS)
def test_same_seed_same_plan(name: str, alexnet: ModelProfile) -> None:
    cluster = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")
    plans = [
        make_planner(name).plan(Problem(alexnet, cluster, Objective.TIME, 32, seed=7)).plan
        for _ in range(2)
    ]
    assert plans[0] == plans[1]


# --- the cost objective -------------------------------------------------------------------------


@pytest.mark.parametrize("name", HEURISTICS)
def test_cost_plan_meets_min_throughput_or_says_why(name: str, alexnet: ModelProfile) -> None:
    cluster = ClusterSpec.load(ROOT / "examples/clusters/cloud-mix.yaml")
    target = 4000.0
    problem = Problem(alexnet, cluster, Objective.COST, 64, min_throughput=target)
    try:
        result = make_planner(name).plan(problem)
    except InfeasibleError as e:
        assert "min_throughput 4000" in str(e)
    else:
        assert result.estimate.throughput >= target and result.estimate.fits


@pytest.mark.parametrize("name", HEURISTICS)
def test_unreachable_throughput_target_is_named(name: str, alexnet: ModelProfile) -> None:
    cluster = ClusterSpec.load(ROOT / "examples/clusters/cloud-mix.yaml")
    problem = Problem(alexnet, cluster, Objective.COST, 64, min_throughput=1e9)
    with pytest.raises(InfeasibleError, match=r"min_throughput 1e\+09 samples/s"):
        make_planner(name).plan(problem)


@pytest.mark.parametrize("name", HEURISTICS)
def test_nothing_fits_in_memory_is_named(name: str) -> None:
    cluster = ClusterSpec(
        "tiny-memory",
        {"cpu": DeviceType("cpu", 1e11, 0.001), "gpu": DeviceType("gpu", 1e13, 0.002)},
        (Node("n0", {"cpu": 1}), Node("n1", {"gpu": 2})),
    )
    model = chain(("conv", 4_000_000, 1e9, 100_000), ("fc", 8_000_000, 2e9, 1_000))
    with pytest.raises(InfeasibleError, match="memory"):
        make_planner(name).plan(Problem(model, cluster, Objective.TIME, 8))


def test_greedy_cost_drops_devices_below_its_fastest_plan(alexnet: ModelProfile) -> None:
    cluster = ClusterSpec.load(ROOT / "examples/clusters/cloud-mix.yaml")
    fast = make_planner("greedy").plan(Problem(alexnet, cluster, Objective.TIME, 64))
    target = 0.5 * fast.estimate.throughput
    cheap = make_planner("greedy").plan(
        Problem(alexnet, cluster, Objective.COST, 64, min_throughput=target)
    )
    assert cheap.estimate.throughput >= target
    assert cheap.estimate.cost_per_sample < fast.estimate.cost_per_sample
    assert cheap.estimate.cost_per_hour < fast.estimate.cost_per_hour


# --- balanced -----------------------------------------------------------------------------------

EQUAL_SPLITS = [3, 0, 1, 2, 0, 2, 0, 1, 3, 0, 0]  # 12 bytes: equal stages for S = 1..4


@pytest.mark.parametrize(
    ("parts", "expected"),
    [(1, [0, 11]), (2, [0, 5, 11]), (3, [0, 3, 7, 11]), (4, [0, 2, 5, 8, 11])],
)
def test_balanced_bounds_split_parameters_equally(parts: int, expected: list[int]) -> None:
    bounds = balanced_bounds(EQUAL_SPLITS, parts)
    sums = [sum(EQUAL_SPLITS[a:b]) for a, b in itertools.pairwise(bounds)]
    assert sums == [12 // parts] * parts
    assert bounds == expected  # among equal splits, the most even layer counts


def test_balanced_bounds_reach_the_smallest_bottleneck() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 9))
        weights = [int(w) for w in rng.integers(0, 6, n)]
        for parts in range(1, n + 1):
            bounds = balanced_bounds(weights, parts)
            assert bounds[0] == 0 and bounds[-1] == n
            assert all(a < b for a, b in itertools.pairwise(bounds))
            best = min(
                max(sum(weights[a:b]) for a, b in itertools.pairwise((0, *cuts, n)))
                for cuts in itertools.combinations(range(1, n), parts - 1)
            )
            assert max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)) == best


def test_balanced_plan_has_equal_parameters_per_stage() -> None:
    profile = chain(*[("fc", w * 1_000_000, 1e9, 4096) for w in EQUAL_SPLITS])
    cluster = ClusterSpec(
        "four", {"gpu": DeviceType("gpu", 1e13, 16, 900)}, (Node("n0", {"gpu": 4}),)
    )
    result = make_planner("balanced").plan(Problem(profile, cluster, Objective.TIME, 16))
    params = [
        sum(x.params_bytes for x in profile.layers[st.start : st.end]) for st in result.plan.stages
    ]
    assert len(set(params)) == 1
    assert [st.replicas for st in result.plan.stages] == [1] * len(params)


def test_balanced_bounds_refuse_more_parts_than_layers() -> None:
    with pytest.raises(ValueError, match=r"parts: must be in \[1, 3\] for 3 layers, got 4"):
        balanced_bounds([1, 2, 3], 4)


# --- data_parallel ------------------------------------------------------------------------------


@pytest.mark.parametrize("objective", list(Objective))
def test_data_parallel_plan_has_one_stage(objective: Objective, alexnet: ModelProfile) -> None:
    cluster = ClusterSpec.load(ROOT / "examples/clusters/tapp-paper.yaml")
    result = make_planner("data_parallel").plan(Problem(alexnet, cluster, objective, 32))
    assert result.plan.num_stages == 1
    assert result.plan.stages[0].layers == (0, len(alexnet))


def test_data_parallel_replicates_when_devices_are_alike() -> None:
    # compute-heavy, parameter-light: all four replicas beat fewer
    profile = chain(*[("conv", 1000, 1e10, 4096) for _ in range(4)])
    cluster = ClusterSpec(
        "four", {"gpu": DeviceType("gpu", 1e13, 16, 900)}, (Node("n0", {"gpu": 4}),)
    )
    result = make_planner("data_parallel").plan(Problem(profile, cluster, Objective.TIME, 16))
    assert result.plan.stages[0].replicas == 4


def test_provisioning_sets_cover_every_count_vector() -> None:
    cluster = ClusterSpec.load(ROOT / "examples/clusters/cloud-mix.yaml")
    sets = list(provisioning_sets(cluster))
    counts = cluster.counts_by_type()
    assert len(sets) == int(np.prod([n + 1 for n in counts.values()])) - 1
    ids = cluster.device_ids
    vectors = {
        tuple(sorted((t, sum(cluster.device(ids[i]).type == t for i in s)) for t in counts))
        for s in sets
    }
    assert len(vectors) == len(sets)
    assert all(len(set(s)) == len(s) > 0 for s in sets)


# --- greedy -------------------------------------------------------------------------------------


def test_layers_are_classified_by_activation_bytes_per_flop() -> None:
    profile = chain(
        ("embedding", 10**8, 1e3, 4096),
        ("dropout", 0, 1e3, 4096),  # follows the embedding
        ("norm", 100, 1e3, 4096),  # follows too
        ("fc", 10**6, 1e9, 4096),  # 4e-6 bytes/FLOP
        ("relu", 0, 1e3, 4096),  # follows the fc
        ("other", 0, 1e4, 4096),  # 0.4 bytes/FLOP
        ("fc", 10**6, 1e9, 4096),
    )
    assert data_intensive(profile, 0.05) == [True, True, True, False, False, True, False]
    assert data_intensive(profile, 1.0) == [True, True, True, False, False, False, False]
    assert runs(data_intensive(profile, 0.05)) == [(0, 3, True), (3, 5, False), (5, 6, True),
                                                   (6, 7, False)]  # fmt: skip


def test_ridge_point_is_the_fastest_types_bytes_per_flop() -> None:
    assert ridge_point(cpu_gpu_cluster()) == pytest.approx(900e9 / 1e13)


def test_initial_schedule_sends_data_runs_to_the_cpu() -> None:
    cluster = cpu_gpu_cluster(gpus=2)  # device order: n0/cpu:0, n1/gpu:0, n1/gpu:1
    labels = [True, True, False, False, True, False]
    # one CPU: only the larger data run keeps it, the other is folded into compute
    bounds, devices = initial_structure(cluster, labels, [5, 5, 1, 1, 1, 1])
    assert bounds == (0, 2, 6) and devices == ((0,), (1,))
    # a cluster of one type has nothing CPU-like
    one = ClusterSpec("one", {"gpu": DeviceType("gpu", 1e13, 16)}, (Node("n", {"gpu": 2}),))
    assert initial_structure(one, labels) == ((0, 6), ((0,),))


def test_greedy_puts_the_embedding_on_the_cpu() -> None:
    # HeterPS's case: a 5 GB table (20 GB with gradients and Adam) fits only the CPU
    profile = chain(
        ("embedding", 5 * 10**9, 1e3, 4096),
        *[("fc", 4 * 10**6, 1e9, 4096) for _ in range(6)],
    )
    cluster = cpu_gpu_cluster(gpus=2)
    result = make_planner("greedy").plan(Problem(profile, cluster, Objective.TIME, 32))
    first = result.plan.stages[0]
    assert first.layers[0] == 0
    assert {cluster.device(d).type for d in first.devices} == {"cpu"}
    later = [d for st in result.plan.stages[1:] for d in st.devices]
    assert later and {cluster.device(d).type for d in later} == {"gpu"}


def test_greedy_splits_a_model_too_big_for_one_device() -> None:
    # 8 layers of 1 GB parameters: 32 GB of weights and optimizer state, 16 GB per GPU
    profile = chain(*[("fc", 10**9, 1e9, 4096) for _ in range(8)])
    cluster = ClusterSpec(
        "four", {"gpu": DeviceType("gpu", 1e13, 16, 900)}, (Node("n0", {"gpu": 4}),)
    )
    result = make_planner("greedy").plan(Problem(profile, cluster, Objective.TIME, 8))
    assert result.estimate.fits and result.plan.num_stages >= 3


def test_greedy_rejects_a_bad_threshold() -> None:
    with pytest.raises(ProblemError, match="threshold: must be > 0, got -1"):
        make_planner("greedy", threshold=-1)
