"""Stages on GPUs: a device type with ``accelerator: cuda`` runs its stages on a GPU.

Without a GPU (most machines here) the plumbing is tested: what a stage actor asks Ray for,
which torch device a stage computes on, and that a node without CUDA is refused before
anything starts, naming the device type and the node. The ``gpu``-marked test trains on
CUDA wherever it is present (a local cluster of two GPU nodes sharing this machine's GPUs)
and checks that the pipeline computes what single-process training on the GPU computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import accelerators, checkpoint
from pipeplan.executor.accelerators import (
    check_machine,
    check_nodes,
    local_device,
    local_gpus,
    torch_device,
)
from pipeplan.executor.data import digits_batches, synthetic_batches
from pipeplan.executor.emulation import is_emulated, slowdown
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.live_cluster import LiveNode, device_resource, node_resource, nodes_from_ray
from pipeplan.executor.local_cluster import LocalCluster
from pipeplan.executor.measured_profile import measure_profile
from pipeplan.executor.model import ModelSource, OptimizerConfig, train_single_process
from pipeplan.executor.pinning import MARKER_SHARE, actor_options
from pipeplan.executor.stage import StageWorker, WorkerSpec
from pipeplan.executor.transport import backend_for, wire_device

GPU_SPEC = ClusterSpec(
    "gpus",
    {
        "cpu": DeviceType("cpu", flops=2e11, memory_gb=16),
        "a100": DeviceType("a100", flops=3e14, memory_gb=40, accelerator="cuda"),
    },
    (Node("n0", {"a100": 2, "cpu": 1}), Node("n1", {"cpu": 1})),
)
DIGITS = ModelSource("digits_cnn", 8, seed=5)


def live(name: str, devices: dict[str, int], gpus: float, marked: bool = True) -> LiveNode:
    return LiveNode(name, name.encode().hex().ljust(56, "0"), devices, marked, 1e9, gpus)


def worker_spec(accelerator: str | None, device: str = "n0/a100:0") -> WorkerSpec:
    return WorkerSpec(
        stage=0,
        replica=0,
        device=device,
        node="n0",
        bounds=(0, 3, 8),
        global_batch=8,
        model=DIGITS,
        optimizer=OptimizerConfig(),
        accelerator=accelerator,
    )


# --- what a stage actor asks Ray for -----------------------------------------------------------


def test_a_cuda_stage_asks_for_one_gpu_besides_its_device_and_node() -> None:
    nodes = [live("n0", {"a100": 2, "cpu": 1}, gpus=2)]
    options = actor_options("n0/a100:1", nodes, "cuda")
    assert options["num_gpus"] == 1 and options["num_cpus"] == 0
    assert options["resources"] == {device_resource("a100"): 1.0, node_resource("n0"): MARKER_SHARE}


def test_a_cpu_stage_asks_for_no_gpu() -> None:
    nodes = [live("n0", {"a100": 2, "cpu": 1}, gpus=2)]
    options = actor_options("n0/cpu:0", nodes, None)
    assert options["num_gpus"] == 0
    assert options["resources"] == {device_resource("cpu"): 1.0, node_resource("n0"): MARKER_SHARE}


def test_an_unmarked_gpu_node_is_reached_by_affinity_and_still_asks_for_a_gpu() -> None:
    nodes = [live("n0", {"a100": 1}, gpus=1, marked=False)]
    options = actor_options("n0/a100:0", nodes, "cuda")
    assert options["num_gpus"] == 1 and options["resources"] == {device_resource("a100"): 1.0}
    assert options["scheduling_strategy"].node_id == nodes[0].node_id


def test_live_nodes_read_rays_gpu_resource() -> None:
    records = [
        {"Alive": True, "NodeID": "ab" * 14, "Resources": {"GPU": 2.0, "device:a100": 2.0}},
        {"Alive": True, "NodeID": "cd" * 14, "Resources": {"device:cpu": 1.0}},
    ]
    gpus = {n.devices.get("a100", 0): n.gpus for n in nodes_from_ray(records)}
    assert gpus == {2: 2.0, 0: 0.0}


# --- which torch device a stage computes on -----------------------------------------------------


def test_device_mapping() -> None:
    assert torch_device(None) == torch.device("cpu")
    assert torch_device("cuda") == torch.device("cuda", 0)  # the one GPU Ray shows the actor
    with pytest.raises(ExecutorError, match="'tpu' is not one the executor runs"):
        torch_device("tpu")
    assert accelerators.accelerator_of(GPU_SPEC, "a100") == "cuda"
    assert accelerators.accelerator_of(GPU_SPEC, "cpu") is None
    assert accelerators.cuda_devices_of(GPU_SPEC, GPU_SPEC.nodes[0]) == {"a100": 2}


def test_a_cpu_stage_worker_computes_on_the_cpu() -> None:
    worker = StageWorker(worker_spec(None, "n0/cpu:0"))
    assert worker.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in worker.params.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a process without CUDA")
def test_a_cuda_stage_worker_without_cuda_says_so() -> None:
    with pytest.raises(ExecutorError, match="device type a100 needs CUDA but node n0 has none"):
        StageWorker(worker_spec("cuda"))
    with pytest.raises(ExecutorError, match=r"torch.cuda.is_available\(\) is False"):
        local_device("cuda", "a100", "n0")


def test_a_real_spec_is_not_emulated() -> None:
    """A GPU's flops must not slow the cluster's real CPUs down by 1500x."""
    assert [slowdown(GPU_SPEC, t) for t in ("cpu", "a100")] == [1.0, 1.0]
    assert not is_emulated(GPU_SPEC)


# --- a node without CUDA is refused before anything starts --------------------------------------


def test_a_node_without_gpus_is_refused_naming_type_and_node() -> None:
    nodes = [live("n0", {"a100": 2, "cpu": 1}, gpus=0), live("n1", {"cpu": 1}, gpus=0)]
    types = accelerators.accelerators(GPU_SPEC)
    with pytest.raises(ExecutorError) as err:
        check_nodes(types, ["n1/cpu:0", "n0/a100:0"], nodes)
    assert str(err.value).startswith("device type a100 needs CUDA but node n0 has none")
    check_nodes(types, ["n0/cpu:0", "n1/cpu:0"], nodes)  # CPU devices need no GPU


def test_a_node_with_too_few_gpus_is_refused() -> None:
    nodes = [live("n0", {"a100": 2, "cpu": 1}, gpus=1)]
    types = accelerators.accelerators(GPU_SPEC)
    with pytest.raises(ExecutorError, match=r"node n0: 2 CUDA devices .* Ray counts 1 GPUs"):
        check_nodes(types, ["n0/a100:0", "n0/a100:1"], nodes)
    check_nodes(types, ["n0/a100:1"], nodes)


def test_join_refuses_a_machine_without_enough_cuda() -> None:
    gpu_node, cpu_node = GPU_SPEC.nodes
    with pytest.raises(ExecutorError, match="device type a100 needs CUDA but node n0 has none"):
        check_machine(GPU_SPEC, gpu_node, cuda_count=0)
    with pytest.raises(ExecutorError, match=r"node n0: .* 2 CUDA devices \(2 a100\) .* has 1"):
        check_machine(GPU_SPEC, gpu_node, cuda_count=1)
    assert check_machine(GPU_SPEC, gpu_node, cuda_count=4) == 2  # GPUs the node advertises
    assert check_machine(GPU_SPEC, cpu_node, cuda_count=0) == 0


# --- on CUDA: pipelined training equals single-process training ----------------------------------

CUDA_SPEC = ClusterSpec(
    "two-gpu-nodes",
    {
        "gpu": DeviceType("gpu", flops=1e14, memory_gb=8, accelerator="cuda"),
        "cpu": DeviceType("cpu", flops=1e14, memory_gb=8),
    },
    (Node("g0", {"gpu": 1}), Node("g1", {"gpu": 1}), Node("c0", {"cpu": 1})),
)


def test_a_local_node_gives_ray_its_cuda_devices_up_to_this_machines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nodes of a local cluster share this machine's GPUs: each tells Ray its spec's CUDA
    devices, at most the machine's; none without CUDA (then a CUDA plan is refused early)."""
    n0, n1 = GPU_SPEC.nodes  # n0: two a100 and a cpu; n1: a cpu
    for machine, want in ((0, 0), (1, 1), (4, 2)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda m=machine: m)
        assert local_gpus(GPU_SPEC, n0) == want
        assert local_gpus(GPU_SPEC, n1) == 0
    assert LocalCluster(GPU_SPEC)._node_args(n0)["num_gpus"] == 2


def test_the_backend_and_where_a_message_lives() -> None:
    """gloo for CPU stages; with a CUDA stage ``cpu:gloo,cuda:nccl``: GPU to GPU over NCCL,
    anything with a CPU stage at an end through host memory over gloo."""
    assert backend_for([None, None]) == "gloo"
    assert backend_for([None, "cuda"]) == "cpu:gloo,cuda:nccl"
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert wire_device(gpu, "cuda") == gpu
    assert wire_device(gpu, None) == cpu and wire_device(cpu, "cuda") == cpu


@pytest.fixture(scope="module")
def cuda_cluster() -> Iterator[LocalCluster]:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine (torch.cuda.is_available() is False)")
    with LocalCluster(CUDA_SPEC, object_store_mb=200) as cluster:
        yield cluster


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_pipelined_training_on_cuda_equals_single_process(cuda_cluster: LocalCluster) -> None:
    """Two GPUs: both stages on CUDA, their messages over NCCL. One GPU: the second stage
    on the CPU, so the pair talks gloo through host memory (NCCL needs a GPU per rank)."""
    from pipeplan.executor.pipeline import Pipeline, RunConfig

    second = "g1/gpu:0" if torch.cuda.device_count() >= 2 else "c0/cpu:0"
    plan = Plan(16, (Stage((0, 3), ("g0/gpu:0",), 4), Stage((3, 8), (second,), 8)))
    optimizer = OptimizerConfig(momentum=0.9)
    config = RunConfig(emulate=False, deterministic=True, optimizer=optimizer, timeout_s=120)
    _, example = DIGITS.build()
    batches = digits_batches(example, 16, 3, seed=2)
    with Pipeline(plan, DIGITS, CUDA_SPEC, config) as pipe:
        results = [pipe.step(x, y) for x, y in batches]
        params = pipe.parameters()
    ref = train_single_process(DIGITS, batches, optimizer, deterministic=True, device="cuda")
    for got, want in zip(results, ref.losses, strict=True):
        assert got.loss == pytest.approx(want, abs=1e-4)
    diff = max(float((params[n] - ref.parameters[n]).abs().max()) for n in ref.parameters)
    assert diff < 1e-4, f"pipelined parameters differ from single-process ones by {diff}"
    start = train_single_process(DIGITS, [], optimizer).parameters
    assert max(float((params[n] - start[n]).abs().max()) for n in start) > 1e-3


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_cuda_type_is_profiled_on_its_gpu(cuda_cluster: LocalCluster) -> None:
    """``profile --measure`` on a spec with a CUDA type: its profiler actor gets the GPU and
    every layer has measured times on both types (by the wall clock, nothing emulated)."""
    profile = measure_profile(
        DIGITS, CUDA_SPEC, batch_sizes=(2, 8), warmup=1, repeats=3, timeout_s=180.0
    )
    assert set(profile.device_types) == {"gpu", "cpu"}
    for layer in profile.layers:
        for dtype in ("gpu", "cpu"):
            t = layer.timings[dtype]
            assert t.forward(8) > 0 and t.backward(8) >= 0, (layer.name, dtype)
    assert any(layer.timings["gpu"] != layer.timings["cpu"] for layer in profile.layers)
    plan = Plan(16, (Stage((0, 3), ("g0/gpu:0",), 4), Stage((3, 8), ("c0/cpu:0",), 8)))
    assert simulate(plan, profile, CUDA_SPEC).batch_time_s > 0


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.timeout(400)
def test_training_on_cuda_checkpoints_and_resumes(
    cuda_cluster: LocalCluster, tmp_path: Path
) -> None:
    """``train`` on a plan with a CUDA stage: its losses and exported weights are
    single-process training's on the GPU, and 2 steps + resume + 1 step give the weights
    of 3 straight (the CUDA stage's checkpoint shards saved from and loaded onto the GPU)."""
    from pipeplan.executor.train import TrainConfig, train

    plan = Plan(16, (Stage((0, 3), ("g0/gpu:0",), 4), Stage((3, 8), ("c0/cpu:0",), 8)))
    sgd = OptimizerConfig("sgd", lr=0.1, momentum=0.9)

    def config(steps: int, folder: Path, **kw: object) -> TrainConfig:
        base: dict[str, object] = {"steps": steps, "optimizer": sgd, "seed": 3,
                                   "checkpoint_dir": folder, "emulate": False,
                                   "deterministic": True, "timeout_s": 120}  # fmt: skip
        return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]

    straight = train(plan, DIGITS, CUDA_SPEC, config(3, tmp_path / "a"))
    train(plan, DIGITS, CUDA_SPEC, config(2, tmp_path / "b"))
    resumed = train(plan, DIGITS, CUDA_SPEC, config(3, tmp_path / "b", resume=tmp_path / "b"))
    assert resumed.first_step == 2 and [s.step for s in resumed.steps] == [2]
    assert resumed.steps[0].loss == pytest.approx(straight.steps[2].loss, abs=1e-5)
    a = checkpoint.export_state_dict(tmp_path / "a", tmp_path / "a.pt")
    b = checkpoint.export_state_dict(tmp_path / "b", tmp_path / "b.pt")
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5), name
    model, example = DIGITS.build()
    model.eval()
    with torch.no_grad():
        out_shape = tuple(model(example).shape)
    batches = synthetic_batches(example, out_shape, 16, 3, seed=3)
    ref = train_single_process(DIGITS, batches, sgd, deterministic=True, device="cuda")
    assert [s.loss for s in straight.steps] == pytest.approx(ref.losses, abs=1e-4)
    for name, want in ref.parameters.items():
        assert torch.allclose(a[name], want.cpu(), atol=1e-4), name
