"""Checkpoints of a learned search (TAPP, PPO): where they go, when, and whether one fits.

A search that checkpoints writes, every ``checkpoint_every`` iterations, one current
checkpoint into its ``checkpoint_dir``; a later run given the same folder (or ``resume``
naming one) continues from it: the evaluations, the iteration count and the history go on
where they stopped. Every file is written atomically (:func:`write_atomic`: a temporary
file in the same folder, then a rename), so a search killed while it writes leaves the
previous checkpoint whole.

A checkpoint records the **fingerprint** of its search (:func:`fingerprint`): the planner,
the problem (the model's structure, the cluster's devices, objective, batch, schedule,
seed) and the options that shape the search. Resuming under another fingerprint is refused,
naming what differs; the budget, the iteration cap and the checkpoint options themselves may
change (a search is resumed to spend more of them).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from pipeplan.agents.problem import Problem, ProblemError

CHECKPOINT_OPTIONS = ("checkpoint_dir", "checkpoint_every", "resume")
"""The options every checkpointing planner takes."""
FREE_OPTIONS = frozenset({*CHECKPOINT_OPTIONS, "iterations", "patience", "pretrained", "threads"})
"""Options a resumed search may change: how long it runs, where it checkpoints, where the
policy first came from (it is in the checkpoint now) and how many threads it uses."""
CHECKPOINT_FILES = {"tapp": "search.pt", "ppo": "search.json"}
"""The file of a checkpoint folder that holds the current checkpoint, by planner (its
presence is what makes a folder resumable)."""
DEFAULT_CHECKPOINT_EVERY = 10
"""Iterations between two checkpoints when ``checkpoint_dir`` is set and the interval not."""


def check_checkpoint_options(
    planner: str, checkpoint_dir: str | None, checkpoint_every: int | None, resume: str | None
) -> None:
    """``checkpoint_every`` >= 1 and only with a folder; ``resume`` a folder that holds a
    checkpoint file is checked when the search starts (:func:`resume_folder`)."""
    for name, value in (("checkpoint_dir", checkpoint_dir), ("resume", resume)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ProblemError(f"{planner}.{name}: must be a folder path, got {value!r}")
    if checkpoint_every is not None:
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
            raise ProblemError(
                f"{planner}.checkpoint_every: must be an integer, got {checkpoint_every!r}"
            )
        if checkpoint_every < 1:
            raise ProblemError(f"{planner}.checkpoint_every: must be >= 1, got {checkpoint_every}")
        if checkpoint_dir is None:
            raise ProblemError(
                f"{planner}.checkpoint_every: {checkpoint_every} needs checkpoint_dir (where "
                "the checkpoints go)"
            )


def every(checkpoint_dir: str | None, checkpoint_every: int | None) -> int | None:
    """Iterations between checkpoints (None: the search does not checkpoint)."""
    if checkpoint_dir is None:
        return None
    return checkpoint_every or DEFAULT_CHECKPOINT_EVERY


def resume_folder(
    planner: str, checkpoint_dir: str | None, resume: str | None, name: str
) -> Path | None:
    """The folder whose checkpoint file ``name`` the search continues from: ``resume``
    (which must hold one), else ``checkpoint_dir`` when it holds one (a search started
    again in its own folder goes on), else None: a fresh start."""
    if resume is not None:
        folder = Path(resume)
        if not (folder / name).is_file():
            raise ProblemError(f"{planner}.resume: no checkpoint in {resume} (no {name} there)")
        return folder
    if checkpoint_dir is not None and (Path(checkpoint_dir) / name).is_file():
        return Path(checkpoint_dir)
    return None


def fingerprint(problem: Problem, planner: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """What makes two searches one (module docstring), as a JSON object."""
    p = problem
    shaping = {k: v for k, v in options.items() if k not in FREE_OPTIONS}
    return {
        "planner": planner,
        "model": p.profile.model_key,
        "cluster": p.cluster.name,
        "devices": list(p.cluster.device_ids),
        "objective": p.objective.value,
        "global_batch": p.global_batch,
        "schedule": p.schedule.value,
        "microbatches": p.microbatches,
        "min_throughput": p.min_throughput,
        "seed": p.seed,
        "options": json.loads(json.dumps(shaping, sort_keys=True, default=str)),
    }


def check_fingerprint(
    planner: str, folder: Path, stored: Mapping[str, Any], expected: Mapping[str, Any]
) -> None:
    """Refuse a checkpoint of another search, naming the fields that differ."""
    differ = sorted(k for k in {*stored, *expected} if stored.get(k) != expected.get(k))
    if differ:
        shown = "; ".join(f"{k}: {stored.get(k)!r} there, {expected.get(k)!r} here" for k in differ)
        raise ProblemError(
            f"{planner}.resume: the checkpoint in {folder} is of another search ({shown})"
        )


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through ``write`` into a temporary file beside it, flushed to disk,
    then renamed over it: a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, doc: Any) -> None:
    """:func:`write_atomic` of a JSON document."""
    text = json.dumps(doc, indent=1, sort_keys=True).encode()
    write_atomic(path, lambda f: f.write(text))


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object at ``path``; :class:`ProblemError` naming ``what`` if it is not one."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProblemError(f"{what}: cannot read {path}: {e}") from None
    if not isinstance(doc, dict):
        raise ProblemError(f"{what}: {path} does not hold a JSON object")
    return doc
