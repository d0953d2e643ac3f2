"""TAPP: the REINFORCE maths on a hand-computed case, valid samples, seeds, a tiny run that
learns, pretrained policies, and (marked) Ray workers."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents import Budget, Problem, ProblemError, make_planner
from agents.search import Search
from agents.tapp import TAPPConfig, TAPPPlanner, TAPPPolicy, make_context, train_policy
from agents.tapp.nets import sample_plans
from agents.tapp.parallel import evaluate_chunk, record
from agents.tapp.rewards import SimulatedReward, shape_rewards
from agents.tapp.trainer import advantages, reinforce_loss
from core.cluster import ClusterSpec
from core.formats.pipedream import load_pipedream
from core.plan import Schedule
from core.profile import ModelProfile
from tests.core.strategies import clusters, divisors, profiles

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


@cache
def alexnet() -> ModelProfile:
    return load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")


@cache
def local() -> ClusterSpec:
    return ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")


def problem(seed: int = 0, evaluations: int = 200, **kw: object) -> Problem:
    return Problem(
        alexnet(), local(), global_batch=16, seed=seed,
        budget=Budget(evaluations=evaluations, seconds=60), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


# --- the REINFORCE maths --------------------------------------------------------------------


def test_reinforce_loss_and_gradient_match_the_hand_computation() -> None:
    # a 2-action softmax policy, pi = (1/4, 3/4); three samples with known rewards
    theta = torch.tensor([0.0, math.log(3.0)], requires_grad=True)
    actions = torch.tensor([0, 1, 1])
    adv = advantages(np.array([1.0, 0.0, 2.0]), baseline=0.5, normalize=False)
    assert adv.tolist() == [0.5, -0.5, 1.5]
    log_pi = torch.log_softmax(theta, 0)
    entropy = -(log_pi.exp() * log_pi).sum().expand(3)
    loss = reinforce_loss(log_pi[actions], torch.tensor(adv), entropy, coef=0.1)
    loss.backward()  # type: ignore[no-untyped-call]

    l0, l1 = math.log(0.25), math.log(0.75)
    h = -(0.25 * l0 + 0.75 * l1)
    assert loss.item() == pytest.approx(-(0.5 * l0 - 0.5 * l1 + 1.5 * l1) / 3 - 0.1 * h)
    # d log pi_a / d theta = onehot(a) - pi, so sum_k A_k (e_ak - pi) =
    # 0.5 (0.75, -0.75) - 0.5 (-0.25, 0.25) + 1.5 (-0.25, 0.25) = (0.125, -0.125)
    policy_grad = -np.array([0.125, -0.125]) / 3
    # dH / d theta_i = -pi_i (log pi_i + H)
    entropy_grad = -0.1 * np.array([-0.25 * (l0 + h), -0.75 * (l1 + h)])
    assert theta.grad is not None
    assert theta.grad.numpy() == pytest.approx(policy_grad + entropy_grad, abs=1e-7)


def test_advantages_are_normalised_by_the_reward_spread() -> None:
    rewards = np.array([1.0, 0.0, 2.0])
    adv = advantages(rewards, baseline=0.5, normalize=True)
    assert adv == pytest.approx((rewards - 0.5) / math.sqrt(2 / 3))
    flat = advantages(np.array([1.0, 1.0]), baseline=0.25, normalize=True)
    assert flat.tolist() == [0.75, 0.75]  # no spread: left unscaled


def test_rewards_are_log_ratios_and_infeasible_plans_sit_below_the_worst() -> None:
    r = shape_rewards(np.array([2.0, 1.0, 4.0, np.inf]), 2.0, 4.0, infeasible_penalty=1.0)
    assert r == pytest.approx([0.0, math.log(2), math.log(0.5), math.log(0.5) - 1.0])


# --- sampling -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=profiles(min_layers=1, max_layers=10),
    cluster=clusters(),
    schedule=st.sampled_from(list(Schedule)),
    seed=st.integers(0, 1000),
    greedy=st.booleans(),
)
def test_sampled_plans_are_valid(
    profile: ModelProfile, cluster: ClusterSpec, schedule: Schedule, seed: int, greedy: bool
) -> None:
    ctx = make_context(profile, cluster, 8, divisors(8), schedule)
    policy = TAPPPolicy(hidden=8, attention_dim=4)
    sample = sample_plans(policy, ctx, 6, torch.Generator().manual_seed(seed), greedy)
    assert torch.isfinite(sample.log_prob).all() and torch.isfinite(sample.entropy).all()
    for i in range(sample.n):
        plan = sample.plan(i, ctx)  # Plan checks contiguity and no device twice
        plan.validate(profile, cluster)
        assert plan.num_stages <= min(len(cluster.device_ids), len(profile))


def test_log_prob_of_a_greedy_plan_is_the_largest_in_a_batch() -> None:
    ctx = make_context(alexnet(), local(), 16, [4], Schedule.GPIPE)
    torch.manual_seed(0)
    policy = TAPPPolicy()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        best = sample_plans(policy, ctx, 1, gen, greedy=True).log_prob.item()
        batch = sample_plans(policy, ctx, 64, gen).log_prob
    assert best >= batch.max().item() - 1e-5


# --- the planner ----------------------------------------------------------------------------


def test_tiny_budget_run_improves_on_its_first_sample() -> None:
    result = make_planner("tapp", batch_size=16).plan(problem(seed=0, evaluations=300))
    assert result.evaluations <= 300
    assert result.value < result.history[0].best
    assert result.plan.num_stages >= 2


def test_same_seed_same_plan_and_history() -> None:
    a = make_planner("tapp", batch_size=8).plan(problem(seed=3, evaluations=80))
    b = make_planner("tapp", batch_size=8).plan(problem(seed=3, evaluations=80))
    assert a.plan == b.plan and a.value == b.value
    assert [(h.evaluations, h.best) for h in a.history] == [
        (h.evaluations, h.best) for h in b.history
    ]


def test_bad_options_are_refused_before_any_search() -> None:
    with pytest.raises(ProblemError, match="known options"):
        make_planner("tapp", learning_rat=0.1)
    with pytest.raises(ProblemError, match="batch_size"):
        make_planner("tapp", batch_size=0)


def test_cost_objective_plans_meet_the_throughput_target() -> None:
    p = problem(seed=1, evaluations=150, objective="cost", min_throughput=2.0)
    result = make_planner("tapp", batch_size=16).plan(p)
    assert result.estimate.throughput >= 2.0 and result.estimate.fits


# --- one policy, many models ----------------------------------------------------------------


def test_pretrained_policy_plans_an_unseen_model_and_round_trips(tmp_path: Path) -> None:
    resnet = load_pipedream(ROOT / "tests/data/pipedream/resnet18.graph.txt", 256, "v100")
    config = TAPPConfig(batch_size=8)
    policy = train_policy([alexnet()], local(), global_batch=16, config=config, iterations=4)
    before = [p.detach().clone() for p in policy.parameters()]
    unseen = Problem(resnet, local(), global_batch=16, budget=Budget(evaluations=40))
    frozen = TAPPPlanner(policy=policy, frozen=True, batch_size=8).plan(unseen)
    tuned = TAPPPlanner(policy=policy, batch_size=8).plan(unseen)
    assert frozen.evaluations <= 40 and tuned.evaluations <= 40
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))

    path = tmp_path / "tapp.pt"
    policy.save(path)
    again = TAPPPlanner(pretrained=str(path), frozen=True, batch_size=8).plan(unseen)
    assert again.plan == frozen.plan and again.value == frozen.value


# --- Ray workers ----------------------------------------------------------------------------


def test_worker_chunk_matches_the_search_and_reports_failures() -> None:
    p = problem()
    search = Search(p, "tapp", {})
    ctx = make_context(p.profile, p.cluster, 16, p.microbatch_sizes(), p.schedule)
    sample = sample_plans(TAPPPolicy(), ctx, 12, torch.Generator().manual_seed(1))
    plans = [sample.plan(i, ctx) for i in range(sample.n)]
    here = SimulatedReward(search).evaluate(plans)
    values, error = evaluate_chunk(p, plans)
    assert error == "" and values is not None and values.tolist() == here.tolist()
    other = Search(p, "tapp", {})
    record(other, plans, values)
    assert (other.evaluations, other.best_value) == (search.evaluations, search.best_value)
    none, error = evaluate_chunk(p, [None])  # type: ignore[list-item]
    assert none is None and "Traceback" in error


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_two_ray_workers_give_the_in_process_result() -> None:
    local_run = make_planner("tapp", batch_size=8).plan(problem(seed=2, evaluations=48))
    ray_run = make_planner("tapp", batch_size=8, workers=2).plan(problem(seed=2, evaluations=48))
    assert ray_run.plan == local_run.plan and ray_run.evaluations == local_run.evaluations
