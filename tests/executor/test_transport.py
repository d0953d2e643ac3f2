"""The torch.distributed runtime without Ray: messages, tags, who sends whom what, and stage
workers in separate processes (a gloo group on loopback) training exactly as one process.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from pipeplan.core.plan import Schedule
from pipeplan.executor import transport
from pipeplan.executor.data import digits_batches
from pipeplan.executor.microbatch import Layout, Link
from pipeplan.executor.model import Batch, ModelSource, OptimizerConfig, train_single_process
from pipeplan.executor.partition import ValueMeta, count_layers
from pipeplan.executor.payloads import concat_gradients, concat_inputs
from pipeplan.executor.stage import Failure, StageWorker, StepOutput, WorkerSpec
from pipeplan.executor.torch_engine import Engine, unsupported
from pipeplan.executor.transport import GroupSpec

F32 = ValueMeta("batched", torch.float32, (2,))
I64 = ValueMeta("batched", torch.int64, (3,))
SHARED = ValueMeta("shared", torch.float32, (4,))
MASK = ValueMeta("batched", torch.bool, (1,))


def test_a_message_packs_and_unpacks_every_dtype_and_shape() -> None:
    a, b, c = torch.randn(3, 2), torch.arange(9).reshape(3, 3), torch.randn(4)
    buffer = transport.pack([a, b, c], torch.device("cpu"))
    assert buffer.dtype == torch.uint8
    assert buffer.numel() == transport.buffer_size([F32, I64, SHARED], 3, None) == 24 + 72 + 16
    got = transport.unpack(buffer, [F32, I64, SHARED], 3)
    assert all(torch.equal(g, w) for g, w in zip(got, [a, b, c], strict=True))  # type: ignore[arg-type]


def test_gradients_travel_with_presence_bytes_and_misaligned_values_realign() -> None:
    mask, g = torch.tensor([[True], [False], [True]]), torch.randn(3, 2)
    buffer = transport.pack([mask, None, g], torch.device("cpu"), flags=True)
    assert buffer[-3:].tolist() == [1, 0, 1]
    assert buffer.numel() == transport.buffer_size([MASK, F32, F32], 3, [True, False, True])
    got = transport.unpack(buffer, [MASK, F32, F32], 3, flags=True)
    assert got[1] is None
    assert torch.equal(got[0], mask) and torch.equal(got[2], g)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "shape", [[(4, 1), (6, 1), (3, 2)], [(5, 3), (4, 2), (7, 1)], [(1, 1), (14, 2)]]
)
def test_sends_are_the_receives_seen_from_the_other_side_and_tags_are_unique(
    shape: list[tuple[int, int]],
) -> None:
    layout = Layout.of(14, shape)
    for s in range(layout.num_stages - 1):
        for direction, sends, receives in (
            ("F", layout.forward_sends(s), layout.forward_links(s + 1)),
            ("B", layout.backward_sends(s + 1), layout.backward_links(s)),
        ):
            sender_stage = s if direction == "F" else s + 1
            sent = {
                ((sender_stage, *op), link.peer, link.rows)
                for op, links in sends.items()
                for link in links
            }
            got = {
                (link.peer, (s + 1 if direction == "F" else s, *op), link.rows)
                for op, links in receives.items()
                for link in links
            }
            assert sent == got
            # Between two ranks (replicas), one message per microbatch pair: unique tags.
            pairs: dict[tuple[int, int], list[int]] = {}
            for (_, j, k), (_, j2, k2), _ in sent:
                pairs.setdefault((k, k2), []).append(transport.tag(j, j2, direction == "B", 0))
            assert all(len(t) == len(set(t)) for t in pairs.values())
    # Rows a sender sends add up to its samples, once per direction.
    for s in range(layout.num_stages - 1):
        for (j, k), links in layout.forward_sends(s).items():
            lo, hi = layout.spans[s][j][k]
            assert sum(link.rows for link in links) == hi - lo


def test_inputs_join_rows_and_gradients_count_shared_values_once() -> None:
    meta = {"a": F32, "p": SHARED, "n": ValueMeta("constant", constant=7)}
    parts = [[torch.ones(2, 2), torch.full((4,), 3.0)], [torch.zeros(1, 2), torch.ones(4)]]
    got = concat_inputs(["a", "n", "p"], ["a", "p"], parts, meta)
    assert got["a"].tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert got["n"] == 7 and got["p"].tolist() == [3.0] * 4
    links = [Link((1, 0, 0), 0, 2, True), Link((1, 1, 0), 0, 1, False)]
    grads = concat_gradients(
        ["a", "p"], links, [[torch.ones(2, 2), torch.full((4,), 2.0)], [None, torch.ones(4)]], meta
    )
    assert grads["a"].tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]  # missing rows: zeros
    assert grads["p"].tolist() == [2.0] * 4  # only the owned piece counts
    assert concat_gradients(["a"], links, [[None], [None]], meta) == {}


# --- stage workers in processes ---------------------------------------------------------------

DIGITS = ModelSource("digits_cnn", 8, seed=3)
STEPS = 3


def _specs(
    batch: int,
    micro: Sequence[int],
    replicas: Sequence[int],
    schedule: Schedule,
    engine: Engine = "pipeplan",
) -> list[WorkerSpec]:
    bounds = (0, 3, 5, count_layers(DIGITS.build()[0]))
    shape = tuple(zip(micro, replicas, strict=True))
    return [
        WorkerSpec(
            s,
            k,
            f"n{s}/cpu:{k}",
            f"n{s}",
            bounds,
            batch,
            DIGITS,
            OptimizerConfig(lr=0.05, momentum=0.9),
            deterministic=True,
            replicas=r,
            shape=shape,
            schedule=schedule,
            timeout_s=60,
            microbatches=-(-batch // micro[s]),
            engine=engine,
        )
        for s, r in enumerate(replicas)
        for k in range(r)
    ]


def _rows(replicas: Sequence[int]) -> list[range]:
    starts = [sum(replicas[:s]) for s in range(len(replicas))]
    return [range(a, a + n) for a, n in zip(starts, replicas, strict=True)]


def _worker(
    spec: WorkerSpec,
    group: GroupSpec,
    sock: socket.socket | None,
    batches: list[Batch],
    input_name: str,
    out: Any,
) -> None:
    try:
        worker = StageWorker(spec)
        if sock is not None:
            worker.store = transport.open_store(sock, group.world_size, group.timeout_s)
        worker.join_group(group)
        outputs = []
        for t, (x, y) in enumerate(batches):
            result = worker.run_step(t, {input_name: x.numpy()}, y.numpy())
            if isinstance(result, Failure):
                raise RuntimeError(result.traceback)
            outputs.append(result)
        out.put((group.rank, worker.parameters(), (outputs, worker.shared is not None)))
        worker.leave_group()
    except Exception:
        out.put((group.rank, traceback.format_exc(), []))


def run_in_processes(
    batch: int,
    micro: Sequence[int],
    replicas: Sequence[int],
    schedule: Schedule,
    engine: Engine = "pipeplan",
    shared: bool = True,
) -> tuple[dict[int, Any], list[Batch]]:
    """Train ``STEPS`` digits batches on one process per stage replica; every rank's
    parameters, step outputs and whether it summed through shared memory."""
    specs = _specs(batch, micro, replicas, schedule, engine)
    _, example = DIGITS.build()
    batches = digits_batches(example, batch, STEPS, seed=1)
    ranks, r = [], 0
    for n in replicas:
        ranks.append(tuple(range(r, r + n)))
        r += n
    sock = transport.listen("127.0.0.1")
    address, port = sock.getsockname()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = []
    for rank, spec in enumerate(specs):
        nodes = tuple(sp.node for sp in specs)
        group = GroupSpec(address, port, rank, tuple(ranks), "gloo", 60.0, nodes, shared)
        args = (spec, group, sock if rank == 0 else None, batches, "x", out)
        procs.append(ctx.Process(target=_worker, args=args))
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, params, outputs = out.get(timeout=120)
            if isinstance(params, str):
                raise AssertionError(f"rank {rank} failed:\n{params}")
            results[rank] = (params, *outputs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        sock.close()
    return results, batches


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("batch", "micro", "replicas", "schedule", "engine", "shared"),
    [
        (12, (4, 6, 3), (1, 1, 2), Schedule.GPIPE, "pipeplan", True),  # unequal, uneven shares
        (12, (4, 6, 3), (1, 1, 2), Schedule.GPIPE, "pipeplan", False),  # replicas sum by gloo
        (14, (4, 6, 3), (1, 2, 1), Schedule.GPIPE, "pipeplan", True),  # remainders, middle
        (16, (4, 4, 4), (1, 1, 2), Schedule.ONE_F_ONE_B, "pipeplan", True),
        (16, (4, 4, 4), (1, 1, 1), Schedule.GPIPE, "torch-pipelining", True),
        (16, (4, 4, 4), (1, 1, 1), Schedule.ONE_F_ONE_B, "torch-pipelining", True),
    ],
)
def test_stage_processes_train_exactly_as_one_process(
    batch: int,
    micro: tuple[int, ...],
    replicas: tuple[int, ...],
    schedule: Schedule,
    engine: Engine,
    shared: bool,
) -> None:
    results, batches = run_in_processes(batch, micro, replicas, schedule, engine, shared)
    for rank, (_, _, summed_in_memory) in results.items():  # replicas of one node share it
        stage = next(s for s, row in enumerate(_rows(replicas)) if rank in row)
        assert summed_in_memory == (shared and replicas[stage] > 1)
    ref = train_single_process(
        DIGITS, batches, OptimizerConfig(lr=0.05, momentum=0.9), deterministic=True
    )
    params: dict[str, np.ndarray] = {}
    rank = 0
    for r in replicas:
        first = results[rank][0]
        for k in range(1, r):  # replicas keep bit-identical weights
            assert all(np.array_equal(results[rank + k][0][n], v) for n, v in first.items())
        params.update(first)
        rank += r
    assert sorted(params) == sorted(ref.parameters)
    diff = max(float(np.abs(params[n] - ref.parameters[n].numpy()).max()) for n in params)
    assert diff < 1e-5
    last = [o for rk in range(rank - replicas[-1], rank) for o in results[rk][1]]
    for t, want in enumerate(ref.losses):
        terms = [o.loss for o in last if isinstance(o, StepOutput) and o.records[0].step == t]
        got = sum(x["loss_sum"] for x in terms) / sum(x["predictions"] for x in terms)
        assert got == pytest.approx(want, abs=1e-5)
    kinds = [r.kind for r in results[rank - 1][1][0].records]
    if engine == "torch-pipelining":  # PyTorch's schedule times the step as a whole
        assert kinds == ["S", "U"]
        return
    assert kinds.count("F") == kinds.count("B") == -(-batch // micro[-1])
    assert ("G" in kinds) == (replicas[-1] > 1) and kinds[-1] == "U"


def test_a_worker_hands_back_its_failure_naming_the_operation() -> None:
    spec = _specs(8, (4, 4, 4), (1, 1, 1), Schedule.GPIPE)[2]
    worker = StageWorker(spec)
    before = worker.run_step(0, None, None)
    assert isinstance(before, Failure) and "before join_group" in before.traceback
    worker.group = GroupSpec("127.0.0.1", 0, 2, ((0,), (1,), (2,)), "gloo", 1.0)
    failed = worker.run_step(0, None, None)  # joined in appearance only: no group to post on
    assert isinstance(failed, Failure)
    assert (failed.stage, failed.device, failed.operation) == (2, "n2/cpu:0", "posting receives")
    assert "process group" in failed.traceback.lower()


def test_torch_pipelining_refuses_what_it_cannot_express_naming_it() -> None:
    from pipeplan.core.plan import Plan, Schedule, Stage

    def plan(
        micro: tuple[int, int], devices: tuple[str, ...] = ("n1/b:0",), batch: int = 16
    ) -> Plan:
        return Plan(batch, (Stage((0, 3), ("n0/a:0",), micro[0]), Stage((3, 8), devices, micro[1])))

    tensor = {"x": F32}
    assert unsupported(plan((4, 4)), tensor, emulated=False) is None
    assert unsupported(plan((4, 8)), tensor, False) == "unequal microbatches [4, 8]"
    assert "does not divide" in str(unsupported(plan((5, 5), batch=16), tensor, False))
    assert unsupported(plan((4, 4), ("n1/b:0", "n1/b:1")), tensor, False) == "replicated stages [1]"
    constant = {"x": F32, "n": ValueMeta("constant", constant=3)}
    assert "constants crossing a stage boundary ['n']" in str(
        unsupported(plan((4, 4)), constant, False)
    )
    assert "emulation" in str(unsupported(plan((4, 4)), tensor, True))
    one_f_one_b = Plan(4, plan((2, 2), batch=4).stages, Schedule.ONE_F_ONE_B)  # 2 microbatches
    assert unsupported(one_f_one_b, tensor, False) is None
    fewer = Plan(4, plan((4, 4), batch=4).stages, Schedule.ONE_F_ONE_B)
    assert unsupported(fewer, tensor, False) == (
        "1F1B with 1 microbatches for 2 stages (it needs at least one per stage)"
    )


def test_an_unknown_engine_is_refused_naming_the_field() -> None:
    from pipeplan.core.errors import PlanError
    from pipeplan.executor.pipeline import RunConfig

    with pytest.raises(
        PlanError, match=r"run.engine: 'nccl' is not one of \['pipeplan', 'torch-pipelining'\]"
    ):
        RunConfig(engine="nccl")  # type: ignore[arg-type]
