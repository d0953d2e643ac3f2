"""Gradient buckets: their layout, and that every gradient gets its sum back whatever the
order the gradients arrive in, with or without a gradient for every parameter."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeplan.executor import buckets, transport
from pipeplan.executor.buckets import Buckets


def params(*sizes: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {f"p{i}": torch.zeros(n, dtype=dtype) for i, n in enumerate(sizes)}


def test_layout_takes_the_last_parameters_first_up_to_the_limit() -> None:
    four_bytes = 4
    layout = buckets.layout(params(2, 2, 5, 1, 1), limit=4 * four_bytes)
    assert layout == [["p4", "p3"], ["p2"], ["p1", "p0"]]  # p2 alone: larger than the rest
    assert buckets.layout(params(10, 1), limit=8) == [["p1"], ["p0"]]  # a large one alone
    mixed = {**params(1), "h": torch.zeros(1, dtype=torch.float16)}
    assert buckets.layout(mixed) == [["h"], ["p0"]]  # one dtype a bucket


class Work:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


@pytest.fixture
def summed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """all_reduce over two identical replicas: doubles the tensor in place."""
    log: list[str] = []

    def all_reduce_sum(flat: torch.Tensor, group: Any, wait: bool = True) -> Work:
        flat.mul_(2)
        log.append(f"sum {flat.numel()}")
        return Work(log, str(flat.numel()))

    monkeypatch.setattr(transport, "all_reduce_sum", all_reduce_sum)
    return log


def test_every_gradient_gets_its_sum_back(summed: list[str]) -> None:
    layout = buckets.layout(params(2, 3, 1, 4), limit=6 * 4)  # [[p3, p2], [p1, p0]]
    sizes = {"p0": 2, "p1": 3, "p2": 1, "p3": 4}
    grads = {n: torch.arange(float(k)) + 1 for n, k in sizes.items()}
    want = {n: g * 2 for n, g in grads.items()}
    b = Buckets(layout, group=None)
    b.ready("p3", grads["p3"])
    assert summed == []  # its bucket waits for p2
    b.ready("p2", grads["p2"])
    assert summed == ["sum 5"]  # started during the backward
    b.ready("p0", grads["p0"])
    b.ready("p1", grads["p1"])
    b.finish()
    assert summed == ["sum 5", "sum 5", "wait 5", "wait 5"]
    for n in grads:
        assert torch.equal(grads[n], want[n]), n


def test_a_parameter_without_a_gradient_is_left_out_after_the_backward(summed: list[str]) -> None:
    layout = [["p2", "p1"], ["p0"]]
    g1, g0 = torch.ones(3), torch.ones(2)
    b = Buckets(layout, group=None)
    b.ready("p0", g0)  # a lone parameter: summed in place at once
    b.ready("p1", g1)  # p2 has no gradient this step: its bucket starts at finish
    assert summed == ["sum 2"]
    b.finish()
    assert summed == ["sum 2", "sum 3", "wait 2", "wait 3"]
    assert torch.equal(g1, torch.full((3,), 2.0)) and torch.equal(g0, torch.full((2,), 2.0))


class Doubling:
    """A shared-memory sum over two identical replicas, logging what it sums."""

    layout = None  # the chunk buffers: no gradient kept in the segment

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def sum_(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous()
        tensor.mul_(2)
        self.log.append(f"shared {tensor.numel()}")


def test_shared_memory_sums_every_bucket_in_order_once_the_backward_is_over(
    summed: list[str],
) -> None:
    layout = [["p2", "p1"], ["p0"]]
    g2, g1 = torch.ones(2), torch.ones(3)
    g0 = torch.ones(4, 2).t()  # a lone gradient that is not contiguous: summed via a copy
    b = Buckets(layout, group=None, shared=Doubling(summed))  # type: ignore[arg-type]
    b.ready("p0", g0)
    b.ready("p2", g2)
    b.ready("p1", g1)
    assert summed == []  # nothing travels during the backward
    b.finish()
    assert summed == ["shared 8", "shared 5"]  # in the order the buckets filled
    for g in (g2, g1, g0):
        assert torch.equal(g, torch.full_like(g, 2.0))


class Regions:
    """A segment that keeps the gradients (its ``layout`` set): doubles them in place."""

    def __init__(self, params: dict[str, torch.Tensor], log: list[str]) -> None:
        self.layout = object()
        self.views = {n: torch.zeros_like(p) for n, p in params.items()}
        self.log = log

    def grad_view(self, name: str) -> torch.Tensor:
        return self.views[name]

    def sum_regions(self, written: set[str]) -> None:
        for n in written:
            self.views[n].mul_(2)
        self.log.append(f"regions {sorted(written)}")


def test_gradients_kept_in_the_segment_are_written_there_and_summed_in_place(
    summed: list[str],
) -> None:
    params = {"p0": torch.zeros(4, 2), "p1": torch.zeros(3), "p2": torch.zeros(2)}
    shared = Regions(params, summed)
    b = Buckets([["p2", "p1"], ["p0"]], group=None, shared=shared)  # type: ignore[arg-type]
    earlier = torch.full((3,), 5.0)
    got = {
        "p2": b.ready("p2", torch.ones(2)),
        "p1": b.ready("p1", torch.ones(3), earlier),  # the accumulation lands in the segment
    }
    assert all(got[n] is shared.views[n] for n in got)
    assert torch.equal(earlier, torch.full((3,), 5.0))  # the step's earlier gradient is kept
    assert summed == []
    b.finish()  # p0 had no gradient: not written, so not summed
    assert summed == ["regions ['p1', 'p2']"]
    assert torch.equal(got["p1"], torch.full((3,), 12.0))
    assert torch.equal(got["p2"], torch.full((2,), 2.0))
