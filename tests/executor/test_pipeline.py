"""Pipelined training on a real 3-node local Ray cluster (local-hetero) equals single-process
training; actors sit on their nodes; infeasible plans are refused before any actor starts.

One cluster for the module; one set of 4 stage actors (3 stages, the last one replicated on
n2's two slow devices) serves every training test through ``Pipeline.reconfigure`` (fresh
weights; other microbatches, schedule, optimizer or model of 8 layers; same processes).
Their Ray metrics (executor.metrics) are read back from the nodes' metrics export ports.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families
from ray import cloudpickle

from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.executor import metrics
from pipeplan.executor.data import digits_batches, synthetic_batches
from pipeplan.executor.emulation import slowdown
from pipeplan.executor.live_cluster import discover, live_nodes, node_resource
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.model import Batch, ModelSource, OptimizerConfig, train_single_process
from pipeplan.executor.pipeline import Pipeline, RunConfig
from tests.executor import models
from tests.executor.actors import stage_workers_alive

pytestmark = pytest.mark.ray

SPEC = ClusterSpec.load(Path(__file__).parents[2] / "examples/clusters/local-hetero.yaml")
DIGITS = ModelSource("digits_cnn", 8, seed=3)
TOLERANCE = 1e-5
STEPS = 3
CONFIG = RunConfig(emulate=False, deterministic=True, timeout_s=60, start_timeout_s=150)

cloudpickle.register_pickle_by_value(models)  # workers receive the test models by value


def digits_plan(
    batch: int, micro: tuple[int, int, int], schedule: Schedule = Schedule.GPIPE
) -> Plan:
    return Plan(
        batch,
        (
            Stage((0, 3), ("n0/fast:0",), micro[0]),
            Stage((3, 5), ("n1/mid:0",), micro[1]),
            Stage((5, 8), ("n2/slow:0", "n2/slow:1"), micro[2]),
        ),
        schedule,
    )


def max_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def batches_for(source: ModelSource, batch: int) -> list[Batch]:
    _, example = source.build()
    return digits_batches(example, batch, STEPS, seed=1)


def train_and_compare(
    pipe: Pipeline,
    source: ModelSource,
    optimizer: OptimizerConfig,
    batches: list[Batch] | None = None,
) -> float:
    """Train ``STEPS`` batches (digits by default) on the pipeline and single-process;
    returns the largest parameter difference."""
    batches = batches or batches_for(source, pipe.plan.global_batch)
    results = [pipe.step(x, y) for x, y in batches]
    ref = train_single_process(source, batches, optimizer, deterministic=True)
    for got, want in zip(results, ref.losses, strict=True):
        assert got.loss == pytest.approx(want, abs=1e-5)
    diff = max_difference(pipe.parameters(), ref.parameters)
    for s, stage in enumerate(pipe.plan.stages):  # replicas keep identical weights
        first = pipe.stage_parameters(s, 0)
        for k in range(1, stage.replicas):
            assert max_difference(pipe.stage_parameters(s, k), first) == 0.0
    moved = max_difference(
        pipe.parameters(), train_single_process(source, [], optimizer).parameters
    )
    assert moved > 1e-3, "training did not change the parameters"
    print(f"{pipe.plan.schedule} {[s.microbatch for s in pipe.plan.stages]}: max |diff| {diff:.2e}")
    return diff


@pytest.fixture(scope="module")
def digits_pipe(cluster: LocalCluster) -> Iterator[Pipeline]:
    with Pipeline(digits_plan(16, (4, 4, 4)), DIGITS, SPEC, CONFIG) as pipe:
        yield pipe


@pytest.mark.timeout(240)
def test_actors_sit_on_their_plan_nodes(digits_pipe: Pipeline) -> None:
    marker_of = {
        n["NodeID"]: k for n in ray.nodes() if n["Alive"] for k in n["Resources"]
        if k.startswith("pipeplan_node:")
    }  # fmt: skip
    seen = {(p.stage, p.replica): marker_of[p.node_id] for p in digits_pipe.placement}
    assert seen == {
        (0, 0): node_resource("n0"),
        (1, 0): node_resource("n1"),
        (2, 0): node_resource("n2"),
        (2, 1): node_resource("n2"),
    }
    assert len({p.pid for p in digits_pipe.placement}) == 4


@pytest.mark.timeout(120)
def test_gpipe_with_replicas_matches_single_process(digits_pipe: Pipeline) -> None:
    digits_pipe.reconfigure(digits_plan(16, (4, 4, 4)), CONFIG)
    assert train_and_compare(digits_pipe, DIGITS, CONFIG.optimizer) < TOLERANCE


@pytest.mark.timeout(120)
def test_1f1b_matches_single_process(digits_pipe: Pipeline) -> None:
    digits_pipe.reconfigure(digits_plan(16, (4, 4, 4), Schedule.ONE_F_ONE_B), CONFIG)
    assert train_and_compare(digits_pipe, DIGITS, CONFIG.optimizer) < TOLERANCE


@pytest.mark.timeout(120)
def test_unequal_microbatches_uneven_replica_shares_and_momentum(digits_pipe: Pipeline) -> None:
    # 12 samples: stage 0 in 3 x 4, stage 1 in 2 x 6, stage 2 in 4 x 3 split 2 + 1 on replicas.
    config = RunConfig(
        optimizer=OptimizerConfig(lr=0.05, momentum=0.9), emulate=False, deterministic=True
    )
    digits_pipe.reconfigure(digits_plan(12, (4, 6, 3)), config)
    assert train_and_compare(digits_pipe, DIGITS, config.optimizer) < TOLERANCE


@pytest.mark.timeout(120)
def test_remainder_microbatches_match_single_process(digits_pipe: Pipeline) -> None:
    # 14 samples: stage 0 in 4+4+4+2, stage 1 in 6+6+2, stage 2 in 3+3+3+3+2 (the last
    # split 1 + 1 on its replicas): no microbatch divides the batch.
    config = RunConfig(
        optimizer=OptimizerConfig(lr=0.05, momentum=0.9), emulate=False, deterministic=True
    )
    digits_pipe.reconfigure(digits_plan(14, (4, 6, 3)), config)
    assert train_and_compare(digits_pipe, DIGITS, config.optimizer) < TOLERANCE


@pytest.mark.timeout(120)
def test_unequal_1f1b_with_remainders_matches_single_process(digits_pipe: Pipeline) -> None:
    # 1F1B with b = (2, 5, 4) on 14 samples: warm-ups (5, 1, 0) from rule 5's recurrence;
    # stage 1 in 5+5+4, stage 2 in 4+4+4+2.
    plan = digits_plan(14, (2, 5, 4), Schedule.ONE_F_ONE_B)
    digits_pipe.reconfigure(plan, CONFIG)
    assert train_and_compare(digits_pipe, DIGITS, CONFIG.optimizer) < TOLERANCE


@pytest.mark.timeout(120)
def test_adam_with_1f1b_matches_single_process_in_float64(digits_pipe: Pipeline) -> None:
    # Adam divides by sqrt(v) + 1e-8: a gradient summed over microbatches in another order
    # (float32 rounding, ~1e-7 relative) moves near-zero entries by up to ~1e-5 even without
    # any pipeline (accumulating two microbatches in one process does the same), so the
    # exactness of the pipelined Adam update is checked in float64.
    model, example = DIGITS.build()
    source = ModelSource.custom(model.double(), example.double(), name="digits_cnn_f64")
    config = RunConfig(
        optimizer=OptimizerConfig("adam", lr=0.01), emulate=False, deterministic=True
    )
    plan = digits_plan(16, (8, 8, 8), Schedule.ONE_F_ONE_B)
    digits_pipe.reconfigure(plan, config, model=source)
    assert train_and_compare(digits_pipe, source, config.optimizer) < 1e-12


def recomputing(plan: Plan, stages: tuple[int, ...]) -> Plan:
    """``plan`` with activation recomputation on ``stages``."""
    return Plan(
        plan.global_batch,
        tuple(dataclasses.replace(st, recompute=s in stages) for s, st in enumerate(plan.stages)),
        plan.schedule,
    )


@pytest.mark.timeout(120)
def test_gpipe_with_recomputing_stages_matches_single_process(digits_pipe: Pipeline) -> None:
    # stages 0 and 2 (replicated) rerun their forwards before each backward
    plan = recomputing(digits_plan(16, (4, 4, 4)), (0, 2))
    digits_pipe.reconfigure(plan, CONFIG, model=DIGITS)  # the float32 model again
    assert train_and_compare(digits_pipe, DIGITS, CONFIG.optimizer) < TOLERANCE


@pytest.mark.timeout(120)
def test_unequal_1f1b_with_a_recomputing_stage_matches_single_process(
    digits_pipe: Pipeline,
) -> None:
    plan = recomputing(digits_plan(14, (2, 5, 4), Schedule.ONE_F_ONE_B), (1,))
    digits_pipe.reconfigure(plan, CONFIG, model=DIGITS)
    assert train_and_compare(digits_pipe, DIGITS, CONFIG.optimizer) < TOLERANCE


@pytest.mark.timeout(120)
def test_emulated_measurement(digits_pipe: Pipeline) -> None:
    config = RunConfig(emulate=True, timeout_s=60)
    digits_pipe.reconfigure(digits_plan(16, (8, 4, 4)), config, model=DIGITS)
    m = digits_pipe.measure(batches_for(DIGITS, 16), warmup=1)
    assert m.emulated and "EMULATED" in m.summary() and m.to_dict()["note"].startswith("EMULATED")
    assert (m.steps, m.warmup, len(m.losses), len(m.batch_times_s)) == (STEPS - 1, 1, STEPS, 2)
    assert m.batch_time_min_s <= m.batch_time_s <= m.batch_time_max_s
    assert m.throughput == pytest.approx(16 / m.batch_time_s)
    assert 0.0 < m.comm_fraction < 1.0
    fast, _, slow = m.stages
    # Each forward and backward lasts max(wall, k x its CPU time), k the type's slowdown
    # (local-hetero: fast 2.5, slow 10), the sleep making up the difference (at most (k-1)/k
    # of it, as wall >= CPU -- up to the two clocks' granularity: a short compute may read a
    # few microseconds more CPU than wall time); the memory-bound update is not slowed
    for stage, k in ((fast, slowdown(SPEC, "fast")), (slow, slowdown(SPEC, "slow"))):
        assert stage.compute_s >= k * stage.cpu_s * (1 - 1e-9)
        assert 0.0 <= stage.emulated_s <= (k - 1) / k * stage.compute_s * (1 + 1e-3)
    assert slow.emulated_s > 0.0 and fast.cpu_s > 0.0


def ray_metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of Ray's metrics endpoints (one per live node, ``MetricsExportPort``):
    ``(name, labels without Ray's per-process ones) -> value`` summed over processes."""
    own = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId"}
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for node in (n for n in ray.nodes() if n["Alive"]):
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k not in own}
                labels = {k: v for k, v in labels.items() if not k.startswith("otel_")}
                key = (sample.name, tuple(sorted(labels.items())))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def metric(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, got), v in samples.items() if n == name and want <= set(got))


@pytest.mark.timeout(120)
def test_stage_actors_and_the_driver_publish_ray_metrics(digits_pipe: Pipeline) -> None:
    """executor.metrics read back from Ray's metrics export port: every stage's compute
    (recorded by its actors) and transfer, the batch time and samples per second (by the
    driver). Processes hand their metrics over every 10 s (Ray's default), so this waits."""
    digits_pipe.reconfigure(digits_plan(16, (4, 4, 4)), CONFIG, model=DIGITS)
    x, y = batches_for(DIGITS, 16)[0]
    digits_pipe.step(x, y)  # 4 microbatches: 4 forwards per stage replica at least
    compute = metrics.STAGE_COMPUTE.exported + "_count"
    wanted = {("0", "fast"): 4.0, ("1", "mid"): 4.0, ("2", "slow"): 8.0}  # stage 2: 2 replicas

    def published(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> bool:
        return (
            all(
                metric(samples, compute, stage=s, device_type=t, op=op) >= n
                for (s, t), n in wanted.items()
                for op in ("forward", "backward")
            )
            and metric(samples, metrics.BATCH.exported + "_count", model="digits_cnn") >= 1
        )

    deadline = time.monotonic() + 45
    while not published(samples := ray_metrics()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert published(samples), sorted(k for k in samples if "pipeplan" in k[0])
    assert metric(samples, compute, stage="0", op="update") >= 1
    transfer = metrics.STAGE_TRANSFER.exported + "_count"
    assert metric(samples, transfer, stage="1", device_type="mid", op="forward") >= 4
    assert metric(samples, transfer, stage="2", device_type="slow", op="backward") >= 8
    assert metric(samples, metrics.THROUGHPUT.exported + "_count", cluster="local-hetero") >= 1
    assert metric(samples, metrics.STAGE_COMPUTE.exported + "_sum", stage="2") > 0


@pytest.mark.timeout(120)
def test_dag_with_relayed_skip_get_attr_and_replicas(digits_pipe: Pipeline) -> None:
    # SkipNet has digits_cnn's 8 layers, so the same actors serve: its skip crosses from
    # stage 0 to stage 2 through stage 1, and stage 2 holds a get_attr parameter. Unequal
    # microbatches 4, 8, 2 (the last split 1 + 1 over two replicas).
    module, example = models.skipnet(seed=5)
    source = ModelSource.custom(module, example, name="skipnet")
    config = RunConfig(optimizer=OptimizerConfig(lr=0.1), emulate=False, deterministic=True)
    digits_pipe.reconfigure(digits_plan(16, (4, 8, 2)), config, model=source)
    assert train_and_compare(digits_pipe, source, config.optimizer) < TOLERANCE


@pytest.mark.timeout(120)
def test_token_model_with_a_shared_position_embedding(digits_pipe: Pipeline) -> None:
    # TinyLM's position embedding (no batch dimension) crosses stage 0 -> 1: every piece
    # carries it forward, and each gradient piece is counted by exactly one stage-0 op.
    module, tokens = models.tiny_lm(seed=2)
    source = ModelSource.custom(module, tokens, name="tiny_lm")
    batches = synthetic_batches(tokens, (1, 6, 16), 16, STEPS, seed=4)
    config = RunConfig(optimizer=OptimizerConfig(lr=0.1), emulate=False, deterministic=True)
    digits_pipe.reconfigure(digits_plan(16, (4, 8, 2)), config, model=source)
    assert train_and_compare(digits_pipe, source, config.optimizer, batches) < TOLERANCE


@pytest.mark.timeout(60)
def test_an_actor_runs_one_submitters_tasks_in_submission_order(cluster: LocalCluster) -> None:
    """The executor chains no argument between a worker's operations (:mod:`executor.stage`):
    it relies on a sequential actor running one submitter's tasks in submission order, even
    when an earlier task still waits for its argument and a later one is ready."""

    @ray.remote(num_cpus=0)
    def late(x: int) -> int:
        time.sleep(1.0)
        return x

    @ray.remote(num_cpus=0)
    class Log:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def add(self, i: int, *inputs: int) -> list[int]:
            self.seen.append(i)
            return self.seen

    log = Log.remote()  # type: ignore[attr-defined]
    ray.get(log.add.remote(0))
    first = log.add.remote(1, late.remote(7))  # waits a second for its argument
    second = log.add.remote(2)  # ready at once
    assert ray.get(second, timeout=30) == [0, 1, 2]
    assert ray.get(first, timeout=30) == [0, 1]
    ray.kill(log)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("n0/gpu:0", "device type 'gpu'"),
        ("n7/fast:0", "node 'n7'"),
        ("n1/mid:1", "2 'mid' devices on node 'n1'"),
    ],
)
def test_infeasible_plan_is_refused_before_any_actor(
    cluster: LocalCluster, device: str, message: str
) -> None:
    plan = Plan(8, (Stage((0, 3), ("n1/mid:0",), 4), Stage((3, 8), (device,), 4)))
    before = stage_workers_alive()
    with pytest.raises(PlanError, match=message), Pipeline(plan, DIGITS, SPEC, CONFIG):
        pass
    assert stage_workers_alive() == before


@pytest.mark.timeout(60)
def test_discover_reads_the_live_cluster(cluster: LocalCluster) -> None:
    found = discover(SPEC)
    assert {n.name: dict(n.devices) for n in found.nodes} == {
        n.name: dict(n.devices) for n in SPEC.nodes
    }
    assert found.device_types["slow"] == SPEC.device_types["slow"]
    assert {n.name for n in live_nodes()} == {"n0", "n1", "n2"}
    assert cluster.slowdown("slow") == 10.0 and cluster.slowdown("fast") == 2.5  # headroom 2.5


def test_every_node_binds_loopback(cluster: LocalCluster) -> None:
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert addresses == {"127.0.0.1"}
    assert cluster.address.startswith("127.0.0.1:")


def test_no_node_takes_rays_default_agent_port(cluster: LocalCluster) -> None:
    ports = {n.get("DashboardAgentListenPort") for n in ray.nodes() if n["Alive"]}
    assert 52365 not in ports and len(ports) == len(cluster.node_names)
