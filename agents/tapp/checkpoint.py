"""TAPP's checkpoints: everything its REINFORCE loop holds, in one file, and the trained
policy beside it.

A checkpoint folder holds two files, each written atomically (:func:`agents.resume.
write_atomic`):

- :data:`CHECKPOINT` (``search.pt``, ``torch.save`` of plain types and tensors, read back
  with ``weights_only=True``): the policy and its Adam state, the initial weights a restart
  goes back to, the iteration count and the patience and restart counters, the state of both
  random generators (torch's sampling generator, numpy's task chooser), each task's learner
  book-keeping (plans seen and their values, reference, worst, baseline, best, elite) and its
  :class:`~agents.search.Search` (evaluations, best plan, history), and the search's
  fingerprint (:func:`agents.resume.fingerprint`);
- :data:`POLICY` (``policy.pt``): the policy alone, in :meth:`TAPPPolicy.save`'s format, for
  ``pretrained=`` / ``pipeplan plan --policy``.

Restored, a search samples, evaluates and updates exactly as the run that wrote the
checkpoint would have gone on (same seed, CPU): a search cut and resumed ends with the plan,
value and history of one never cut.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeplan.agents.problem import ProblemError
from pipeplan.agents.resume import CHECKPOINT_FILES, check_fingerprint, write_atomic
from pipeplan.agents.tapp.nets import TAPPPolicy
from pipeplan.agents.tapp.sampling import Sample
from pipeplan.core.plan import Plan

CHECKPOINT = CHECKPOINT_FILES["tapp"]
POLICY = "policy.pt"
FORMAT = "pipeplan/tapp-search"
VERSION = 1


@dataclass
class LoopState:
    """The loop's counters (:func:`agents.tapp.trainer.train`): iterations done, iterations
    since a better plan (patience), since a better plan or a restart (restarts)."""

    iteration: int = 0
    stale: int = 0
    fresh: int = 0


@dataclass(frozen=True)
class Checkpointer:
    """Where and how often a search checkpoints, and the fingerprint its files carry."""

    folder: Path
    every: int
    fingerprint: dict[str, Any]

    def due(self, iteration: int) -> bool:
        return iteration % self.every == 0


def sample_state(sample: Sample) -> dict[str, torch.Tensor]:
    return {
        "size_index": torch.from_numpy(sample.size_index.copy()),
        "opens": torch.from_numpy(sample.opens.copy()),
        "devices": torch.from_numpy(sample.devices.copy()),
        "replica_of": torch.from_numpy(sample.replica_of.copy()),
        "stage_size": torch.from_numpy(sample.stage_size.copy()),
        "log_prob": sample.log_prob.detach().clone(),
        "entropy": sample.entropy.detach().clone(),
    }


def load_sample(state: dict[str, torch.Tensor]) -> Sample:
    return Sample(
        state["size_index"].numpy(),
        state["opens"].numpy(),
        state["devices"].numpy(),
        state["replica_of"].numpy(),
        state["stage_size"].numpy(),
        state["log_prob"],
        state["entropy"],
    )


def _number(x: float | None) -> float | None:
    return None if x is None else float(x)


def task_state(task: Any) -> dict[str, Any]:
    """A :class:`~agents.tapp.trainer.Task`'s learner book-keeping and its search."""
    return {
        "cache": {k.hex(): v for k, v in task.cache.items()},
        "reference": task.reference,
        "worst": task.worst,
        "baseline": task.baseline,
        "best_value": task.best_value,
        "best_plan": None if task.best_plan is None else task.best_plan.to_dict(),
        "elite": [[k.hex(), v, sample_state(s)] for k, (v, s) in task.elite.items()],
        "search": task.search.state_dict(),
    }


def load_task(task: Any, state: dict[str, Any]) -> None:
    """Put :func:`task_state`'s ``state`` back into ``task`` (its context and search are
    the resumed run's own, for the same problem)."""
    task.cache = {bytes.fromhex(k): float(v) for k, v in state["cache"].items()}
    task.reference = _number(state["reference"])
    task.worst = _number(state["worst"])
    task.baseline = _number(state["baseline"])
    task.best_value = float(state["best_value"])
    plan = state["best_plan"]
    task.best_plan = None if plan is None else Plan.from_dict(plan)
    task.elite = {bytes.fromhex(k): (float(v), load_sample(s)) for k, v, s in state["elite"]}
    task.search.load_state_dict(state["search"])


def save(
    ckpt: Checkpointer,
    loop: LoopState,
    policy: TAPPPolicy,
    initial: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    rng: np.random.Generator,
    tasks: list[Any],
) -> Path:
    """Write the checkpoint, then the policy beside it; the checkpoint's path."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": ckpt.fingerprint,
        "saved_at": time.time(),
        "loop": {"iteration": loop.iteration, "stale": loop.stale, "fresh": loop.fresh},
        "policy": {
            "hidden": policy.hidden,
            "attention_dim": policy.attention_dim,
            "state": policy.state_dict(),
        },
        "initial": initial,
        "optimizer": optimizer.state_dict(),
        "generator": generator.get_state(),
        "rng": rng.bit_generator.state,
        "tasks": [task_state(t) for t in tasks],
    }
    path = ckpt.folder / CHECKPOINT
    write_atomic(path, lambda f: torch.save(doc, f))
    write_atomic(ckpt.folder / POLICY, lambda f: policy.save(f))
    return path


def load(folder: Path, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint in ``folder``, checked to be TAPP's and of this search."""
    path = folder / CHECKPOINT
    try:
        doc = torch.load(path, weights_only=True)
    except Exception as e:  # torch raises several kinds for a file that is not its own
        raise ProblemError(f"tapp.resume: {path}: not a TAPP checkpoint ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProblemError(f"tapp.resume: {path}: not a TAPP checkpoint")
    if doc.get("version") != VERSION:
        raise ProblemError(
            f"tapp.resume: {path}: checkpoint version {doc.get('version')!r}, this pipeplan "
            f"reads {VERSION}"
        )
    check_fingerprint("tapp", folder, doc["fingerprint"], fingerprint)
    return doc


def restore(
    doc: dict[str, Any],
    policy: TAPPPolicy,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    rng: np.random.Generator,
    tasks: list[Any],
) -> tuple[LoopState, dict[str, torch.Tensor]]:
    """Load ``doc`` (:func:`load`) into the loop's objects; its counters and the initial
    weights a restart goes back to."""
    if len(doc["tasks"]) != len(tasks):
        raise ProblemError(
            f"tapp.resume: the checkpoint holds {len(doc['tasks'])} tasks, this search has "
            f"{len(tasks)}"
        )
    saved = doc["policy"]
    if (saved["hidden"], saved["attention_dim"]) != (policy.hidden, policy.attention_dim):
        raise ProblemError(
            f"tapp.resume: the checkpoint's policy is {saved['hidden']} wide with attention "
            f"{saved['attention_dim']}, this search's {policy.hidden} and {policy.attention_dim}"
        )
    policy.load_state_dict(saved["state"])
    optimizer.load_state_dict(doc["optimizer"])
    generator.set_state(doc["generator"])
    rng.bit_generator.state = doc["rng"]
    for task, state in zip(tasks, doc["tasks"], strict=True):
        load_task(task, state)
    loop = doc["loop"]
    return LoopState(int(loop["iteration"]), int(loop["stale"]), int(loop["fresh"])), doc["initial"]
