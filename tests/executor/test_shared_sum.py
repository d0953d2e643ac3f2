"""Same-host replicas sum through shared memory (executor.shared_sum), in forked processes
on a gloo group: no Ray."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeplan.executor import shared_sum, transport
from pipeplan.executor.transport import GroupSpec

SIZES = (1, 1000, 4099)  # elements: under a chunk, several chunks, a ragged last chunk


def _tensor(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(n, dtype=dtype) * (rank + 1) + rank / 3


PARAMS = {"w": torch.zeros(33, 7), "b": torch.zeros(7), "unused": torch.zeros(5)}
"""A stage's parameters for the gradient regions: ragged sizes; ``unused`` gets no gradient."""


def _replica(group: GroupSpec, sock: Any, node: str, out: Any, regions: bool = False) -> None:
    try:
        store = None
        if sock is not None:
            store = transport.open_store(sock, group.world_size, group.timeout_s)
        sub = transport.join(group, store)
        row = group.ranks[0]
        layout = shared_sum.ArenaLayout.of(PARAMS) if regions else None
        name = f"pp-test-{group.port}"
        summer = shared_sum.open_shared_sum(sub, row, group.rank, node, name, layout)
        sums = []
        if summer is not None and regions:
            assert summer.layout is not None
            for step in range(2):  # the second step finds the first's sums in the regions
                views = {}
                for n in ("w", "b"):
                    views[n] = summer.grad_view(n)
                    views[n].copy_(
                        _tensor(group.rank + step, PARAMS[n].numel(), torch.float32).view_as(
                            PARAMS[n]
                        )
                    )
                if step == 0:  # a stale value where no replica writes this step
                    summer.grad_view("unused").fill_(float(group.rank + 1))
                summer.sum_regions(set(views))
                sums.extend(v.clone() for v in views.values())
            sums.append(summer.grad_view("unused").clone())
        elif summer is not None:
            for n in SIZES:
                for dtype in (torch.float32, torch.float64):
                    t = _tensor(group.rank, n, dtype)
                    summer.sum_(t)
                    sums.append(t)
        else:  # gloo sums where the replicas do not share a node
            t = _tensor(group.rank, 10, torch.float32)
            dist.all_reduce(t, group=sub)
            sums.append(t)
        # numpy arrays travel by value: a tensor would travel as a file descriptor that
        # the parent may come for after this process has exited
        out.put((group.rank, summer is not None, [t.numpy() for t in sums]))
        transport.leave()
    except Exception:
        out.put((group.rank, None, traceback.format_exc()))


def _run(
    nodes: list[str], monkeypatch: pytest.MonkeyPatch, regions: bool = False
) -> dict[int, tuple[bool, Any]]:
    monkeypatch.setattr(shared_sum, "CHUNK_BYTES", 1024)  # many chunks; forks inherit it
    sock = transport.listen("127.0.0.1")
    address, port = sock.getsockname()
    ranks = (tuple(range(len(nodes))),)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_replica,
            args=(
                GroupSpec(address, port, r, ranks, "gloo", 30.0, tuple(nodes)),
                sock if r == 0 else None,
                nodes[r],
                out,
                regions,
            ),
        )
        for r in range(len(nodes))
    ]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, used, sums = out.get(timeout=60)
            if used is None:
                raise AssertionError(f"rank {rank} failed:\n{sums}")
            results[rank] = (used, [torch.from_numpy(a) for a in sums])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        sock.close()
    return results


def test_replicas_on_one_node_sum_in_shared_memory_bit_identically(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = _run(["n1", "n1", "n1"], monkeypatch)
    assert all(used for used, _ in results.values())
    want = [
        sum(_tensor(r, n, dtype) for r in range(3))
        for n in SIZES
        for dtype in (torch.float32, torch.float64)
    ]
    first = results[0][1]
    for rank in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(first, results[rank][1], strict=True))
    for got, expected in zip(first, want, strict=True):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)
    assert not [p for p in shared_sum.SHM_DIR.glob("pp-test-*")]  # the file went at once


def test_replicas_on_different_nodes_keep_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    results = _run(["n1", "n2"], monkeypatch)
    assert [used for used, _ in results.values()] == [False, False]
    assert torch.equal(
        results[0][1][0], _tensor(0, 10, torch.float32) + _tensor(1, 10, torch.float32)
    )


def test_the_switch_turns_shared_memory_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert shared_sum.enabled()
    monkeypatch.setenv(shared_sum.DISABLE_ENV, "0")
    assert not shared_sum.enabled()


def test_gradients_kept_in_shared_memory_are_summed_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shared_sum, "BLOCK_BYTES", 64)  # many blocks, a ragged last one
    results = _run(["n1", "n1", "n1"], monkeypatch, regions=True)
    assert all(used for used, _ in results.values())
    want = [
        sum(_tensor(r + step, PARAMS[n].numel(), torch.float32) for r in range(3)).view_as(
            PARAMS[n]
        )
        for step in range(2)
        for n in ("w", "b")
    ]
    first = results[0][1]
    for rank in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(first, results[rank][1], strict=True))
    for got, expected in zip(first[:-1], want, strict=True):
        torch.testing.assert_close(got, expected)
    assert torch.equal(first[-1], torch.zeros(5))  # the stale gradient was not summed
    assert not [p for p in shared_sum.SHM_DIR.glob("pp-test-*")]


def test_the_gradient_layout_needs_one_floating_dtype() -> None:
    layout = shared_sum.ArenaLayout.of(PARAMS)
    assert layout is not None and layout.dtype == torch.float32
    offsets = [offset for offset, _ in layout.slots.values()]
    assert offsets == sorted(offsets) and all(o % 16 == 0 for o in offsets)  # 64-byte lines
    assert layout.numel >= sum(p.numel() for p in PARAMS.values())
    assert shared_sum.ArenaLayout.of({**PARAMS, "h": torch.zeros(2, dtype=torch.float64)}) is None
    assert shared_sum.ArenaLayout.of({"i": torch.zeros(2, dtype=torch.int64)}) is None
    assert shared_sum.ArenaLayout.of({}) is None
