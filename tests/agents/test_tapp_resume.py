"""TAPP's checkpoints: a search cut and resumed ends as one never cut (plan, value, history),
a finished search given more budget goes on, the files are written whole, and a checkpoint
of another search, a missing one or bad options are refused naming the field. No Ray."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import IO

import pytest
import torch

from pipeplan.agents import Budget, Problem, ProblemError, make_planner
from pipeplan.agents.problem import PlanResult
from pipeplan.agents.resume import write_atomic
from pipeplan.agents.tapp import IterationLog, TAPPConfig, TAPPPolicy
from pipeplan.agents.tapp.checkpoint import CHECKPOINT, POLICY
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.profile import ModelProfile

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)
OPTIONS = {"batch_size": 8, "restart_after": 3, "greedy_every": 4}
"""Small batches, restarts and greedy plans within a few iterations: the cut lands between
restarts and greedy evaluations, whose state the checkpoint must carry."""


class Cut(Exception):
    """Stands in for a driver killed mid-search."""


@cache
def alexnet() -> ModelProfile:
    return load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")


@cache
def local() -> ClusterSpec:
    return ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")


def problem(seed: int = 5, evaluations: int = 200) -> Problem:
    return Problem(
        alexnet(), local(), global_batch=16, seed=seed,
        budget=Budget(evaluations=evaluations, seconds=120),
    )  # fmt: skip


def history(result: PlanResult) -> list[tuple[int, float]]:
    return [(h.evaluations, h.best) for h in result.history]


def cut_after(iterations: int) -> object:
    def on_iteration(log: IterationLog) -> None:
        if log.iteration >= iterations:
            raise Cut(f"killed after iteration {log.iteration}")

    return on_iteration


def test_a_search_cut_and_resumed_ends_as_one_never_cut(tmp_path: Path) -> None:
    whole = make_planner("tapp", **OPTIONS).plan(problem(evaluations=80))
    folder = str(tmp_path / "ckpt")
    with pytest.raises(Cut):  # checkpoints after iterations 2 and 4; 5 is lost
        make_planner(
            "tapp", on_iteration=cut_after(5), checkpoint_dir=folder, checkpoint_every=2,
            **OPTIONS,
        ).plan(problem(evaluations=80))  # fmt: skip
    saved = torch.load(Path(folder) / CHECKPOINT, weights_only=True)
    assert saved["loop"]["iteration"] == 4
    cut_at = saved["tasks"][0]["search"]["evaluations"]
    assert 0 < cut_at < whole.evaluations

    iterations: list[int] = []
    resumed = make_planner(
        "tapp", on_iteration=lambda log: iterations.append(log.iteration),
        checkpoint_dir=folder, checkpoint_every=2, **OPTIONS,
    ).plan(problem(evaluations=80))  # fmt: skip
    assert iterations[0] == 5  # the iteration count goes on
    assert resumed.plan == whole.plan and resumed.value == whole.value
    assert resumed.evaluations == whole.evaluations
    assert history(resumed) == history(whole)
    assert resumed.options["resumed_from"] == folder


def test_a_finished_search_given_more_budget_goes_on(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    first = make_planner("tapp", checkpoint_dir=folder, **OPTIONS).plan(problem(evaluations=80))
    more = make_planner("tapp", resume=folder, **OPTIONS).plan(problem(evaluations=160))
    assert first.evaluations <= 80 < more.evaluations <= 160
    assert history(more)[: len(first.history)] == history(first)
    assert more.value <= first.value
    assert more.options["resumed_from"] == folder


def test_the_folder_holds_the_checkpoint_and_a_policy_to_start_from(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    make_planner("tapp", checkpoint_dir=str(folder), **OPTIONS).plan(problem(evaluations=64))
    assert sorted(p.name for p in folder.iterdir()) == [POLICY, CHECKPOINT]
    policy = TAPPPolicy.load(folder / POLICY)
    saved = torch.load(folder / CHECKPOINT, weights_only=True)
    for name, tensor in policy.state_dict().items():
        assert torch.equal(tensor, saved["policy"]["state"][name]), name
    warm = make_planner("tapp", pretrained=str(folder / POLICY), frozen=True, **OPTIONS)
    assert warm.plan(problem(evaluations=16)).evaluations <= 16


def test_an_atomic_write_cut_short_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    write_atomic(path, lambda f: f.write(b"old"))

    def half(f: IO[bytes]) -> None:
        f.write(b"ne")
        raise Cut("killed while writing")

    with pytest.raises(Cut):
        write_atomic(path, half)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.bin"]


def test_a_checkpoint_of_another_search_is_refused_naming_what_differs(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    make_planner("tapp", checkpoint_dir=folder, **OPTIONS).plan(problem(evaluations=32))
    with pytest.raises(ProblemError, match=r"tapp\.resume: .* another search \(seed: 5 there"):
        make_planner("tapp", resume=folder, **OPTIONS).plan(problem(seed=6, evaluations=64))
    other = {**OPTIONS, "batch_size": 16}
    with pytest.raises(ProblemError, match=r"another search \(options: .*batch_size"):
        make_planner("tapp", resume=folder, **other).plan(problem(evaluations=64))


def test_resume_without_a_checkpoint_and_bad_options_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ProblemError, match=rf"tapp\.resume: no checkpoint in {empty}"):
        make_planner("tapp", resume=str(empty)).plan(problem(evaluations=16))
    with pytest.raises(ProblemError, match=r"tapp\.checkpoint_every: must be >= 1, got 0"):
        make_planner("tapp", checkpoint_dir=str(empty), checkpoint_every=0)
    with pytest.raises(ProblemError, match=r"tapp\.checkpoint_every: 5 needs checkpoint_dir"):
        make_planner("tapp", checkpoint_every=5)
    with pytest.raises(ProblemError, match=r"tapp\.checkpoint_dir: must be a folder path"):
        make_planner("tapp", checkpoint_dir="")
    # a fresh folder (no checkpoint yet) is a fresh start, not an error
    fresh = make_planner("tapp", checkpoint_dir=str(tmp_path / "new"), **OPTIONS)
    assert "resumed_from" not in fresh.plan(problem(evaluations=16)).options


def test_a_pretrained_file_that_is_missing_or_no_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ProblemError, match=r"tapp\.pretrained: no policy file at"):
        TAPPConfig(pretrained=str(tmp_path / "absent.pt"))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a policy")
    with pytest.raises(ProblemError, match=r"tapp\.pretrained: .*junk\.pt is not a TAPP policy"):
        TAPPConfig(pretrained=str(junk))
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(ProblemError, match=r"is not a TAPP policy"):
        TAPPConfig(pretrained=str(other))
