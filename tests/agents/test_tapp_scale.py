"""``tapp`` on a cluster given with counts under the time objective: kind-level plans (each
stage on every device of one type on the first free nodes of one kind), seeded, never worse
than the balanced splits it starts from; device-level elsewhere; the balanced split fits
memory; an instance nothing fits is refused with the binding constraint."""

from __future__ import annotations

import math

import pytest

from pipeplan.agents.baselines.genetic import GeneticConfig
from pipeplan.agents.problem import Budget, InfeasibleError, Objective, Problem
from pipeplan.agents.provision.exact import found_batch
from pipeplan.agents.provision.genetic_kinds import KindGenetic
from pipeplan.agents.provision.scale import at_scale, balanced_seeds, balanced_split
from pipeplan.agents.registry import make_planner
from pipeplan.agents.search import Search
from pipeplan.agents.tapp import TAPPPlanner as DeviceTAPP
from pipeplan.agents.tapp.scale import cut_logit, stages_for_memory
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.profile import LayerProfile, ModelProfile

SHORT = {"iterations": 6, "batch_size": 16}


def chain(n: int = 12, params: float = 2e9) -> ModelProfile:
    layers = [
        LayerProfile(f"l{i}", "fc", params, 4e9 * (1 + i % 3), 1e6, [i + 1] if i < n - 1 else [])
        for i in range(n)
    ]
    return ModelProfile("chain", [8], layers)


def owned(counts: bool = True) -> ClusterSpec:
    def entry(name: str, devices: dict[str, int], count: int) -> list[dict[str, object]]:
        if counts:
            return [{"name": name, "devices": devices, "count": count}]
        return [{"name": f"{name}-{k}", "devices": devices} for k in range(count)]

    return ClusterSpec.from_dict(
        {
            "name": "owned",
            "device_types": {
                "big": {"flops": 3e14, "memory_gb": 80},
                "small": {"flops": 6e13, "memory_gb": 16},
            },
            "nodes": entry("b", {"big": 4}, 3) + entry("s", {"small": 2}, 4),
        }
    )


def problem(cluster: ClusterSpec | None = None, **kw: object) -> Problem:
    kw.setdefault("budget", Budget(300, None))
    kw.setdefault("objective", Objective.TIME)
    return Problem(chain(), cluster or owned(), global_batch=64, **kw)  # type: ignore[arg-type]


def test_at_scale_needs_counts_and_a_time_objective() -> None:
    assert at_scale(problem())
    assert at_scale(problem(objective=Objective.THROUGHPUT))
    assert not at_scale(problem(owned(counts=False)))
    cost = Problem(chain(), owned(), Objective.COST, 64, min_throughput=1.0)
    assert not at_scale(cost)


def test_tapp_plans_by_kind_seeded_and_no_worse_than_its_seeds() -> None:
    p = problem()
    first = make_planner("tapp", **SHORT).plan(p)
    again = make_planner("tapp", **SHORT).plan(p)
    assert first.plan == again.plan and first.value == again.value
    assert first.estimate.fits
    taken: dict[str, int] = {}
    for stage in first.plan.stages:
        devs = [p.cluster.device(d) for d in stage.devices]
        nodes = sorted({d.node for d in devs}, key=lambda n: int(n.rsplit("-", 1)[1]))
        kind = nodes[0].rsplit("-", 1)[0]
        assert len({d.type for d in devs}) == 1 and {n.rsplit("-", 1)[0] for n in nodes} == {kind}
        start = taken.get(kind, 0)
        assert nodes == [f"{kind}-{k}" for k in range(start, start + len(nodes))]
        taken[kind] = start + len(nodes)
    space = KindGenetic(p, Search(p, "x", {}), GeneticConfig())
    seeds = list(balanced_seeds(space))
    plans = [found_batch(space.cat, [s.found()]).plan(0, p.cluster, 64, p.schedule) for s in seeds]
    best_seed = min(simulate(q, p.profile, p.cluster).batch_time_s for q in plans)
    assert first.value <= best_seed


def test_tapp_stays_device_level_without_counts() -> None:
    p = problem(owned(counts=False), budget=Budget(64, None))
    ours = make_planner("tapp", **SHORT).plan(p)
    theirs = DeviceTAPP(**SHORT).plan(p)
    assert ours.plan == theirs.plan and ours.value == theirs.value


def test_the_balanced_split_fits_and_spreads_the_layers() -> None:
    """12 layers of 8 GB of state: at most 9 on a big GPU's 80 GB (less the activations),
    one on a small one's 16 GB; the split on the big nodes alone takes all three."""
    p = problem()
    space = KindGenetic(p, Search(p, "x", {}), GeneticConfig())
    big = next(o for o, opt in enumerate(space.cat.options) if opt.type == "big")
    plan = balanced_split(space, 8, [big])
    assert plan is not None
    assert plan.bounds[0] == 0 and plan.bounds[-1] == 12 and len(plan.stages) == 3
    assert max(b - a for a, b in zip(plan.bounds, plan.bounds[1:], strict=False)) == 4
    concrete = found_batch(space.cat, [plan.found()]).plan(0, p.cluster, 64, p.schedule)
    assert simulate(concrete, p.profile, p.cluster).fits
    small = next(o for o, opt in enumerate(space.cat.options) if opt.type == "small")
    assert balanced_split(space, 8, [small]) is None  # 4 nodes for 12 layers of one each


def test_memory_sets_the_first_partition() -> None:
    assert stages_for_memory(problem()) == math.ceil(12 * 8e9 / 80e9)
    assert 1 / (1 + math.exp(-cut_logit(2, 12))) == pytest.approx(1 / 11)
    assert cut_logit(1, 12) == cut_logit(0, 12)  # clipped to 1/64


def test_nothing_fits_is_refused_with_the_memory_that_binds() -> None:
    p = Problem(chain(params=30e9), owned(), Objective.TIME, 64, budget=Budget(None, 10.0))
    with pytest.raises(InfeasibleError) as e:
        make_planner("tapp", **SHORT).plan(p)
    assert "memory" in str(e.value)
    assert "at most 7 stages on the 7 nodes" in str(e.value)
    assert "(1,440 GB) need at least 18 stages of big's 80 GB" in str(e.value)
