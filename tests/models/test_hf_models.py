"""Hugging Face models (``hf:``): built from their configs, traced with torch.export,
profiled, cut into stages that train as the whole model does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipeplan.core.errors import PipeplanError
from pipeplan.executor.model import (
    Batch,
    ModelSource,
    OptimizerConfig,
    batch_loss,
    disable_dropout,
    loss_terms,
    train_single_process,
)
from pipeplan.executor.partition import fetch_attr, partition
from pipeplan.models.profiler import profile_model

pytest.importorskip("transformers")

VOCAB = 64
GPT2 = ModelSource(
    "hf:GPT2LMHeadModel",
    8,
    seed=3,
    options={"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": VOCAB, "n_positions": 16},
)
LLAMA = ModelSource(
    "hf:LlamaForCausalLM",
    8,
    seed=3,
    options={
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 16,
    },
)  # fmt: skip


def _batches(steps: int, rows: int, tokens: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randint(VOCAB, (rows, tokens), generator=gen),
         torch.randint(VOCAB, (rows, tokens), generator=gen))
        for _ in range(steps)
    ]  # fmt: skip


def _stage_params(model: nn.Module, stage: Any) -> dict[str, nn.Parameter]:
    """A stage's parameters by the model's names, as a stage worker collects them."""
    params = {stage.param_names[n]: p for n, p in stage.module.named_parameters()}
    for target in stage.attrs.values():
        value = fetch_attr(model, target)
        if isinstance(value, nn.Parameter):
            params[target] = value
    return params


def _pipelined(
    source: ModelSource, bounds: tuple[int, ...], batches: list[Batch], lr: float
) -> dict[str, torch.Tensor]:
    """The stages run in sequence in this process, two microbatches a step, one optimizer
    per stage: the parameters after training."""
    model, example = source.build()
    disable_dropout(model)
    cut = partition(model, example, bounds)
    stages = [_stage_params(model, st) for st in cut.stages]
    names = [n for params in stages for n in params]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each once
    optimizers = [OptimizerConfig(lr=lr).make(params.values()) for params in stages]
    for x, y in batches:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        half = x.shape[0] // 2
        for rows in (slice(0, half), slice(half, None)):
            env: dict[str, Any] = {cut.model_inputs[0]: x[rows]}
            for st in cut.stages:
                args = [env[a] if a in env else fetch_attr(model, st.attrs[a]) for a in st.args]
                env.update(zip(st.results, st.module(*args), strict=True))
            terms = loss_terms(env[cut.model_output], y[rows])
            batch_loss(terms, x[rows].shape[0], x.shape[0]).backward()
        for opt in optimizers:
            opt.step()
    return {n: p.detach().clone() for params in stages for n, p in params.items()}


@pytest.mark.slow
@pytest.mark.parametrize("source", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_hf_model_profiles_cuts_and_trains_as_one_process(source: ModelSource) -> None:
    model, example = source.build()
    assert example.shape == (1, 8) and example.dtype == torch.int64
    assert model(example).shape == (1, 8, VOCAB)
    prof = profile_model(model, example, source.name, device_type=None)
    n = len(prof)
    ops = {layer.op for layer in prof.layers}
    assert n > 20 and {"embedding", "fc", "attention"} <= ops
    bounds = (0, n // 3, 2 * n // 3, n)
    batches = _batches(steps=2, rows=4, tokens=8)
    reference = train_single_process(source, batches, OptimizerConfig(lr=0.1), deterministic=True)
    trained = _pipelined(source, bounds, batches, lr=0.1)
    assert trained.keys() == reference.parameters.keys()
    for name, value in trained.items():
        torch.testing.assert_close(value, reference.parameters[name], atol=1e-5, rtol=1e-5)
    first, _ = source.build()
    moved = [n for n, p in first.named_parameters() if not torch.equal(p, trained[n])]
    assert moved  # the steps did train


def test_hf_weights_are_the_same_for_a_seed_and_leave_the_global_rng() -> None:
    state = torch.random.get_rng_state()
    a, xa = GPT2.build()
    b, xb = GPT2.build()
    assert torch.equal(state, torch.random.get_rng_state())
    assert torch.equal(xa, xb)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    c, _ = ModelSource(GPT2.name, 8, seed=4, options=GPT2.options).build()
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_hf_defaults_untie_embeddings_and_cap_the_example() -> None:
    model, example = ModelSource("hf:GPT2LMHeadModel", options=GPT2.options).build()
    inner: Any = model.model
    assert inner.config.tie_word_embeddings is False and inner.config.use_cache is False
    assert example.shape == (1, 16)  # no input_size: the config's 16 positions


@pytest.mark.parametrize(
    ("ref", "options", "size", "match"),
    [
        ("hf:NoSuchModel", {}, 8, r"model: hf:NoSuchModel is not a transformers model class"),
        ("hf:GPT2Config", {}, 8, r"model: hf:GPT2Config is not a transformers model class"),
        ("hf:GPT2LMHeadModel", {"n_layr": 2}, 8, r"model_options: 'n_layr' is not an option"),
        ("hf:GPT2LMHeadModel", {"n_positions": 16}, 32,
         r"input_size: must be <= max_position_embeddings \(16\) of hf:GPT2LMHeadModel, got 32"),
    ],
)  # fmt: skip
def test_hf_errors_name_the_field(ref: str, options: dict[str, Any], size: int, match: str) -> None:
    with pytest.raises(PipeplanError, match=match):
        ModelSource(ref, size, options=options).build()
