"""Reward sources behind the planner interface: ``Search.record`` alone writes the best plan,
the count and the history; a planner handed another source is valued by it (its values decide
the answer), observers see every recorded population, and an empty answer says why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeplan.agents import Budget, InfeasibleError, Problem, make_planner
from pipeplan.agents.rewards import Population, Rewards, SimulatedReward, plans_of
from pipeplan.agents.search import Search
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.plan import Plan, Stage
from pipeplan.core.profile import LayerProfile, ModelProfile

ROOT = Path(__file__).resolve().parents[2]


def chain(n: int = 6) -> ModelProfile:
    layers = [
        LayerProfile(
            f"l{i}", "conv", 10_000, 1e9 * (1 + i % 3), 4096, (i + 1,) if i < n - 1 else ()
        )
        for i in range(n)
    ]
    return ModelProfile("chain", (3, 8, 8), tuple(layers))


def problem(evaluations: int | None = None, seed: int = 0) -> Problem:
    cluster = ClusterSpec.load(ROOT / "examples" / "clusters" / "local-hetero.yaml")
    return Problem(
        chain(), cluster, global_batch=8, seed=seed, budget=Budget(evaluations, seconds=None)
    )


class Fake:
    """A source whose values are made up from the plan: fewest devices, then the last
    device ids, wins (far from what the cost model prefers); it books what it saw."""

    name = "fake"

    def __init__(self, errors: tuple[str, ...] = (), infeasible: bool = False) -> None:
        self.seen: list[tuple[Plan, float]] = []
        self.errors, self.infeasible = errors, infeasible

    def value(self, problem: Problem, plan: Plan) -> float:
        ids = problem.cluster.device_ids
        if self.infeasible:
            return float("inf")
        return len(plan.devices) * 100.0 - sum(ids.index(d) for d in plan.devices)

    def evaluate(self, problem: Problem, batch: PlanBatch) -> Rewards:
        plans = plans_of(problem, batch)
        values = [self.value(problem, p) for p in plans]
        self.seen += list(zip(plans, values, strict=True))
        return Rewards(np.array(values), errors=self.errors)


def plan(*stages: tuple[int, int, int]) -> Plan:
    """Stages as (start, end, device index) on local-hetero, microbatch 4."""
    ids = problem().cluster.device_ids
    return Plan(8, tuple(Stage((s, e), (ids[d],), 4) for s, e, d in stages))


def test_record_writes_the_count_the_best_plan_and_the_history() -> None:
    search = Search(problem(), "test", {})
    a, b, c = plan((0, 6, 0)), plan((0, 3, 0), (3, 6, 1)), plan((0, 6, 2))
    search.record([a, b], [3.0, 2.0])
    assert (search.evaluations, search.best_value, search.best_plan) == (2, 2.0, b)
    search.record([c], [np.inf])
    search.record([], np.zeros(0), evaluations=5)  # valued elsewhere: only the count moves
    assert (search.evaluations, search.best_value, search.best_plan) == (8, 2.0, b)
    assert [(h.evaluations, h.best) for h in search.history] == [(2, 2.0), (3, 2.0)]
    with pytest.raises(ValueError, match="values of shape"):
        search.record([a], [1.0, 2.0])


def test_record_takes_a_population_and_tells_the_observers() -> None:
    seen: list[tuple[int, float]] = []
    recorded: list[tuple[Population, np.ndarray]] = []
    p = problem()
    search = Search(p, "test", {}, progress=lambda n, best: seen.append((n, best)))
    search.on_record = lambda plans, values: recorded.append((plans, values))
    batch = PlanBatch.from_plans([plan((0, 6, 0)), plan((0, 6, 3))], p.cluster)
    search.record(batch, [5.0, 4.0])
    assert search.best_plan == plan((0, 6, 3))
    assert seen == [(2, 4.0)]
    assert plans_of(p, recorded[0][0]) == [plan((0, 6, 0)), plan((0, 6, 3))]
    assert recorded[0][1].tolist() == [5.0, 4.0]


def test_search_values_through_its_source() -> None:
    fake = Fake()
    p = problem()
    search = Search(p, "test", {}, reward=fake)
    plans = [plan((0, 6, 0)), plan((0, 3, 0), (3, 6, 1)), plan((0, 6, 3))]
    values = search.evaluate_plans(plans)
    assert values.tolist() == [fake.value(p, q) for q in plans]
    assert search.best_plan == plan((0, 6, 3)) and search.evaluations == 3
    assert len(search.history) == 2  # one population per stage count


@pytest.mark.parametrize(
    ("name", "options"),
    [("uniform", {}), ("balanced", {}), ("dp", {}), ("genetic", {}), ("tapp", {"batch_size": 8})],
)
def test_a_planner_given_a_source_is_answered_by_it(name: str, options: dict[str, int]) -> None:
    fake = Fake()
    result = make_planner(name, reward=fake, **options).plan(problem(evaluations=64))
    assert fake.seen and result.evaluations == len(fake.seen)
    best = min(value for _, value in fake.seen)
    assert result.value == best
    assert result.plan in [q for q, value in fake.seen if value == best]
    assert result.options["reward"] == "fake"
    assert [h.best for h in result.history][-1] == best


def test_the_default_source_is_the_cost_model_and_is_not_named_in_the_options() -> None:
    p = problem(evaluations=64)
    result = make_planner("uniform").plan(p)
    assert "reward" not in result.options
    assert result.value == p.score_estimate(result.estimate)
    assert Search(p, "x", {}).reward.name == SimulatedReward.name == "simulated"


def test_an_empty_answer_quotes_the_sources_reasons() -> None:
    fake = Fake(errors=("stage 0 ran out of memory",), infeasible=True)
    with pytest.raises(InfeasibleError, match="fake reward: stage 0 ran out of memory"):
        make_planner("tapp", reward=fake, batch_size=4).plan(problem(evaluations=8))
    silent = Fake(infeasible=True)
    with pytest.raises(InfeasibleError, match="no feasible plan among 8 evaluated"):
        make_planner("tapp", reward=silent, batch_size=4).plan(problem(evaluations=8))


def test_a_source_answering_the_wrong_length_is_refused() -> None:
    class Short(Fake):
        def evaluate(self, problem: Problem, batch: PlanBatch) -> Rewards:
            return Rewards.of([1.0])

    search = Search(problem(), "test", {}, reward=Short())
    with pytest.raises(ValueError, match="reward source 'fake': values of shape"):
        search.evaluate_plans([plan((0, 6, 0)), plan((0, 6, 1))])
