"""models.profiler: FLOPs and bytes against hand formulas, folding, successors on DAGs,
consistency with split_module, JSON round trip, measured timings, errors."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.split_module import split_module
from torchvision.models.inception import InceptionA
from torchvision.models.resnet import BasicBlock

from pipeplan.core.errors import PipeplanError
from pipeplan.core.profile import ModelProfile
from pipeplan.models import zoo
from pipeplan.models.fx_layers import layer_nodes, layer_of_nodes, trace
from pipeplan.models.layer_timing import calibrated, fit_fixed_per_sample, fit_layers
from pipeplan.models.profiler import profile_model


def analytic(model: nn.Module, x: torch.Tensor, name: str = "m") -> ModelProfile:
    return profile_model(model, x, name, device_type=None)


class MatmulParam(nn.Module):
    """A parameter read through get_attr, a view of the input folded forward, weight sharing."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(x.view(x.size(0), -1, 6) @ self.w)) + self.w.sum()


class Attention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x)


class SelfMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x)[0]


def resnet_block() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BasicBlock(8, 8))


def tiny_gpt() -> tuple[nn.Module, torch.Tensor]:
    return zoo.build("gpt", 8, n_layer=1, d_model=32, n_head=4, n_ctx=16, vocab_size=50)


# --- FLOPs and bytes ------------------------------------------------------------------------


def test_conv2d_flops_params_activation() -> None:
    conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
    p = analytic(nn.Sequential(conv), torch.randn(1, 3, 10, 10))
    (layer,) = p.layers
    out = 8 * 10 * 10
    assert layer.op == "conv"
    assert layer.flops == 2 * (3 * 3 * 3) * out + out  # multiply-add = 2 FLOPs, + bias
    assert layer.params_bytes == (8 * 3 * 3 * 3 + 8) * 4
    assert layer.activation_bytes == out * 4
    assert p.input_shape == (3, 10, 10)


def test_grouped_strided_conv_without_bias() -> None:
    conv = nn.Conv2d(4, 8, kernel_size=3, stride=2, groups=2, bias=False)
    (layer,) = analytic(nn.Sequential(conv), torch.randn(1, 4, 9, 9)).layers
    assert layer.flops == 2 * (2 * 3 * 3) * (8 * 4 * 4)
    assert layer.activation_bytes == 8 * 4 * 4 * 4


@pytest.mark.parametrize("shape", [(1, 20), (1, 5, 20)])
def test_linear_flops_params_activation(shape: tuple[int, ...]) -> None:
    (layer,) = analytic(nn.Sequential(nn.Linear(20, 7)), torch.randn(shape)).layers
    rows = shape[1] if len(shape) == 3 else 1
    assert layer.op == "fc"
    assert layer.flops == 2 * 20 * 7 * rows + 7 * rows
    assert layer.params_bytes == (20 * 7 + 7) * 4
    assert layer.activation_bytes == 7 * rows * 4


def test_matmul_with_parameter_and_shared_weight() -> None:
    model = MatmulParam()
    p = analytic(model, torch.randn(1, 18))
    assert [layer.op for layer in p.layers] == ["fc", "relu", "fc", "other", "add"]
    assert p.layers[0].flops == 2 * (3 * 4) * 6  # (3 x 6) @ (6 x 4)
    assert p.layers[0].params_bytes == 6 * 4 * 4  # w, counted once though read twice
    assert p.layers[3].params_bytes == 0
    assert p.params_bytes == sum(q.numel() * 4 for q in model.parameters())


def test_attention_flops_are_the_two_matmuls() -> None:
    (layer,) = analytic(Attention(), torch.randn(1, 2, 5, 4)).layers
    assert layer.op == "attention"
    assert layer.flops == 2 * (2 * 5) * 5 * (4 + 4)  # QK^T and PV over 2 heads x 5 rows


def test_multihead_attention_counts_projections() -> None:
    model = SelfMHA()
    (layer,) = analytic(model, torch.randn(1, 5, 8)).layers
    proj = 4 * 5 * 8 * 8  # q, k, v and output projections of 5 tokens
    attn = 2 * 5 * 5 * 8
    assert layer.op == "attention"
    assert layer.flops == 2 * (proj + attn)
    assert layer.params_bytes == sum(q.numel() * 4 for q in model.parameters())
    assert layer.activation_bytes == 5 * 8 * 4


def test_elementwise_and_pool_counts() -> None:
    p = analytic(nn.Sequential(nn.ReLU(), nn.MaxPool2d(2)), torch.randn(1, 2, 4, 4))
    relu, pool = p.layers
    assert (relu.op, relu.flops, relu.activation_bytes) == ("relu", 32, 32 * 4)
    assert (pool.op, pool.flops, pool.activation_bytes) == ("pool", 32, 8 * 4)


def test_activation_bytes_match_module_outputs() -> None:
    model, x = zoo.build("digits_cnn")
    outputs: list[int] = []
    for m in (m for m in model.modules() if not list(m.children())):  # leaves, in order
        m.register_forward_hook(lambda _m, _i, out: outputs.append(out.numel() * 4))
    model(x)
    expected = list(outputs)  # the hooks fire again while profiling
    assert [layer.activation_bytes for layer in analytic(model, x).layers] == expected


# --- folding and graph structure ------------------------------------------------------------


def test_flatten_is_folded_into_the_layer_that_reads_it() -> None:
    model, x = zoo.build("digits_cnn")
    p = analytic(model, x)
    assert [layer.op for layer in p.layers] == [
        "conv", "relu", "conv", "relu", "pool", "fc", "relu", "fc",
    ]  # fmt: skip
    nodes = layer_nodes(trace(model))
    assert nodes[4] == ["features_4"] and nodes[5] == ["flatten", "classifier_0"]


def test_a_cut_never_sends_a_flattened_or_permuted_view() -> None:
    """GPT's attention reshapes its QKV projection to ``(3, B, H, T, D)``: a cut after the
    projection sends the projection's ``(B, T, 3C)`` output, which a stage slices by samples."""
    from pipeplan.executor.partition import partition

    model, x = tiny_gpt()
    gm = trace(model)
    names = layer_nodes(gm)
    qkv = next(i for i, layer in enumerate(names) if any("qkv" in n for n in layer))
    cut = partition(model, x, (0, qkv + 1, len(names)))
    sent = cut.stages[0].outputs
    assert all(cut.meta[n].kind in ("batched", "constant") for n in sent), cut.meta


def test_gpt_positions_join_the_position_embedding() -> None:
    model, x = tiny_gpt()
    gm = trace(model)
    names = layer_nodes(gm)
    p = analytic(model, x)
    wpe = [layer.name for layer in p.layers].index("wpe")
    assert {"size", "arange", "wpe"} <= set(names[wpe])
    assert {"attention", "embedding", "norm", "add"} <= {layer.op for layer in p.layers}


def test_resnet_block_input_feeds_the_skip_add() -> None:
    p = analytic(resnet_block(), torch.randn(1, 3, 8, 8))
    ops = [layer.op for layer in p.layers]
    assert ops == ["conv", "conv", "norm", "relu", "conv", "norm", "add", "relu"]
    assert p.layers[0].successors == (1, ops.index("add"))
    assert p.layers[5].successors == (ops.index("add"),)


def test_inception_branches_feed_the_concat() -> None:
    p = analytic(InceptionA(8, pool_features=4), torch.randn(1, 8, 5, 5))
    concat = len(p) - 1
    assert p.layers[concat].op == "concat"
    feeders = [i for i, layer in enumerate(p.layers) if concat in layer.successors]
    assert len(feeders) == 4  # the four branches
    assert p.layers[concat].activation_bytes == sum(p.layers[i].activation_bytes for i in feeders)


CASES: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "digits": lambda: zoo.build("digits_cnn"),
    "resnet_block": lambda: (resnet_block(), torch.randn(1, 3, 8, 8)),
    "inception_block": lambda: (InceptionA(8, pool_features=4), torch.randn(1, 8, 5, 5)),
    "gpt": tiny_gpt,
    "matmul_param": lambda: (MatmulParam(), torch.randn(1, 18)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_of_nodes_splits_like_the_profile(case: str) -> None:
    model, x = CASES[case]()
    gm = trace(model)
    layer_of = layer_of_nodes(gm)
    assert sorted(set(layer_of.values())) == list(range(len(analytic(model, x))))
    for node in gm.graph.nodes:  # every edge goes to the same or a later layer
        for a in node.all_input_nodes:
            if a.name in layer_of and node.name in layer_of:
                assert layer_of[a.name] <= layer_of[node.name], (a.name, node.name)
    parts = split_module(gm, model, lambda n: layer_of[n.name])
    model.eval()
    with torch.no_grad():
        batch = torch.cat([x, x])
        assert torch.allclose(parts(batch), model(batch), atol=1e-5)


def test_layer_names_are_unique() -> None:
    p = analytic(resnet_block(), torch.randn(1, 3, 8, 8))  # BasicBlock calls its relu twice
    names = [layer.name for layer in p.layers]
    assert len(set(names)) == len(names)


# --- measured timings and JSON --------------------------------------------------------------


@pytest.fixture(scope="module")
def measured() -> ModelProfile:
    model, x = zoo.build("digits_cnn")
    return profile_model(model, x, "digits_cnn", "cpu", batch_sizes=(2, 4), warmup=1, repeats=2)


def test_measured_timings_are_non_negative(measured: ModelProfile) -> None:
    assert measured.device_types == ("cpu",)
    for layer in measured.layers:
        t = layer.timings["cpu"]
        assert min(t.fwd_s, t.bwd_s, t.fwd_fixed_s, t.bwd_fixed_s) >= 0.0
    assert sum(layer.timings["cpu"].forward(4) for layer in measured.layers) > 0.0


def test_profile_round_trips_through_json(measured: ModelProfile, tmp_path: Path) -> None:
    assert ModelProfile.from_dict(measured.to_dict()) == measured
    path = tmp_path / "digits.json"
    measured.save(path)
    assert ModelProfile.load(path) == measured


def test_profiling_leaves_the_model_as_it_was() -> None:
    bn = nn.BatchNorm2d(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), bn, nn.ReLU(inplace=True))
    model.eval()
    assert bn.running_mean is not None
    stats = bn.running_mean.clone()
    threads = torch.get_num_threads()
    p = profile_model(model, torch.randn(1, 3, 6, 6), "bn", "cpu", warmup=0, repeats=1)
    assert len(p) == 3
    assert not any(m.training for m in model.modules())
    assert torch.equal(bn.running_mean, stats)
    assert all(q.grad is None for q in model.parameters())
    assert torch.get_num_threads() == threads


def test_cpu_clock_times_the_compute_not_a_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    model, x = zoo.build("digits_cnn")
    # Every forward of the first conv also sleeps 20 ms: the wall clock sees it, CPU time not.
    real_forward = model.features[0].forward

    def sleepy(t: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return real_forward(t)

    monkeypatch.setattr(model.features[0], "forward", sleepy)
    opts = {"batch_sizes": (2, 4), "warmup": 0, "repeats": 1}
    wall = profile_model(model, x, "d", "cpu", clock="wall", **opts)  # type: ignore[arg-type]
    cpu = profile_model(model, x, "d", "cpu", clock="cpu", **opts)  # type: ignore[arg-type]
    # A layer's time is a fit (two sizes, scaled to the whole model's call), not one reading:
    # the sleep shows as about 20 ms (19.8 ms in one CI run), never as the CPU clock's few.
    assert wall.layers[0].timings["cpu"].forward(2) >= 0.015
    assert cpu.layers[0].timings["cpu"].forward(2) < 0.01


def test_calibration_scales_layers_to_the_whole_model() -> None:
    layers = [(1.0, 2.0), (3.0, 0.0), (0.0, 2.0)]
    assert calibrated(layers, (8.0, 2.0)) == [(2.0, 1.0), (6.0, 0.0), (0.0, 1.0)]
    assert calibrated([(0.0, 0.0)], (1.0, 1.0)) == [(0.0, 0.0)]  # nothing to scale
    model, x = zoo.build("digits_cnn")
    opts = {"batch_sizes": (2, 4), "warmup": 1, "repeats": 2, "clock": "cpu"}
    p = profile_model(model, x, "d", "cpu", calibrate=True, **opts)  # type: ignore[arg-type]
    assert all(layer.timings["cpu"].forward(4) >= 0 for layer in p.layers)
    assert sum(layer.timings["cpu"].forward(4) for layer in p.layers) > 0


def test_loss_is_timed_with_the_last_layer_forward_and_backward() -> None:
    import time

    model, x = zoo.build("digits_cnn")
    seen: list[tuple[int, ...]] = []

    def slow_loss(out: torch.Tensor) -> torch.Tensor:
        # 20 ms in the loss's forward and 20 ms more in its backward (a custom op)
        seen.append(tuple(out.shape))
        time.sleep(0.02)
        return _SleepyBackward.apply(out.sum())

    opts = {"batch_sizes": (2, 4), "warmup": 0, "repeats": 1, "clock": "wall"}
    with_loss = profile_model(model, x, "d", "cpu", loss=slow_loss, **opts)  # type: ignore[arg-type]
    n_layers = len(with_loss)
    last = with_loss.layers[-1].timings["cpu"]
    # The layers are calibrated to the whole model's time, which other processes on the
    # machine (tests run in parallel) can make shorter than the sum of the parts: the 20 ms
    # may come out scaled down: half of it is asked for, and in the last layer only.
    assert last.forward(2) >= 0.01 and last.backward(2) >= 0.01
    # only the last layer carries it, and it saw the model's output
    others = [layer.timings["cpu"].forward(2) for layer in with_loss.layers[:-1]]
    assert max(others) < min(0.02, last.forward(2))
    assert set(seen) == {(2, 10), (4, 10)}
    assert n_layers == len(profile_model(model, x, "d", None))


def test_timed_backwards_start_from_no_gradients() -> None:
    model, x = zoo.build("digits_cnn")
    params = list(model.parameters())
    had_grads: list[bool] = []

    def probe() -> None:
        had_grads.append(any(p.grad is not None for p in params))

    def loss(out: torch.Tensor) -> torch.Tensor:
        return _Probe.apply(out.sum(), probe)

    opts = {"batch_sizes": (2, 4), "warmup": 1, "repeats": 2, "clock": "cpu"}
    profile_model(model, x, "d", "cpu", calibrate=True, loss=loss, **opts)  # type: ignore[arg-type]
    # the loss's backward runs first in each pass: no pass finds an earlier pass's gradients
    # (adding into them is the cost model's accumulation term, not the profile's)
    assert len(had_grads) == 2 * 2 * 3  # 2 batch sizes x (chain + whole model) x 3 passes
    assert not any(had_grads)
    assert all(p.grad is None for p in params)  # and the model is left without them


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, on_backward: Callable[[], None]) -> torch.Tensor:
        ctx.on_backward = on_backward
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.on_backward()
        return g, None


class _SleepyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.02)
        return g


def test_loss_needs_one_output_tensor() -> None:
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x)

    with pytest.raises(PipeplanError, match="loss: needs a model with one output tensor"):
        profile_model(TwoHeads(), torch.randn(1, 4), "two", "cpu", loss=lambda t: t.sum())


def test_fitted_layers_sum_to_the_measured_totals_at_both_sizes() -> None:
    # layer 0 is slower at 2 samples than at 8 (clipped: all fixed), layer 1 superlinear
    # (clipped: all per sample), layer 2 linear
    t1, t2 = [1.0, 0.1, 0.5], [0.9, 1.0, 1.1]
    fits = fit_layers(2, t1, 8, t2)
    assert sum(f + 2 * p for f, p in fits) == pytest.approx(sum(t1))
    assert sum(f + 8 * p for f, p in fits) == pytest.approx(sum(t2))
    assert all(f >= 0 and p >= 0 for f, p in fits)
    clipped = [fit_fixed_per_sample(2, a, 8, b) for a, b in zip(t1, t2, strict=True)]
    assert sum(f + 8 * p for f, p in clipped) == pytest.approx(1.1 * sum(t2))  # the clips cost
    # shares of each part are the clipped fits' (layer 0 holds most of the fixed part)
    assert fits[0][0] / sum(f for f, _ in fits) == pytest.approx(
        clipped[0][0] / sum(f for f, _ in clipped)
    )
    linear = fit_layers(2, [1.0, 2.0], 8, [1.6, 5.0])  # no clip: each layer's own fit
    assert linear == [pytest.approx((0.8, 0.1)), pytest.approx((1.0, 0.5))]
    assert fit_layers(2, [0.0, 0.0], 8, [0.0, 0.0]) == [(0.0, 0.0), (0.0, 0.0)]


def test_fit_fixed_per_sample() -> None:
    assert fit_fixed_per_sample(2, 1.0, 8, 2.2) == pytest.approx((0.6, 0.2))
    assert fit_fixed_per_sample(2, 1.0, 8, 0.9) == (1.0, 0.0)  # slower small batch: all fixed
    assert fit_fixed_per_sample(2, 0.1, 4, 1.0) == pytest.approx((0.0, 0.45))


def test_pause_sleeps_before_each_timed_whole_model_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeplan.models import layer_timing

    model, x = zoo.build("digits_cnn")
    slept: list[float] = []
    real_sleep = layer_timing.time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(layer_timing.time, "sleep", sleep)
    opts = {"batch_sizes": (2, 4), "warmup": 1, "repeats": 2, "clock": "wall"}
    paused = profile_model(model, x, "d", "cpu", calibrate=True, pause_s=0.05, **opts)  # type: ignore[arg-type]
    # 2 batch sizes x 3 passes x (forward + backward), the chain's layers never
    assert slept == [0.05] * 12
    # the pause is not timed: the whole model's forward of 2 samples takes well under 50 ms
    assert sum(layer.timings["cpu"].forward(2) for layer in paused.layers) < 0.05
    slept.clear()
    profile_model(model, x, "d", "cpu", calibrate=True, **opts)  # type: ignore[arg-type]
    assert slept == []


def test_whole_model_calls_take_turns_between_the_batch_sizes() -> None:
    model, x = zoo.build("digits_cnn")
    sizes: list[int] = []

    def loss(out: torch.Tensor) -> torch.Tensor:
        sizes.append(out.shape[0])
        return out.sum()

    opts = {"batch_sizes": (2, 4), "warmup": 1, "repeats": 2, "clock": "cpu"}
    profile_model(model, x, "d", "cpu", calibrate=True, loss=loss, **opts)  # type: ignore[arg-type]
    # the chain at each size in turn (3 passes each), then the whole model, sizes alternating
    assert sizes == [2, 2, 2, 4, 4, 4, 2, 4, 2, 4, 2, 4]


def test_pause_needs_the_whole_model_calls() -> None:
    model, x = zoo.build("digits_cnn")
    with pytest.raises(PipeplanError, match=r"pause_s: 0\.03 .*calibrate=True"):
        profile_model(model, x, "d", "cpu", pause_s=0.03)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("batch_sizes", (4, 2)),
        ("batch_sizes", (0, 4)),
        ("batch_sizes", (2,)),
        ("warmup", -1),
        ("repeats", 0),
        ("clock", "gpu"),
        ("pause_s", -0.1),
        ("pause_s", float("nan")),
        ("pause_s", 60),
        ("pause_s", "1"),
    ],
)
def test_bad_options_name_field_and_value(option: str, value: object) -> None:
    model, x = zoo.build("digits_cnn")
    with pytest.raises(PipeplanError, match=f"{option}.*{re.escape(repr(value))}"):
        profile_model(model, x, "d", **{option: value})  # type: ignore[arg-type]


def test_example_input_must_be_a_batched_tensor() -> None:
    with pytest.raises(PipeplanError, match="example_input"):
        profile_model(nn.Linear(2, 2), torch.tensor(1.0), "m", device_type=None)


def test_untraceable_model_is_reported() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(
        PipeplanError, match=r"^model Branchy: torch.export cannot trace it \(.*if x.sum\(\) > 0"
    ):
        analytic(Branchy(), torch.randn(1, 3))


def test_model_without_compute_is_refused() -> None:
    with pytest.raises(PipeplanError, match="no compute node"):
        analytic(nn.Flatten(), torch.randn(1, 2, 2))
