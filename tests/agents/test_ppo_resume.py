"""PPO's search checkpoints: a search resumed from its folder continues its iteration count,
its evaluations and history, and keeps its best plan (RLlib's checkpoint of the algorithm
beside the search's state); options and folders that cannot resume are refused. Small
budgets, one env runner, one Ray for the module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeplan.agents import Budget, Problem, ProblemError, make_planner
from pipeplan.agents.rllib_ppo import ALGORITHM_PREFIX, SEARCH_STATE, PPOOptions
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.profile import LayerProfile, ModelProfile

ROOT = Path(__file__).resolve().parents[2]
SMALL: dict[str, Any] = {
    "num_env_runners": 1,
    "train_batch": 60,
    "minibatch": 30,
    "epochs": 1,
    "restart_after": None,
}


def chain(n: int = 6) -> ModelProfile:
    layers = [
        LayerProfile(
            f"l{i}", "conv", 10_000, 1e9 * (1 + i % 3), 4096, (i + 1,) if i < n - 1 else ()
        )
        for i in range(n)
    ]
    return ModelProfile("chain", (3, 8, 8), tuple(layers))


def problem() -> Problem:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    return Problem(chain(), cluster, global_batch=8, seed=3, budget=Budget(None, None))


def state(folder: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((folder / SEARCH_STATE).read_text())
    return doc


@pytest.mark.rllib
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resumed_search_continues_its_count_and_keeps_its_best_plan(
    ray_local: None, tmp_path: Path
) -> None:
    folder = tmp_path / "search"
    first = make_planner(
        "ppo", iterations=2, checkpoint_dir=str(folder), checkpoint_every=1, **SMALL
    ).plan(problem())
    saved = state(folder)
    assert saved["iteration"] == 2 and saved["search"]["evaluations"] == first.evaluations
    algorithms = sorted(p.name for p in folder.glob(f"{ALGORITHM_PREFIX}*"))
    assert algorithms == [saved["algorithm"]]  # the older one is gone

    resumed = make_planner(
        "ppo", iterations=3, checkpoint_dir=str(folder), checkpoint_every=1, **SMALL
    ).plan(problem())
    again = state(folder)
    assert again["iteration"] == 3  # one more iteration, not three
    assert resumed.options["resumed_from"] == str(folder)
    assert resumed.evaluations > first.evaluations
    assert [(h.evaluations, h.best) for h in resumed.history][: len(first.history)] == [
        (h.evaluations, h.best) for h in first.history
    ]
    assert resumed.value <= first.value  # the best plan is kept

    done = make_planner("ppo", iterations=3, resume=str(folder), **SMALL).plan(problem())
    assert done.evaluations == resumed.evaluations  # nothing left to do: no iteration ran
    assert done.plan == resumed.plan


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"checkpoint_every": 0, "checkpoint_dir": "x"}, r"ppo\.checkpoint_every: must be >= 1"),
        ({"checkpoint_every": 2}, r"ppo\.checkpoint_every: 2 needs checkpoint_dir"),
        ({"resume": "a", "restore": "b"}, r"ppo\.resume: 'a' goes on with a search"),
    ],
)
def test_bad_checkpoint_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ProblemError, match=message):
        PPOOptions(**options)
