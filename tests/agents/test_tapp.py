"""TAPP: the REINFORCE maths on a hand-computed case, valid samples (with replicated stages),
replayed decisions, the elite, seeds, tiny runs that learn (one whose optimum needs a
replicated stage), pretrained policies, and a planner valued by another reward source."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.agents import Budget, Problem, ProblemError, make_planner
from pipeplan.agents.search import Search
from pipeplan.agents.tapp import (
    IterationLog,
    TAPPConfig,
    TAPPPlanner,
    TAPPPolicy,
    make_context,
    train_policy,
)
from pipeplan.agents.tapp.features import cut_cost, group_tables, stage_size_inputs
from pipeplan.agents.tapp.sampling import KEEP_SHARED, Sample, _score_partition, sample_plans
from pipeplan.agents.tapp.trainer import (
    Task,
    advantages,
    reinforce_loss,
    restart,
    shape_rewards,
    update_elite,
)
from pipeplan.core.cluster import ClusterSpec, DeviceType, Link, Network, Node
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from tests.core.strategies import clusters, divisors, profiles

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


@cache
def alexnet() -> ModelProfile:
    return load_pipedream(ROOT / "tests/data/pipedream/alexnet.graph.txt", 256, "v100")


@cache
def local() -> ClusterSpec:
    return ClusterSpec.load(ROOT / "examples/clusters/local-hetero.yaml")


def tiny_replicated() -> tuple[ModelProfile, ClusterSpec]:
    """A heavy first layer and a lighter one after it; one fast and three slow devices on
    one node: the optimum runs the second layer on the three slow devices as one replicated
    stage (one slow device alone, or the fast one, would be the bottleneck; a single layer
    cannot be pipelined instead)."""
    layers = tuple(
        LayerProfile(
            f"l{i}",
            "conv",
            1000,
            1e9,
            1000,
            (i + 1,) if i < 1 else (),
            {"fast": LayerTiming(f, 2 * f), "slow": LayerTiming(3 * f, 6 * f)},
        )  # fmt: skip
        for i, f in enumerate([4e-3, 3e-3])
    )
    types = {"fast": DeviceType("fast", 1e12, 16), "slow": DeviceType("slow", 3e11, 16)}
    cluster = ClusterSpec(
        "tiny", types, (Node("n0", {"fast": 1, "slow": 3}),), Network(Link(100.0, 5.0))
    )
    return ModelProfile("tiny", (1,), layers), cluster


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
    temperature=st.sampled_from([0.5, 1.0, 4.0]),
    unequal=st.booleans(),
)
def test_sampled_plans_are_valid(
    profile: ModelProfile,
    cluster: ClusterSpec,
    schedule: Schedule,
    seed: int,
    greedy: bool,
    temperature: float,
    unequal: bool,
) -> None:
    ctx = make_context(profile, cluster, 8, divisors(8), schedule, unequal=unequal)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = TAPPPolicy(hidden=8, attention_dim=4)
    gen = torch.Generator().manual_seed(seed)
    sample = sample_plans(policy, ctx, 6, gen, greedy, temperature)
    assert torch.isfinite(sample.log_prob).all() and torch.isfinite(sample.entropy).all()
    for i in range(sample.n):
        plan = sample.plan(i, ctx)  # Plan checks contiguity and no device twice
        plan.validate(profile, cluster)
        assert plan.num_stages <= min(len(cluster.device_ids), len(profile))
        served = [d for st in plan.stages for d in st.devices]
        assert len(served) == len(set(served))
        joined = sample.replica_of[i][sample.replica_of[i] >= 0]
        assert (joined < plan.num_stages).all()  # replicas join open groups only
        assert sum(st.replicas - 1 for st in plan.stages) == joined.size
        sizes = [ctx.sizes[k] for k in sample.stage_size[i][: plan.num_stages]]
        assert [st.microbatch for st in plan.stages] == sizes
        assert (sample.stage_size[i][plan.num_stages :] == -1).all()
        if not unequal:
            assert set(sizes) == {ctx.sizes[int(sample.size_index[i])]}


def test_each_stage_samples_its_own_microbatch_and_a_fresh_policy_keeps_the_shared_one() -> None:
    ctx = make_context(alexnet(), local(), 16, divisors(16), Schedule.GPIPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = TAPPPolicy()
    with torch.no_grad():
        sample = sample_plans(policy, ctx, 512, torch.Generator().manual_seed(0))
    stages = sample.stage_size >= 0
    kept = (sample.stage_size == sample.size_index[:, None])[stages].mean()
    assert abs(kept - KEEP_SHARED) < 0.05  # the shared size's prior at a uniform start
    plans = [sample.plan(i, ctx) for i in range(sample.n)]
    assert any(len({st.microbatch for st in p.stages}) > 1 for p in plans)
    equal = make_context(alexnet(), local(), 16, divisors(16), Schedule.GPIPE, unequal=False)
    with torch.no_grad():
        same = sample_plans(policy, equal, 64, torch.Generator().manual_seed(0))
    assert all(len({st.microbatch for st in same.plan(i, equal).stages}) == 1 for i in range(64))


def test_stage_size_inputs_price_the_busy_time_of_each_size() -> None:
    """A stage's busy time at ``b``: ``B / b`` microbatches of ``fixed + b x per-sample``
    plus rule 2b's accumulation; the feature is its log over the stage's least busy size."""
    ctx = make_context(alexnet(), local(), 16, divisors(16), Schedule.GPIPE)
    opens = torch.zeros(1, ctx.n_layers, dtype=torch.bool)
    opens[0, 0] = True
    b = torch.tensor([4.0], dtype=torch.float64)
    groups = group_tables(ctx, opens, b, cut_cost(ctx, b))
    member = torch.zeros(1, ctx.max_groups, ctx.n_devices, dtype=torch.bool)
    member[0, 0, 0] = True
    x = stage_size_inputs(ctx, groups, member, torch.tensor([2]))
    fixed, per = float(groups.fixed[0, 0, 0]), float(groups.per_sample[0, 0, 0])
    update = 4 * float(groups.params[0, 0]) / (float(ctx.memory_bandwidth[0]) * 1e9)
    busy = [16 / s * (fixed + s * per) + (16 / s - 1) * update for s in ctx.sizes]
    expect = np.log(np.array(busy) / min(busy))
    assert np.allclose(x[0, 0, :, 2].numpy(), np.minimum(expect, 5.0), rtol=1e-5, atol=1e-6)
    assert x[0, 0, :, 1].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]  # the shared size: index 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=profiles(min_layers=1, max_layers=8),
    cluster=clusters(),
    seed=st.integers(0, 1000),
)
def test_replaying_a_sample_gives_its_plans_and_log_probabilities(
    profile: ModelProfile, cluster: ClusterSpec, seed: int
) -> None:
    ctx = make_context(profile, cluster, 8, divisors(8), Schedule.GPIPE)
    policy = TAPPPolicy(hidden=8, attention_dim=4)
    sample = sample_plans(policy, ctx, 5, torch.Generator().manual_seed(seed), temperature=2.0)
    again = sample_plans(
        policy, ctx, 5, torch.Generator().manual_seed(seed + 1), temperature=2.0, given=sample
    )
    assert [again.key(i) for i in range(5)] == [sample.key(i) for i in range(5)]
    assert torch.allclose(again.log_prob, sample.log_prob, atol=1e-5)
    assert torch.allclose(again.entropy, sample.entropy, atol=1e-5)


def test_the_batched_partition_score_is_the_product_of_its_layer_decisions() -> None:
    """Sampling scores a partition in one pass; the definition is a walk over the layers:
    layer l opens a group with p = sigmoid(net(layer l, FLOP share of the open group, groups
    open / G, cut cost) + prior), forced to stay once G groups are open."""
    ctx = make_context(alexnet(), local(), 16, [4], Schedule.GPIPE, max_groups=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        policy = TAPPPolicy(hidden=16, attention_dim=8)
    with torch.no_grad():
        sample = sample_plans(policy, ctx, 32, torch.Generator().manual_seed(0), temperature=3.0)
        opens = torch.from_numpy(sample.opens)
        cuts = cut_cost(ctx, torch.full((32,), 4.0, dtype=torch.float64))
        logp, _ = _score_partition(policy, ctx, cuts, opens, temperature=3.0)
    flops = ctx.shares[:, 1].tolist()
    for i in range(32):
        want, fill, count = 0.0, flops[0], 1
        for layer in range(1, ctx.n_layers):
            x = torch.cat(
                [ctx.layer_inputs[layer], torch.tensor([fill, count / 3, cuts[i, layer]])]
            )
            with torch.no_grad():
                logit = (float(policy.partition(x)) + ctx.partition_prior) / 3.0
            opened = bool(opens[i, layer])
            if count < 3:
                p = 1.0 / (1.0 + math.exp(-logit))
                want += math.log(p if opened else 1.0 - p)
            else:
                assert not opened  # forced to stay
            count, fill = (count + 1, flops[layer]) if opened else (count, fill + flops[layer])
        assert float(logp[i]) == pytest.approx(want, abs=1e-4)
    assert len({tuple(row) for row in sample.opens.tolist()}) > 1


def test_replicated_stages_are_sampled_and_keys_ignore_which_replica_is_primary() -> None:
    ctx = make_context(alexnet(), local(), 16, [4], Schedule.GPIPE)
    policy = TAPPPolicy()
    sample = sample_plans(policy, ctx, 256, torch.Generator().manual_seed(0))
    plans = [sample.plan(i, ctx) for i in range(sample.n)]
    # the idle slot starts at 1/2: both replicated stages and idle devices occur
    assert any(st.replicas > 1 for p in plans for st in p.stages)
    assert any(len(p.devices) < len(local().device_ids) for p in plans)
    # the same plan with the primary and a replica swapped has the same key
    i = next(i for i, p in enumerate(plans) if any(st.replicas > 1 for st in p.stages))
    one = sample.take([i])
    k = int(np.flatnonzero(one.replica_of[0] >= 0)[0])
    g = int(one.replica_of[0, k])
    devices, replica_of = one.devices.copy(), one.replica_of.copy()
    replica_of[0, devices[0, g]], replica_of[0, k], devices[0, g] = g, -1, k
    swapped = Sample(
        one.size_index, one.opens, devices, replica_of, one.stage_size, one.log_prob, one.entropy
    )
    assert swapped.key(0) == one.key(0) and swapped.plan(0, ctx) == one.plan(0, ctx)


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


def test_optimum_with_a_replicated_stage_is_found_with_a_small_budget() -> None:
    profile, cluster = tiny_replicated()
    exact_problem = Problem(profile, cluster, global_batch=12, budget=Budget(None, 60))
    exact = make_planner("brute").plan(exact_problem)
    one_per_stage = make_planner("brute", max_replicas=1).plan(exact_problem)
    assert max(st.replicas for st in exact.plan.stages) == 3
    assert one_per_stage.value > 1.1 * exact.value  # the replicas are worth finding
    p = Problem(profile, cluster, global_batch=12, seed=0, budget=Budget(200, 60))
    found = make_planner("tapp", batch_size=16).plan(p)
    assert found.value == pytest.approx(exact.value, rel=1e-9)
    assert found.plan.stages == exact.plan.stages


def test_the_elite_keeps_the_best_distinct_feasible_plans() -> None:
    ctx = make_context(alexnet(), local(), 16, [4], Schedule.GPIPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = TAPPPolicy()
    sample = sample_plans(policy, ctx, 6, torch.Generator().manual_seed(0))
    assert len({sample.key(i) for i in range(6)}) == 6
    task = Task(ctx, Search(problem(), "tapp", {}))
    values = np.array([5.0, 3.0, np.inf, 4.0, 1.0, 2.0])
    update_elite(task, sample, values, size=3)
    assert sorted(value for value, _ in task.elite.values()) == [1.0, 2.0, 3.0]
    assert set(task.elite) == {sample.key(4), sample.key(5), sample.key(1)}
    update_elite(task, sample, values, size=3)  # seen again: nothing changes
    assert sorted(value for value, _ in task.elite.values()) == [1.0, 2.0, 3.0]


def test_a_restart_forgets_the_learning_and_keeps_what_was_found() -> None:
    ctx = make_context(alexnet(), local(), 16, [4], Schedule.GPIPE)
    policy = TAPPPolicy(hidden=8, attention_dim=4)
    initial = {k: v.clone() for k, v in policy.state_dict().items()}
    task = Task(ctx, Search(problem(), "tapp", {}))
    sample = sample_plans(policy, ctx, 4, torch.Generator().manual_seed(0))
    task.cache[b"seen"], task.best_value, task.best_plan = 2.0, 2.0, sample.plan(0, ctx)
    task.reference, task.worst, task.baseline = 3.0, 4.0, 0.1
    update_elite(task, sample, np.array([1.0, 2.0, 3.0, 4.0]), size=2)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    optimizer = restart(policy, initial, [task], TAPPConfig())
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in initial.items())
    assert task.reference is task.worst is task.baseline is None and task.elite == {}
    assert task.cache == {b"seen": 2.0} and task.best_value == 2.0 and task.best_plan is not None
    assert optimizer.param_groups[0]["params"] == list(policy.parameters())


def best_of(into: list[float]) -> Callable[[IterationLog], None]:
    return lambda log: into.append(log.best_value)


def test_restarts_keep_the_best_plan_and_stay_seeded() -> None:
    seen: list[list[float]] = []
    runs = []
    for _ in range(2):
        best: list[float] = []
        planner = TAPPPlanner(batch_size=8, restart_after=1, on_iteration=best_of(best))
        runs.append(planner.plan(problem(seed=2, evaluations=120)))
        seen.append(best)
    assert runs[0].plan == runs[1].plan and runs[0].value == runs[1].value
    assert seen[0] == seen[1] and runs[0].value == min(seen[0])
    assert all(a >= b for a, b in zip(seen[0], seen[0][1:], strict=False))  # never lost


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
    with pytest.raises(ProblemError, match=r"tapp\.threads: must be None or >= 1, got 0"):
        make_planner("tapp", threads=0)


def test_training_runs_on_its_own_torch_threads_and_restores_them() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    planner = TAPPPlanner(on_iteration=lambda log: seen.append(torch.get_num_threads()))
    planner.plan(problem(seed=0, evaluations=64))
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before


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


def test_train_policy_on_several_clusters_is_seeded_and_refuses_none() -> None:
    config = TAPPConfig(batch_size=8)
    other = ClusterSpec.load(ROOT / "examples/clusters/tapp-paper.yaml")

    def weights(clusters: list[ClusterSpec]) -> list[torch.Tensor]:
        logs: list[object] = []
        policy = train_policy(
            [alexnet()], clusters, global_batch=16, config=config, iterations=6,
            on_iteration=logs.append,
        )  # fmt: skip
        assert len(logs) == 6
        return [p.detach().clone() for p in policy.parameters()]

    both = weights([local(), other])
    assert all(torch.equal(a, b) for a, b in zip(both, weights([local(), other]), strict=True))
    alone = weights([local()])
    assert not all(torch.equal(a, b) for a, b in zip(both, alone, strict=True))
    with pytest.raises(ProblemError, match="cluster"):
        train_policy([alexnet()], [], config=config, iterations=1)
