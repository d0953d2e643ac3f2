"""ParallelReward: the cost model split over Ray tasks of the current cluster gives exactly
the in-process values (and TAPP the same answer); a failing worker's traceback reaches the
driver; without a connected cluster it says what to do instead of starting one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeplan.agents import Budget, Problem, make_planner
from pipeplan.agents.rewards import SimulatedReward
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.plan import Plan, Stage
from pipeplan.executor import runtime
from pipeplan.executor.errors import ExecutorError
from pipeplan.executor.parallel_reward import ParallelReward, _rows, evaluate_chunk

ROOT = Path(__file__).resolve().parents[2]


def problem(seed: int = 0, evaluations: int = 48) -> Problem:
    profile = load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")
    cluster = ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")
    return Problem(
        profile, cluster, global_batch=16, seed=seed, budget=Budget(evaluations, seconds=None)
    )


def population(p: Problem) -> PlanBatch:
    ids, n = p.cluster.device_ids, len(p.profile)
    plans = [
        Plan(16, (Stage((0, cut), (ids[a],), mb), Stage((cut, n), (ids[b], ids[c]), mb)))
        for cut in (3, n // 2, n - 2)
        for a, b, c in ((0, 1, 2), (3, 0, 1), (2, 3, 0))
        for mb in (2, 4, 16)
    ]
    return PlanBatch.from_plans(plans, p.cluster)


def test_a_chunk_is_costed_as_in_process_and_failures_come_back_as_text() -> None:
    p = problem()
    batch = population(p)
    here = SimulatedReward().evaluate(p, batch)
    there, error = evaluate_chunk(p, batch)
    assert error == "" and there is not None
    assert there.values.tolist() == here.values.tolist()
    assert there.memory_ratio is not None and here.memory_ratio is not None
    assert there.memory_ratio.tolist() == here.memory_ratio.tolist()
    assert there.recompute_ratio is not None and here.recompute_ratio is not None
    assert there.recompute_ratio.tolist() == here.recompute_ratio.tolist()
    none, error = evaluate_chunk(p, None)  # type: ignore[arg-type]
    assert none is None and "Traceback" in error


def test_a_chunk_keeps_its_plans_recompute_flags() -> None:
    p = problem()
    batch = population(p)
    flags = np.zeros(batch.microbatch.shape, dtype=bool)
    flags[::2, 1] = True
    chunk = _rows(
        PlanBatch(batch.bounds, batch.microbatch, batch.devices, flags), np.arange(0, 27, 3)
    )
    assert chunk.recompute is not None and chunk.recompute.tolist() == flags[::3].tolist()
    there, _ = evaluate_chunk(p, chunk)
    assert there is not None
    assert there.values.tolist() == SimulatedReward().evaluate(p, chunk).values.tolist()


def test_bad_workers_are_refused() -> None:
    with pytest.raises(PipeplanError, match="workers must be an integer >= 1, got 0"):
        ParallelReward(0)


def test_without_a_connected_cluster_it_says_what_to_do() -> None:
    assert not runtime.is_connected(), "Ray is connected: a test before this one left it so"
    p = problem()
    with pytest.raises(ExecutorError, match="not connected to a Ray cluster"):
        ParallelReward(2).evaluate(p, population(p))


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_two_workers_give_the_in_process_values_and_tapp_answer(ray_local: object) -> None:
    p = problem(seed=2)
    batch = population(p)
    local_run = make_planner("tapp", batch_size=8).plan(p)
    source = ParallelReward(2)
    values = source.evaluate(p, batch).values
    ray_run = make_planner("tapp", reward=source, batch_size=8).plan(p)
    assert np.array_equal(values, SimulatedReward().evaluate(p, batch).values)
    assert ray_run.plan == local_run.plan and ray_run.value == local_run.value
    assert ray_run.evaluations == local_run.evaluations
    assert ray_run.options["reward"] == "parallel" and "reward" not in local_run.options
