"""Training checkpoints: one ``torch.distributed.checkpoint`` per save, plus a manifest.

**What a checkpoint holds.** Every stage replica of a run takes part in one
``torch.distributed.checkpoint`` save over the run's process group (:func:`save_shard`),
with a flat state dict keyed by the *model's* names:

- ``model/NAME``: every entry of the model's ``state_dict`` the stage holds (parameters and
  persistent buffers, by their names in the whole model, not the stage's);
- ``optim/NAME/KEY``: the optimizer's state of parameter ``NAME`` (Adam's moments and step,
  SGD's momentum buffer);
- ``rng/sSTAGE.rREPLICA``: the replica's CPU random state (dropout), one per replica.

Replicas of a stage hold the same weights and optimizer state under the same keys, and the
save planner writes such a replicated entry once. Because keys are the model's names, a
checkpoint is independent of the plan that wrote it: a stage of any other plan (other cuts,
devices, replicas) loads the names it holds (:func:`load_shard`), which re-shards the model
by parameter name.

**On disk.** ``DIR/step-00000004/`` holds the save's files and ``manifest.json`` (plan,
model reference, step, data position, optimizer: :class:`Manifest`). A save is written into
a hidden ``DIR/.step-00000004.tmp`` folder first; only once every replica has written and
the manifest is in place is it renamed to its final name, then ``DIR/latest`` is replaced
(written to a temporary file and renamed) to name it. A crash in the middle of a save leaves
the previous checkpoint and ``latest`` as they were. Every process that reads or writes a
checkpoint must see the same directory (one machine, or a shared filesystem).

:func:`export_state_dict` turns a checkpoint into the plain single-process ``state_dict``
that ``model.load_state_dict`` takes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pipeplan.core.errors import PipeplanError

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = 1


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint is of: enough to resume it, under its plan or another one."""

    step: int
    """Steps trained when it was taken (the next step to run)."""
    data_position: int
    """Global batches the data stream had handed out (where it resumes)."""
    plan: Mapping[str, Any]
    """The plan document it was trained under."""
    model: Mapping[str, Any]
    """The model reference: how to build the same architecture (name, options, seed...)."""
    optimizer: Mapping[str, Any]
    """The optimizer's kind and settings."""
    data: str = "synthetic"
    """The data source reference."""
    format: int = FORMAT
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str) -> Manifest:
        if doc.get("format") != FORMAT:
            raise PipeplanError(
                f"checkpoint {where}: manifest format {doc.get('format')!r}, expected {FORMAT}"
            )
        try:
            return cls(**{k: doc[k] for k in doc if k in cls.__dataclass_fields__})
        except TypeError as e:
            raise PipeplanError(f"checkpoint {where}: manifest is incomplete ({e})") from e


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    """An empty hidden folder to write step ``step``'s save into (a stale one is removed)."""
    tmp = root / f".{step_name(step)}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(staged: Path, manifest: Manifest) -> Path:
    """Write the manifest into a finished save, give it its final name, point ``latest`` at it."""
    root = staged.parent
    _write_atomic(staged / MANIFEST, json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
    final = root / step_name(manifest.step)
    if final.exists():  # the same step saved again (a resumed run): the new one wins
        shutil.rmtree(final)
    os.rename(staged, final)
    _write_atomic(root / LATEST, final.name + "\n")
    return final


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resolve(path: Path | str, field: str = "resume") -> Path:
    """The checkpoint folder ``path`` names: a step folder itself, or a checkpoint directory
    (its ``latest``, else its highest complete step)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if not path.is_dir():
        raise PipeplanError(f"{field}: no checkpoint at {str(path)!r} (not a directory)")
    latest = path / LATEST
    if latest.is_file():
        named = path / latest.read_text().strip()
        if (named / MANIFEST).is_file():
            return named
    steps = sorted(p for p in path.glob("step-*") if (p / MANIFEST).is_file())
    if not steps:
        raise PipeplanError(f"{field}: {str(path)!r} holds no complete checkpoint")
    return steps[-1]


def read_manifest(path: Path) -> Manifest:
    try:
        doc = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise PipeplanError(f"checkpoint {path.name}: unreadable manifest ({e})") from e
    return Manifest.from_dict(doc, path.name)


def saved_keys(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """Every key of a checkpoint, with its tensor's shape and dtype (None: not a tensor)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out: dict[str, tuple[tuple[int, ...], torch.dtype] | None] = {}
    for key, m in meta.items():
        if isinstance(m, dcp.TensorStorageMetadata):
            out[key] = (tuple(m.size), m.properties.dtype)
        else:
            out[key] = None
    return out


# --- a stage replica's part ------------------------------------------------------------------


def shard_state(
    state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    params: Mapping[str, torch.nn.Parameter],
    rng_key: str,
) -> dict[str, torch.Tensor]:
    """The flat state dict one replica saves (module docstring)."""
    out = {MODEL + n: t.detach() for n, t in state.items()}
    if optimizer is not None:
        for name, p in params.items():
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{OPTIM}{name}/{key}"] = value
    out[RNG + rng_key] = torch.get_rng_state()
    return out


def save_shard(state: dict[str, torch.Tensor], path: Path) -> None:
    """This replica's part of a save (collective: every replica of the run calls it; a
    process outside any process group saves alone)."""
    dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_shard(
    path: Path,
    state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    params: Mapping[str, torch.nn.Parameter],
    rng_key: str | None,
) -> None:
    """Load into this replica's tensors, in place, the entries of the checkpoint it holds
    (collective). Its optimizer state is rebuilt from the entries saved for its parameters;
    ``rng_key``: whose random state to restore (None: keep this replica's)."""
    keys = saved_keys(path)
    missing = [n for n in state if MODEL + n not in keys]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:3])
        raise PipeplanError(
            f"checkpoint {path.name}: has no {shown}{' ...' if len(missing) > 3 else ''} "
            f"({len(missing)} of this stage's {len(state)} entries): another model?"
        )
    want: dict[str, torch.Tensor] = {MODEL + n: t.detach() for n, t in state.items()}
    optim_entries: dict[str, dict[str, torch.Tensor]] = {}
    for key, shape_dtype in keys.items():
        if not key.startswith(OPTIM) or shape_dtype is None:
            continue
        name, _, slot = key[len(OPTIM) :].rpartition("/")
        if name in params:
            shape, dtype = shape_dtype
            device = params[name].device if shape else torch.device("cpu")  # Adam's step: CPU
            tensor = torch.empty(shape, dtype=dtype, device=device)
            optim_entries.setdefault(name, {})[slot] = tensor
            want[key] = tensor
    rng = None
    if rng_key is not None and RNG + rng_key in keys:
        rng = want[RNG + rng_key] = torch.empty_like(torch.get_rng_state())
    dcp.load(want, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if optimizer is not None:
        for name, slots in optim_entries.items():
            optimizer.state[params[name]] = dict(slots)
    if rng is not None:
        torch.set_rng_state(rng)


# --- export ------------------------------------------------------------------------------------


def export_state_dict(path: Path | str, out: Path | str) -> dict[str, torch.Tensor]:
    """Write the model's single-process ``state_dict`` of checkpoint ``path`` (a step folder,
    or a checkpoint directory: its latest) to ``out`` with ``torch.save``; returns it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = resolve(path, "checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "all.pt"
        dcp_to_torch_save(str(folder), str(whole))
        everything = torch.load(whole, weights_only=True)
    model = {k[len(MODEL) :]: v for k, v in everything.items() if k.startswith(MODEL)}
    torch.save(model, out)
    return model
