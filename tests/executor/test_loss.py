"""The loss named by ``--loss``: parsing, loading, and pipelined pieces that sum to the
whole batch's loss and gradient."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from pipeplan.core.errors import PipeplanError
from pipeplan.executor.loss import Loss, LossSpec, batch_loss, load_loss, loss_terms
from pipeplan.executor.model import batch_loss as model_batch_loss

USER = "tests.executor.user_code"


def test_cross_entropy_is_the_default() -> None:
    assert LossSpec.parse("cross-entropy") == LossSpec()
    assert str(LossSpec()) == "cross-entropy"
    assert LossSpec().class_targets


def test_a_reference_is_parsed_without_importing_it() -> None:
    spec = LossSpec.parse("no_such_package.mod:fn")
    assert (spec.kind, spec.ref, str(spec)) == ("code", "no_such_package.mod:fn", spec.ref)
    assert not spec.class_targets
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(PipeplanError, match=r"^loss: cannot import module 'no_such_package.mod'"):
        load_loss(spec)


@pytest.mark.parametrize("text", ["mse", "", "crossentropy", "a.b:"])
def test_an_unknown_loss_is_refused_naming_it(text: str) -> None:
    with pytest.raises(PipeplanError) as e:
        LossSpec.parse(text)
    assert str(e.value) == (
        f"loss: {text!r} is neither 'cross-entropy' nor a package.module:callable"
    )


def test_a_spec_built_by_hand_is_checked() -> None:
    with pytest.raises(PipeplanError, match=r"^loss: kind is 'cross-entropy' or 'code', got 'l1'"):
        LossSpec("l1")  # type: ignore[arg-type]
    with pytest.raises(PipeplanError, match=r"^loss: a reference goes with kind 'code' only"):
        LossSpec("code")
    with pytest.raises(PipeplanError, match=r"^loss: 'nope' is not a package.module:callable"):
        LossSpec("code", "nope")


def test_a_reference_to_no_callable_is_refused() -> None:
    with pytest.raises(PipeplanError, match=rf"^loss: '{USER}:NOT_CALLABLE' is a int, not a"):
        load_loss(LossSpec.parse(f"{USER}:NOT_CALLABLE"))


def test_the_model_module_re_exports_the_loss() -> None:
    assert model_batch_loss is batch_loss


def test_cross_entropy_terms_are_loss_terms() -> None:
    logits, labels = torch.randn(2, 5, 7), torch.randint(7, (2, 5))
    terms = load_loss(LossSpec()).terms(logits, labels)
    expected = loss_terms(logits, labels)
    assert (terms.predictions, terms.correct) == (10, expected.correct)
    assert torch.equal(terms.loss_sum, expected.loss_sum)


def _pieces_and_whole(loss: Loss) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of the pieces' losses, its gradient, the whole batch's loss, its gradient) for
    a batch of 6 cut in pieces of 1, 2 and 3 samples."""
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    pieced = logits.clone().requires_grad_()
    parts = [
        batch_loss(loss.terms(pieced[s], labels[s]), s.stop - s.start, 6)
        for s in (slice(0, 1), slice(1, 3), slice(3, 6))
    ]
    total = torch.stack(parts).sum()
    total.backward()
    whole = logits.clone().requires_grad_()
    terms = loss.terms(whole, labels)
    mean = batch_loss(terms, 6, 6)
    mean.backward()
    assert pieced.grad is not None and whole.grad is not None
    return total.detach(), pieced.grad, mean.detach(), whole.grad


@pytest.mark.parametrize("text", ["cross-entropy", f"{USER}:mean_loss"])
def test_pipelined_pieces_sum_to_the_whole_batch(text: str) -> None:
    total, grad, mean, whole_grad = _pieces_and_whole(load_loss(LossSpec.parse(text)))
    assert float(total) == pytest.approx(float(mean), abs=1e-6)
    torch.testing.assert_close(grad, whole_grad)


def test_a_custom_loss_counts_its_mean_once_per_sample() -> None:
    logits, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    terms = load_loss(LossSpec.parse(f"{USER}:mean_loss")).terms(logits, labels)
    expected = F.cross_entropy(logits, labels) + 0.1 * logits.pow(2).mean()
    assert (terms.predictions, terms.correct) == (6, 0)
    assert float(terms.loss_sum) == pytest.approx(6 * float(expected), rel=1e-6)
    assert float(batch_loss(terms, 6, 6)) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize(
    ("name", "got"),
    [("vector_loss", "a tensor of shape (6,)"), ("int_loss", "a int")],
)
def test_a_custom_loss_must_return_a_scalar_tensor(name: str, got: str) -> None:
    loss = load_loss(LossSpec.parse(f"{USER}:{name}"))
    with pytest.raises(PipeplanError) as e:
        loss.terms(torch.randn(6, 4), torch.zeros(6, dtype=torch.long))
    assert str(e.value) == f"loss: '{USER}:{name}' must return a scalar tensor, got {got}"


def test_a_custom_loss_must_be_floating() -> None:
    loss = load_loss(LossSpec.parse(f"{USER}:count_loss"))
    with pytest.raises(PipeplanError) as e:
        loss.terms(torch.randn(6, 4), torch.zeros(6, dtype=torch.long))
    assert (
        str(e.value) == f"loss: '{USER}:count_loss' must return a floating tensor, got torch.int64"
    )
