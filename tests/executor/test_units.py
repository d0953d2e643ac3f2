"""The executor's pure parts, without Ray: sample ranges, feasibility, cuts, payload joins."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeplan.core.errors import PipeplanError, PlanError
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import partition as partition_module
from pipeplan.executor.emulation import emulation_sleep
from pipeplan.executor.live_cluster import LiveNode, nodes_from_ray
from pipeplan.executor.local.keep_awake import KeepAwake
from pipeplan.executor.measured_profile import call_sizes
from pipeplan.executor.microbatch import Layout, Piece, pieces, replica_shares
from pipeplan.executor.model import ModelSource, OptimizerConfig, batch_loss, loss_terms
from pipeplan.executor.partition import count_layers, partition
from pipeplan.executor.pinning import WORKER_ENV, actor_options, check_feasible
from pipeplan.executor.reservation import bundle, held_devices, owner_of, strategy
from pipeplan.executor.stage import (
    HEAP_RESERVE,
    Clock,
    StageWorker,
    StepOutput,
    WorkerSpec,
    heap_reserve,
)
from pipeplan.executor.transport import GroupSpec
from pipeplan.models import zoo
from tests.executor.models import skipnet

NODES = [
    LiveNode("n0", "id0", {"fast": 1}, True),
    LiveNode("n1", "id1", {"mid": 1}, True),
    LiveNode("n2", "id2", {"slow": 2}, True),
]


def test_replica_shares_split_like_tensor_split() -> None:
    assert replica_shares(5, 2) == [(0, 3), (3, 5)]
    assert replica_shares(4, 1) == [(0, 4)]
    with pytest.raises(ValueError, match="cannot be shared"):
        replica_shares(1, 2)


def test_layout_spans_and_pieces_table() -> None:
    # B = 12: stage 0 in 3 x 4; stage 1 in 2 x 6 on one replica; stage 2 in 4 x 3 on two.
    layout = Layout.of(12, [(4, 1), (6, 1), (3, 2)])
    assert layout.spans[2] == [
        [(0, 2), (2, 3)],
        [(3, 5), (5, 6)],
        [(6, 8), (8, 9)],
        [(9, 11), (11, 12)],
    ]
    # stage 1 microbatch 1 (samples 6..11) = rows 2..4 of stage 0's mb 1, all of mb 2
    assert layout.forward_pieces(1, 1, 0) == [
        Piece(0, 1, 0, 2, 4, False),
        Piece(0, 2, 0, 0, 4, True),
    ]
    # stage 1 microbatch 0's gradient comes from stage 2's ops holding samples 0..5
    assert [(p.microbatch, p.replica, p.lo, p.hi) for p in layout.backward_pieces(1, 0, 0)] == [
        (0, 0, 0, 2),
        (0, 1, 0, 1),
        (1, 0, 0, 2),
        (1, 1, 0, 1),
    ]
    with pytest.raises(ValueError, match="does not cover"):
        pieces((0, 5), 0, [[(0, 4)]])


def test_layout_with_remainders() -> None:
    # B = 7: stage 0 in 3 + 3 + 1; stage 1 in 4 + 3 on two replicas (2 + 2, 2 + 1).
    layout = Layout.of(7, [(3, 1), (4, 2)])
    assert layout.spans[0] == [[(0, 3)], [(3, 6)], [(6, 7)]]
    assert layout.spans[1] == [[(0, 2), (2, 4)], [(4, 6), (6, 7)]]
    assert [(p.microbatch, p.lo, p.hi) for p in layout.forward_pieces(1, 1, 1)] == [(2, 0, 1)]
    # a last microbatch smaller than the replica count cannot be shared
    plan = Plan(9, (Stage((0, 2), ("n0/fast:0",), 4), Stage((2, 4), ("n2/slow:0", "n2/slow:1"), 4)))
    with pytest.raises(PlanError, match="last microbatch's 1 samples"):
        check_feasible(plan, NODES)


def test_feasibility_names_the_problem() -> None:
    ok = Plan(8, (Stage((0, 2), ("n0/fast:0",), 4), Stage((2, 4), ("n2/slow:0", "n2/slow:1"), 4)))
    check_feasible(ok, NODES)
    cases = {
        "n0/gpu:0": "device type 'gpu'",
        "n5/fast:0": "node 'n5'",
        "n1/fast:0": "1 'fast' devices on node 'n1'",
    }
    for device, message in cases.items():
        plan = Plan(8, (Stage((0, 2), ("n2/slow:0",), 4), Stage((2, 4), (device,), 4)))
        with pytest.raises(PlanError, match=message):
            check_feasible(plan, NODES)
    too_small = Plan(8, (Stage((0, 4), ("n2/slow:0", "n2/slow:1"), 1),))
    with pytest.raises(PlanError, match="cannot be shared by 2 replicas"):
        check_feasible(too_small, NODES)


def test_held_devices_bundles_and_ray_node_records() -> None:
    devices = ["n2/slow:0", "n2/slow:1", "n0/fast:0"]
    free = {"id2": {"device:slow": 2.0}, "id0": {"device:fast": 1.0}}
    assert held_devices(devices, NODES, free) == []
    free = {"id2": {"device:slow": 1.0}}
    assert held_devices(devices, NODES, free) == ["n2/slow:0", "n2/slow:1", "n0/fast:0"]
    assert bundle("n2/slow:1", NODES, None) == {"device:slow": 1.0, "pipeplan_node:n2": 0.001}
    unmarked = [LiveNode("n9", "id9", {"t4": 1}, False, address="10.0.0.9")]
    assert bundle("n9/t4:0", unmarked, "cuda") == {
        "device:t4": 1.0,
        "node:10.0.0.9": 0.001,
        "GPU": 1.0,
    }
    assert strategy(devices[:2]) == "STRICT_PACK" and strategy(devices) == "PACK"
    assert owner_of("pipeplan:pp-0123:9f3a") == "pp-0123" and owner_of("pipeplan:a:b:c") == "a:b"
    assert owner_of("other:pp-0123:9f3a") is None and owner_of("pipeplan:") is None
    records = [
        {"Alive": True, "NodeID": "abcdef0123", "Resources": {"device:t4": 2.0, "CPU": 4.0}},
        {"Alive": True, "NodeID": "ff", "Resources": {"pipeplan_node:n0": 1.0, "device:cpu": 1}},
        {"Alive": False, "NodeID": "dead", "Resources": {"pipeplan_node:n9": 1.0}},
    ]
    nodes = nodes_from_ray(records)
    assert [(n.name, dict(n.devices), n.marked) for n in nodes] == [
        ("n0", {"cpu": 1}, True),
        ("node-abcdef01", {"t4": 2}, False),
    ]


def test_partition_relays_skips_and_finds_value_kinds() -> None:
    module, example = skipnet()
    cut = partition(module, example, (0, 3, 5, 8))
    assert [(s.inputs, s.outputs) for s in cut.stages] == [
        (("x",), ("relu", "c2")),
        (("relu", "c2"), ("relu", "relu_1")),
        (("relu", "relu_1"), ("fc",)),
    ]
    assert dict(cut.stages[2].attrs) == {"gate": "gate"}
    gpt, tokens = zoo.build("gpt", 8, n_layer=1, d_model=16, n_head=2, vocab_size=32)
    cut = partition(gpt, tokens, (0, 2, count_layers(gpt)))
    assert cut.kinds["wpe"] == "shared" and cut.kinds["wte"] == "batched"
    with pytest.raises(PlanError, match="ends at 7 but model"):
        partition(module, example, (0, 3, 7))


def test_partitioned_stages_compose_to_the_model() -> None:
    model, example = ModelSource("alexnet", 64).build()
    model.eval()
    bounds = (0, 1, 6, count_layers(model))  # starts stage 1 with an in-place ReLU
    cut = partition(model, example, bounds)
    x = torch.randn(3, 3, 64, 64)
    env: dict[str, torch.Tensor] = {"x": x}
    with torch.no_grad():
        for st in cut.stages:
            env.update(zip(st.results, st.module(*(env[a] for a in st.args)), strict=True))
        assert torch.equal(env[cut.model_output], model(x))


def test_a_torch_without_split_modules_tuple_return_still_gives_tuples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Older torch releases (some CUDA images ship one) lack ``tuple_return``: a stage with
    one result then returns it bare, and the cut wraps it, so the stages compose as before."""
    real = partition_module.split_module

    def without_tuple_return(*args: object, **kwargs: object) -> object:
        if "tuple_return" in kwargs:
            raise TypeError("split_module() got an unexpected keyword argument 'tuple_return'")
        return real(*args, **kwargs)

    monkeypatch.setattr(partition_module, "split_module", without_tuple_return)
    model, example = ModelSource("alexnet", 64).build()
    model.eval()
    cut = partition(model, example, (0, 1, 6, count_layers(model)))
    assert [len(st.results) for st in cut.stages] == [1, 1, 1]
    x = torch.randn(3, 3, 64, 64)
    env: dict[str, torch.Tensor] = {"x": x}
    with torch.no_grad():
        for st in cut.stages:
            out = st.module(*(env[a] for a in st.args))
            assert isinstance(out, tuple), type(out)
            env.update(zip(st.results, out, strict=True))
        assert torch.equal(env[cut.model_output], model(x))
    module, skip_example = skipnet()  # several results per stage: untouched
    assert [st.outputs for st in partition(module, skip_example, (0, 3, 5, 8)).stages] == [
        ("relu", "c2"),
        ("relu", "relu_1"),
        ("fc",),
    ]


def test_piecewise_loss_sums_to_the_batch_mean() -> None:
    logits, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    whole = torch.nn.functional.cross_entropy(logits, labels)
    parts = sum(
        batch_loss(loss_terms(logits[s], labels[s]), 3, 6) for s in (slice(0, 3), slice(3, 6))
    )
    assert float(parts) == pytest.approx(float(whole), abs=1e-6)


def test_emulation_sleeps_to_slowdown_times_cpu() -> None:
    # An idle core (wall == cpu): sleep (k - 1) x the compute.
    assert emulation_sleep(4.0, 0.1, 0.1) == pytest.approx(0.3)
    # Waiting for a core (wall > cpu) is absorbed, not multiplied.
    assert emulation_sleep(4.0, 0.25, 0.1) == pytest.approx(0.15)
    assert emulation_sleep(2.0, 0.5, 0.1) == 0.0
    assert emulation_sleep(1.0, 0.1, 0.1) == 0.0


def test_each_backward_runs_into_fresh_gradients_then_adds_the_earlier_ones() -> None:
    source = ModelSource("digits_cnn", 8, seed=0)
    bounds = (0, count_layers(source.build()[0]))
    spec = WorkerSpec(
        0, 0, "n0/fast:0", "n0", bounds, 16, source, OptimizerConfig(), shape=((8, 1),)
    )
    worker = StageWorker(spec)  # one stage, two microbatches: the first and the last
    # A leaf's hook sees its incoming gradient before autograd stores it: the timed backward
    # must find no gradient there (adding into the earlier microbatches' comes after it).
    found: list[bool] = []
    incoming: dict[str, list[torch.Tensor]] = {n: [] for n in worker.params}

    def hook(name: str, p: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
        def seen(g: torch.Tensor) -> None:
            found.append(p.grad is None)
            incoming[name].append(g.clone())

        return seen

    for name, p in worker.params.items():
        p.register_hook(hook(name, p))
    rng = np.random.default_rng(0)
    (name,) = worker.graph.inputs
    x = {name: rng.standard_normal((16, 1, 8, 8)).astype("f4")}
    labels = rng.integers(0, 10, 16)
    worker.group = GroupSpec("127.0.0.1", 0, 0, ((0,),), "gloo", 10.0)  # one rank: no messages
    worker.optimizer = None  # keep the step's gradients to look at
    out = worker.run_step(0, x, labels)
    assert isinstance(out, StepOutput), out
    assert [r.kind for r in out.records] == ["F", "F", "B", "B", "U"]
    assert found and all(found)
    for n, p in worker.params.items():
        assert p.grad is not None and torch.equal(p.grad, incoming[n][0] + incoming[n][1])


def test_profile_call_sizes_are_a_quarter_of_the_batch_and_all_of_it() -> None:
    assert call_sizes(32) == (8, 32)
    assert call_sizes(6) == (1, 6)
    assert call_sizes(2) == (1, 2)
    assert call_sizes(1) == (1, 2)  # nothing to split: still two distinct sizes
    with pytest.raises(PipeplanError, match="global_batch: must be >= 1, got 0"):
        call_sizes(0)


def test_clock_counts_this_threads_cpu_not_sleep() -> None:
    import time

    clock = Clock.now()
    time.sleep(0.05)
    wall, cpu = clock.elapsed()
    assert wall >= 0.05 and cpu < 0.04


def test_actors_keep_freed_memory_for_reuse() -> None:
    options = actor_options("n2/slow:1", NODES)
    assert options["runtime_env"] == {"env_vars": WORKER_ENV}
    assert options["resources"] == {"device:slow": 1.0, "pipeplan_node:n2": 0.001}


FAULTS = """
import resource
import numpy as np
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):  # warm up: the first blocks are faulted in once
    np.ones(2**25, "f4").sum()
before = faults()
for _ in range(5):  # 128 MB blocks, allocated and freed (a large layer's gradient)
    np.ones(2**25, "f4").sum()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_the_worker_env_lets_a_process_reuse_large_blocks_without_page_faults() -> None:
    """What ``WORKER_ENV`` is for: a large block freed and allocated again is not faulted in
    again (glibc's defaults map and unmap it each time: 32k faults per 128 MB block in 4 KB
    pages; numpy's huge-page advice, which torch does not give, is turned off)."""

    def faults(env: dict[str, str]) -> int:
        out = subprocess.run(
            [sys.executable, "-c", FAULTS], env={**env, "NUMPY_MADVISE_HUGEPAGE": "0"}, check=True,
            capture_output=True, text=True,
        )  # fmt: skip
        return int(out.stdout)

    plain = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    assert faults(plain) > 5 * 2**25 * 4 // 4096 // 2  # every block faulted in again
    assert faults({**plain, **WORKER_ENV}) < 1000


def test_the_heap_reserve_counts_the_optimizers_state() -> None:
    for optimizer, buffers in (
        (OptimizerConfig(), 0),
        (OptimizerConfig(momentum=0.9), 1),
        (OptimizerConfig(kind="adam"), 2),
    ):
        assert optimizer.state_buffers == buffers
        assert heap_reserve(100, optimizer.state_buffers, 2, 1) == (HEAP_RESERVE + buffers) * 100


@pytest.mark.parametrize(
    ("microbatches", "replicas", "sizes"),
    [(1, 1, 1 + 1), (1, 6, 2 + 1), (2, 1, HEAP_RESERVE + 1), (4, 3, HEAP_RESERVE + 1)],
)
def test_a_stage_that_does_not_accumulate_reserves_its_gradients_and_flat_copy(
    microbatches: int, replicas: int, sizes: int
) -> None:
    # One microbatch per step: the gradients, and with replicas the all-reduce's flat copy; a
    # stage that accumulates keeps the slack that stopped VGG-16's heap growing under 1F1B.
    momentum = OptimizerConfig(momentum=0.9)
    assert heap_reserve(100, momentum.state_buffers, microbatches, replicas) == sizes * 100


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
def test_keep_awake_spins_at_idle_priority_and_stops() -> None:
    with KeepAwake(count=2) as awake:
        pids = awake.pids
        assert len(pids) == 2
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the policy is set by the child itself
            if all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids):
                break
            time.sleep(0.05)
        assert all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids)
    assert awake.pids == ()
    for p in pids:
        assert not Path(f"/proc/{p}").exists() or "Z" in Path(f"/proc/{p}/stat").read_text()
    with pytest.raises(ValueError, match="count: expected >= 0 spinners, got -1"):
        KeepAwake(count=-1)
