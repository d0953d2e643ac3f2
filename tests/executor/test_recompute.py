"""A recomputing stage worker (``WorkerSpec.recompute``), in this process and without Ray:
it keeps only its inputs between forward and backward, and its gradients and losses equal
those of the same stage without recomputation, dropout included. Pipelined training with
recomputing stages is compared with single-process training in ``test_pipeline``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.errors import PlanError
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor.config import RunConfig, check_engine
from pipeplan.executor.model import ModelSource, OptimizerConfig
from pipeplan.executor.partition import count_layers
from pipeplan.executor.stage import StageWorker, StepOutput, WorkerSpec
from pipeplan.executor.transport import GroupSpec

BATCH, MICRO = 8, 4


def dropout_net() -> ModelSource:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4)
    )
    return ModelSource.custom(model, torch.zeros(1, 16), name="dropout_net")


def one_stage(recompute: bool, source: ModelSource, accelerator: str | None = None) -> StageWorker:
    bounds = (0, count_layers(source.build()[0]))
    spec = WorkerSpec(
        0,
        0,
        "n0/fast:0",
        "n0",
        bounds,
        BATCH,
        source,
        OptimizerConfig(),
        shape=((MICRO, 1),),
        recompute=recompute,
        accelerator=accelerator,
    )
    worker = StageWorker(spec)
    worker.group = GroupSpec("127.0.0.1", 0, 0, ((0,),), "gloo", 10.0)  # one rank: no messages
    worker.optimizer = None  # keep the step's gradients to look at
    return worker


def batch() -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    return {"input": rng.standard_normal((BATCH, 16)).astype("f4")}, rng.integers(0, 4, BATCH)


def step(worker: StageWorker, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    x, y = batch()
    (name,) = worker.graph.inputs
    torch.manual_seed(seed)  # the dropout masks (CPU and every GPU)
    out = worker.run_step(0, {name: x["input"]}, y)
    assert isinstance(out, StepOutput), out
    assert out.loss is not None
    grads = {n: p.grad.to("cpu", copy=True) for n, p in worker.params.items() if p.grad is not None}
    return float(out.loss["loss_sum"]), grads


@pytest.mark.parametrize(
    "accelerator",
    [
        None,
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_recompute_gives_the_same_losses_and_gradients_with_dropout(
    accelerator: str | None,
) -> None:
    source = dropout_net()
    loss, grads = step(one_stage(False, source, accelerator), seed=5)
    again_loss, again = step(one_stage(True, source, accelerator), seed=5)
    assert again_loss == pytest.approx(loss, rel=1e-6)
    assert sorted(again) == sorted(grads) and grads
    for n in grads:
        assert torch.allclose(again[n], grads[n], atol=1e-6), n
    # the dropout is live: other masks give other gradients, so equality above is the replay
    _, other = step(one_stage(True, source, accelerator), seed=6)
    assert any(not torch.allclose(other[n], grads[n], atol=1e-6) for n in grads)


def test_a_recomputing_forward_keeps_only_its_inputs() -> None:
    worker = one_stage(True, dropout_net())
    x, y = batch()
    (name,) = worker.graph.inputs
    worker.begin_step()
    losses = {"loss_sum": 0.0, "predictions": 0, "correct": 0}
    worker._forward(0, 0, {name: x["input"]}, y, losses)
    leaves, outputs = worker._saved[0]
    assert outputs == {}  # no activation, no graph: only the replay's inputs
    replay = worker._replays[0]
    assert sorted(replay.values) == [name] and replay.samples == MICRO
    assert not worker._losses[0].requires_grad
    worker._backward(0, 0)
    assert 0 not in worker._replays and all(p.grad is not None for p in worker.params.values())


def test_the_torch_engine_refuses_recomputing_stages() -> None:
    spec = ClusterSpec("c", {"a": DeviceType("a", 1e9, 1)}, (Node("n0", {"a": 2}),))
    plan = Plan(4, (Stage((0, 1), ("n0/a:0",), 2), Stage((1, 2), ("n0/a:1",), 2, True)))
    config = RunConfig(engine="torch-pipelining", emulate=False)
    with pytest.raises(PlanError, match=r"cannot run this plan: recomputing stages \[1\]"):
        check_engine(plan, spec, config)
