"""The data ``--data`` names: parsing, every kind of source as a stream, seeking, epochs,
determinism, and the checks on the first batch."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeplan.core.errors import PipeplanError
from pipeplan.executor.data import (
    BatchStream,
    DataSpec,
    check_batch,
    digits,
    digits_batches,
    open_stream,
    synthetic_batches,
)
from pipeplan.executor.model import Batch
from tests.executor import user_code

USER = "tests.executor.user_code"
IMAGE = torch.zeros(1, 1, 4, 4)
"""The example of a small image model (1 x 4 x 4, 4 classes)."""
TOKENS = torch.zeros(1, 4, dtype=torch.long)
"""The example of a small LM (context 4, vocabulary 50)."""
FORMS = "synthetic, digits, imagefolder:PATH, tokens:PATH or package.module:callable"


def _equal(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, u) and torch.equal(y, v) and x.dtype == u.dtype and y.dtype == v.dtype
        for (x, y), (u, v) in zip(a, b, strict=True)
    )


def _take(stream: BatchStream, n: int) -> list[Batch]:
    return [stream.next() for _ in range(n)]


def _assert_seeks(open_: object, n: int) -> None:
    """After ``seek(k)`` a stream hands out the k-th and following batches of a fresh one,
    a fresh stream as well as one that read on (backwards too)."""
    assert callable(open_)
    expected = _take(open_(), n)
    for k in range(n):
        fresh = open_()
        fresh.seek(k)
        assert _equal(_take(fresh, n - k), expected[k:]), k
        assert fresh.position == n
    used = open_()
    _take(used, n)
    used.seek(1)
    assert _equal(_take(used, 2), expected[1:3])


# --- parsing --------------------------------------------------------------------------------


def test_the_default_is_synthetic() -> None:
    assert DataSpec() == DataSpec.parse("synthetic") == DataSpec("synthetic")
    assert DataSpec.parse("digits").kind == "digits"


def test_paths_are_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = DataSpec.parse("tokens:train.bin")
    assert spec == DataSpec("tokens", path=str(tmp_path / "train.bin"))
    assert str(spec) == f"tokens:{tmp_path / 'train.bin'}"
    assert DataSpec.parse(str(spec)) == spec
    assert DataSpec.parse(f"imagefolder:{tmp_path}").path == str(tmp_path)


def test_a_reference_is_parsed_without_importing_it() -> None:
    spec = DataSpec.parse("no_such_package.mod:make")
    assert (spec.kind, spec.ref, str(spec)) == ("code", "no_such_package.mod:make", spec.ref)
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(PipeplanError, match=r"^data: cannot import module 'no_such_package.mod'"):
        open_stream(spec, IMAGE, (1, 4), 2)


@pytest.mark.parametrize("text", ["", "mnist", "tokens", "imagefolder/x", "a.b:", "file.npy"])
def test_an_unknown_source_is_refused_naming_it(text: str) -> None:
    with pytest.raises(PipeplanError) as e:
        DataSpec.parse(text)
    assert str(e.value) == f"data: {text!r} is none of {FORMS}"


@pytest.mark.parametrize("text", ["tokens:", "imagefolder:"])
def test_a_source_without_its_path_is_refused(text: str) -> None:
    with pytest.raises(PipeplanError) as e:
        DataSpec.parse(text)
    assert str(e.value) == f"data: {text!r} names no path"


def test_a_spec_built_by_hand_is_checked() -> None:
    with pytest.raises(PipeplanError, match=rf"^data: kind is one of {FORMS}, got 'mnist'"):
        DataSpec("mnist")  # type: ignore[arg-type]
    with pytest.raises(PipeplanError, match=r"^data: tokens takes a path, got DataSpec\("):
        DataSpec("tokens")
    with pytest.raises(PipeplanError, match=r"^data: code takes a ref, got DataSpec\("):
        DataSpec("code", path="x")
    with pytest.raises(PipeplanError, match=r"^data: synthetic takes no path nor ref, got "):
        DataSpec("synthetic", path="x")
    with pytest.raises(PipeplanError, match=r"^data: 'x' is not a package.module:callable"):
        DataSpec("code", ref="x")


@pytest.mark.parametrize("kind", ["tokens", "imagefolder"])
def test_a_missing_path_is_refused_on_opening(tmp_path: Path, kind: str) -> None:
    missing = tmp_path / "nowhere.npy"
    spec = DataSpec.parse(f"{kind}:{missing}")
    with pytest.raises(PipeplanError) as e:
        open_stream(spec, TOKENS if kind == "tokens" else IMAGE, (1, 4, 50), 2)
    assert str(e.value) == f"data: no such file or folder {str(missing)!r}"


def test_a_global_batch_below_one_is_refused() -> None:
    with pytest.raises(PipeplanError, match=r"^data: the global batch must be >= 1, got 0$"):
        open_stream(DataSpec(), IMAGE, (1, 4), 0)


# --- synthetic and digits -------------------------------------------------------------------


def _digits_as_before(example: torch.Tensor, batch: int, count: int, seed: int) -> list[Batch]:
    """The digits batches as they have always been: one generator, a permutation a pass."""
    x, y = digits(tuple(example.shape[1:]))
    x = x.to(example.dtype)
    gen = torch.Generator().manual_seed(seed)
    order, pos, out = torch.randperm(len(y), generator=gen), 0, []
    for _ in range(count):
        if pos + batch > len(order):
            order, pos = torch.randperm(len(y), generator=gen), 0
        idx = order[pos : pos + batch]
        pos += batch
        out.append((x[idx], y[idx]))
    return out


def _synthetic_as_before(
    example: torch.Tensor, output_shape: tuple[int, ...], batch: int, count: int, seed: int
) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    classes, out = output_shape[-1], []
    for _ in range(count):
        if example.is_floating_point():
            x = torch.randn((batch, *example.shape[1:]), generator=gen, dtype=example.dtype)
        else:
            high = max(int(example.max()) + 1, classes)
            x = torch.randint(high, (batch, *example.shape[1:]), generator=gen)
        out.append((x, torch.randint(classes, (batch, *output_shape[1:-1]), generator=gen)))
    return out


@pytest.mark.parametrize("example", [torch.zeros(1, 1, 8, 8), torch.zeros(1, 3, 12, 12)])
def test_digits_batches_are_as_before_across_passes(example: torch.Tensor) -> None:
    expected = _digits_as_before(example, 400, 10, seed=3)  # 4 batches a pass
    assert _equal(digits_batches(example, 400, 10, seed=3), expected)
    stream = open_stream(DataSpec("digits"), example, (1, 10), 400, seed=3)
    assert stream.batches_per_epoch == 4
    assert _equal(_take(stream, 10), expected)


@pytest.mark.parametrize(
    ("example", "output_shape"),
    [(torch.zeros(1, 3, 4, 4), (1, 5)), (torch.tensor([[3, 1, 4, 1]]), (1, 4, 50))],
)
def test_synthetic_batches_are_as_before(
    example: torch.Tensor, output_shape: tuple[int, ...]
) -> None:
    expected = _synthetic_as_before(example, output_shape, 8, 5, seed=2)
    assert _equal(synthetic_batches(example, output_shape, 8, 5, seed=2), expected)
    stream = open_stream(DataSpec(), example, output_shape, 8, seed=2)
    assert stream.batches_per_epoch is None
    assert _equal(_take(stream, 5), expected)


def test_synthetic_and_digits_seek() -> None:
    _assert_seeks(lambda: open_stream(DataSpec(), TOKENS, (1, 4, 50), 3, seed=1), 6)
    example = torch.zeros(1, 1, 8, 8)
    _assert_seeks(lambda: open_stream(DataSpec("digits"), example, (1, 10), 600, seed=1), 7)


def test_digits_refuse_a_token_model() -> None:
    with pytest.raises(PipeplanError) as e:
        open_stream(DataSpec("digits"), TOKENS, (1, 4, 50), 2)
    assert (
        str(e.value) == "data: digits are images, the model takes torch.int64 inputs (token ids?)"
    )


# --- a user's data set and batches ----------------------------------------------------------


def test_a_data_set_is_shuffled_per_epoch_with_seed_plus_epoch() -> None:
    spec = DataSpec.parse(f"{USER}:dataset")  # 10 samples, sample i filled with i
    stream = open_stream(spec, IMAGE, (1, 4), 3, seed=5)
    assert stream.batches_per_epoch == 3  # the tenth sample is left out of each epoch
    for epoch in range(3):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch))
        for b in range(3):
            x, y = stream.next()
            picked = order[3 * b : 3 * b + 3]
            assert torch.equal(x[:, 0, 0, 0], picked.float())
            assert torch.equal(y, picked % 4) and y.dtype == torch.int64
    assert stream.position == 9


def test_streams_of_one_seed_agree_and_of_two_differ() -> None:
    spec = DataSpec.parse(f"{USER}:dataset")
    a, b, c = (open_stream(spec, IMAGE, (1, 4), 3, seed=s) for s in (7, 7, 8))
    first = _take(a, 8)
    assert _equal(first, _take(b, 8))
    assert not _equal(first, _take(c, 8))


def test_a_data_set_seeks_by_index_without_reading_what_it_skips() -> None:
    spec = DataSpec.parse(f"{USER}:counted")  # 40 samples: 10 batches of 4 an epoch
    _assert_seeks(lambda: open_stream(spec, IMAGE, (1, 4), 4, seed=2), 25)
    stream = open_stream(spec, IMAGE, (1, 4), 4, seed=2)
    stream.seek(23)
    user_code.READ.clear()
    x, _ = stream.next()
    order = torch.randperm(40, generator=torch.Generator().manual_seed(2 + 2))
    assert order[12:16].tolist() == user_code.READ
    assert torch.equal(x[:, 0, 0, 0], order[12:16].float())


def test_a_list_of_batches_is_an_epoch_read_in_order() -> None:
    stream = open_stream(DataSpec.parse(f"{USER}:batches"), IMAGE, (1, 4), 2)
    assert stream.batches_per_epoch == 3
    firsts = [float(stream.next()[0][0, 0, 0, 0]) for _ in range(7)]
    assert firsts == [0, 1, 2, 0, 1, 2, 0]
    _assert_seeks(lambda: open_stream(DataSpec.parse(f"{USER}:batches"), IMAGE, (1, 4), 2), 7)


def test_a_generator_is_called_again_for_every_pass() -> None:
    stream = open_stream(DataSpec.parse(f"{USER}:generator"), IMAGE, (1, 4), 2)
    assert stream.batches_per_epoch is None
    assert [float(stream.next()[0][0, 0, 0, 0]) for _ in range(5)] == [0, 1, 0, 1, 0]
    _assert_seeks(lambda: open_stream(DataSpec.parse(f"{USER}:generator"), IMAGE, (1, 4), 2), 5)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nothing", f"data: '{USER}:nothing' returned a int, neither a map-style "),
        ("NOT_CALLABLE", f"data: '{USER}:NOT_CALLABLE' is a int, not a callable"),
        ("missing", f"data: module '{USER}' has no attribute 'missing'"),
        ("singles", f"data: '{USER}:singles' gave a Tensor, not a pair (inputs, targets)"),
        ("empty", f"data: '{USER}:empty' gave no batches"),
        ("dataset", f"data: '{USER}:dataset' has 10 samples, fewer than the global batch 16"),
    ],
)
def test_bad_user_data_is_refused_naming_it(name: str, message: str) -> None:
    with pytest.raises(PipeplanError) as e:
        open_stream(
            DataSpec.parse(f"{USER}:{name}"), IMAGE, (1, 4), 16 if name == "dataset" else 2
        ).next()
    assert str(e.value).startswith(message), str(e.value)


def test_the_first_batch_is_checked() -> None:
    stream = open_stream(DataSpec.parse(f"{USER}:wide"), IMAGE, (1, 4), 2)
    with pytest.raises(PipeplanError) as e:
        stream.next()
    assert (
        str(e.value)
        == "data: inputs of shape (2, 1, 4, 5), the model takes samples of shape (1, 4, 4)"
    )


# --- image folders --------------------------------------------------------------------------


def _image_folder(root: Path) -> Path:
    """Two classes (``blue``, ``red``) of three 6 x 5 PNGs each, in solid colours."""
    for name, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        (root / name).mkdir(parents=True)
        for i in range(3):
            shade = tuple(int(c * (1 - 0.25 * i)) for c in colour)
            Image.new("RGB", (6, 5), shade).save(root / name / f"{i}.png")
    return root


def test_an_image_folder_gives_images_shaped_for_the_model(tmp_path: Path) -> None:
    spec = DataSpec.parse(f"imagefolder:{_image_folder(tmp_path / 'images')}")
    stream = open_stream(spec, torch.zeros(1, 3, 4, 4), (1, 2), 2, seed=0)
    assert stream.batches_per_epoch == 3
    order = torch.randperm(6, generator=torch.Generator().manual_seed(0))
    x, y = stream.next()
    assert x.shape == (2, 3, 4, 4) and x.dtype == torch.float32
    assert torch.equal(y, (order[:2] >= 3).long())  # blue (class 0) are samples 0, 1, 2
    for image, label in zip(x, y, strict=True):  # red in red, blue in blue, nothing else
        assert float(image[2 - 2 * int(label)].min()) > 0.4
        assert float(image[2 * int(label)].max()) == 0.0
    _assert_seeks(lambda: open_stream(spec, torch.zeros(1, 3, 4, 4), (1, 2), 2), 7)


def test_an_image_folder_in_grey_for_a_one_channel_model(tmp_path: Path) -> None:
    spec = DataSpec.parse(f"imagefolder:{_image_folder(tmp_path / 'images')}")
    x, _ = open_stream(spec, torch.zeros(1, 1, 8, 8, dtype=torch.float64), (1, 2), 6).next()
    assert x.shape == (6, 1, 8, 8) and x.dtype == torch.float64
    assert 0.0 < float(x.min()) < float(x.max()) < 1.0


def test_an_image_folder_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    spec = DataSpec.parse(f"imagefolder:{tmp_path / 'empty'}")
    with pytest.raises(PipeplanError, match=rf"^data: '{tmp_path / 'empty'}' is no image folder"):
        open_stream(spec, IMAGE, (1, 2), 2)
    with pytest.raises(PipeplanError) as e:
        open_stream(spec, torch.zeros(1, 2, 4, 4), (1, 2), 2)
    assert str(e.value) == (
        "data: imagefolder needs a model that takes 1- or 3-channel images, this one takes "
        "torch.float32 of shape (1, 2, 4, 4)"
    )


# --- token ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_token_ids_are_cut_into_windows_and_their_next_tokens(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"train{suffix}"
    ids = np.arange(42) % 50  # 41 tokens make 10 windows of 4 and their targets
    if suffix == ".npy":
        np.save(path, ids.astype(np.int32))
    else:
        ids.astype(np.uint16).tofile(path)
    spec = DataSpec.parse(f"tokens:{path}")
    stream = open_stream(spec, TOKENS, (1, 4, 50), 2, seed=1)
    assert stream.batches_per_epoch == 5
    order = torch.randperm(10, generator=torch.Generator().manual_seed(1))
    x, y = stream.next()
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 0], 4 * order[:2])
    assert torch.equal(x + 1, y) and torch.equal(x[:, 1:], y[:, :-1])
    starts = sorted(int(b[0][i, 0]) for b in [(x, y), *_take(stream, 4)] for i in range(2))
    assert starts == list(range(0, 40, 4))
    _assert_seeks(lambda: open_stream(spec, TOKENS, (1, 4, 50), 2, seed=1), 12)


@pytest.mark.parametrize(
    ("name", "array", "message"),
    [
        ("f.npy", np.zeros(40, np.float32), "holds float32 of shape (40,), not a flat array"),
        ("m.npy", np.zeros((2, 20), np.int64), "holds int64 of shape (2, 20), not a flat array"),
        ("few.npy", np.zeros(8, np.int64), "has 1 samples, fewer than the global batch 2"),
        ("e.bin", np.zeros(0, np.uint16), "holds no token ids"),
        ("t.txt", np.zeros(40, np.int64), "is neither a .npy nor a .bin of token ids"),
    ],
)
def test_bad_token_files_are_refused(
    tmp_path: Path, name: str, array: np.ndarray, message: str
) -> None:
    path = tmp_path / name
    with open(path, "wb") as f:
        np.save(f, array) if name.endswith(".npy") else array.tofile(f)
    with pytest.raises(PipeplanError) as e:
        open_stream(DataSpec.parse(f"tokens:{path}"), TOKENS, (1, 4, 50), 2)
    assert str(e.value).startswith(f"data: {str(path)!r} {message}"), str(e.value)


def test_tokens_need_a_token_model(tmp_path: Path) -> None:
    path = tmp_path / "train.npy"
    np.save(path, np.arange(40))
    with pytest.raises(PipeplanError) as e:
        open_stream(DataSpec.parse(f"tokens:{path}"), IMAGE, (1, 4), 2)
    assert str(e.value) == (
        "data: tokens need a model that takes token ids (batch, context), this one takes "
        "torch.float32 of shape (1, 1, 4, 4)"
    )


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.npy"
    np.save(path, np.arange(41) * 2)
    with pytest.raises(PipeplanError) as e:
        open_stream(DataSpec.parse(f"tokens:{path}"), TOKENS, (1, 4, 50), 10).next()
    assert str(e.value) == "data: targets range over [2, 80], the model has 50 classes (0 to 49)"


# --- checking a batch -----------------------------------------------------------------------

LM_OUT = (1, 4, 50)
"""Logits of the small LM: a prediction over 50 tokens per position."""


@pytest.mark.parametrize(
    ("x", "y", "message"),
    [
        (
            torch.zeros(2, 1, 4, 5),
            torch.zeros(2),
            "inputs of shape (2, 1, 4, 5), the model takes samples of shape (1, 4, 4)",
        ),
        (
            torch.zeros(2, 1, 4, 4, dtype=torch.long),
            torch.zeros(2),
            "inputs are torch.int64, the model takes floating inputs",
        ),
        (torch.zeros(3, 1, 4, 4), torch.zeros(3), "a batch of 3 samples, the global batch is 2"),
        (torch.zeros(2, 1, 4, 4), torch.zeros(3), "targets of shape (3,) for 2 inputs"),
        (torch.zeros(2, 1, 4, 4), torch.tensor(0), "targets of shape () for 2 inputs"),
        (
            torch.zeros(2, 1, 4, 4),
            torch.zeros(2, 1, dtype=torch.long),
            "targets of shape (2, 1), the model's logits (2, 4) take (2,)",
        ),
        (
            torch.zeros(2, 1, 4, 4),
            torch.zeros(2),
            "targets are torch.float32, class indices must be integers",
        ),
        (
            torch.zeros(2, 1, 4, 4),
            torch.tensor([-1, 3]),
            "targets range over [-1, 3], the model has 4 classes (0 to 3)",
        ),
    ],
)
def test_a_bad_batch_is_refused_naming_what_came(
    x: torch.Tensor, y: torch.Tensor, message: str
) -> None:
    with pytest.raises(PipeplanError) as e:
        check_batch((x, y), IMAGE, (1, 4), 2)
    assert str(e.value) == f"data: {message}"


def test_a_batch_for_an_lm_and_for_a_users_loss() -> None:
    x = torch.randint(50, (2, 4))
    check_batch((x, torch.randint(50, (2, 4))), TOKENS, LM_OUT, 2)
    with pytest.raises(PipeplanError, match=r"^data: inputs are torch.float32, the model takes "):
        check_batch((x.float(), x), TOKENS, LM_OUT)
    with pytest.raises(PipeplanError, match=r"^batch: targets of shape \(2,\), the model's "):
        check_batch((x, x[:, 0]), TOKENS, LM_OUT, field="batch")
    check_batch((x, torch.randn(2, 7)), TOKENS, LM_OUT, class_targets=False)


def test_a_users_loss_gets_its_targets_as_they_are() -> None:
    spec = DataSpec.parse(f"{USER}:regression")
    _, y = open_stream(spec, IMAGE, (1, 4), 2, class_targets=False).next()
    assert torch.equal(y, torch.linspace(0, 1, 6).reshape(2, 3))
    with pytest.raises(PipeplanError, match=r"^data: targets of shape \(2, 3\), the model's "):
        open_stream(spec, IMAGE, (1, 4), 2).next()
