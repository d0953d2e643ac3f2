"""Kind-level costing (core.kind_tables): the cost model's answer on the concrete plan."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.core.batch_eval import BatchEvaluator, PlanBatch
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.errors import PlanError
from pipeplan.core.kind_tables import KindBatch, evaluate_kinds
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, ModelProfile
from pipeplan.core.tables import CostTables
from tests.core.strategies import divisors, kind_clusters, profiles

KindStage = tuple[str, str, int, int]  # (node kind, device type, devices per node, nodes)


def concrete(cluster: ClusterSpec, stages: list[KindStage]) -> list[tuple[str, ...]]:
    """Each stage on the next free nodes of its kind, the first devices of its type on each
    (no node holds two stages), written out by hand as a check on the costing."""
    taken: dict[str, int] = {}
    out = []
    for kind, dtype, per_node, nodes in stages:
        members = [n for n in cluster.nodes if (n.kind or n.name) == kind]
        first = taken.get(kind, 0)
        taken[kind] = first + nodes
        out.append(
            tuple(
                f"{n.name}/{dtype}:{c}"
                for n in members[first : first + nodes]
                for c in range(per_node)
            )
        )
    return out


@st.composite
def kind_cases(draw: st.DrawFn) -> tuple[ModelProfile, ClusterSpec, list[KindStage], Plan]:
    """A profile, a cluster of node kinds (``count: N``), and a node-exclusive plan on it:
    stages on part of a node, on several nodes, on different kinds, some recomputing."""
    profile = draw(profiles(min_layers=2, max_layers=8))
    cluster = draw(kind_clusters())
    shape = {n.kind: n for n in cluster.nodes}  # a node of each kind
    kinds = list(shape.values())
    left = {k: sum(n.kind == k for n in cluster.nodes) for k in shape}
    S = draw(st.integers(1, min(len(profile), sum(left.values()))))
    stages: list[KindStage] = []
    for s in range(S):
        node = draw(st.sampled_from([n for n in kinds if left[n.kind]]))
        kind = str(node.kind)
        dtype = draw(st.sampled_from(sorted(node.devices)))
        per_node = draw(st.integers(1, node.devices[dtype]))
        spare = sum(left.values()) - (S - s)  # nodes beyond one for each stage still to place
        nodes = draw(st.integers(1, min(left[kind], 1 + spare)))
        left[kind] -= nodes
        stages.append((kind, dtype, per_node, nodes))
    batch = draw(st.integers(1, 24))
    sizes = draw(st.sampled_from((divisors(batch), list(range(1, batch + 1)))))
    mb = draw(st.sampled_from(sizes))
    cuts = sorted(draw(st.sets(st.integers(1, len(profile) - 1), min_size=S - 1, max_size=S - 1)))
    bounds = [0, *cuts, len(profile)]
    schedule = draw(st.sampled_from(list(Schedule)))
    recompute = draw(st.lists(st.booleans(), min_size=S, max_size=S))
    devices = concrete(cluster, stages)
    plan = Plan(
        batch,
        tuple(Stage((bounds[s], bounds[s + 1]), devices[s], mb, recompute[s]) for s in range(S)),
        schedule,
    )
    return profile, cluster, stages, plan


def kind_batch(tables: CostTables, stages: list[KindStage], plan: Plan) -> KindBatch:
    row = [[0, *(st.end for st in plan.stages)]]
    return KindBatch(
        bounds=np.array(row, dtype=np.int64),
        microbatch=np.array([[st.microbatch for st in plan.stages]], dtype=np.int64),
        type_index=np.array([[tables.type_index[t] for _, t, _, _ in stages]], dtype=np.int64),
        replicas=np.array([[d * n for _, _, d, n in stages]], dtype=np.int64),
        nodes=np.array([[n for _, _, _, n in stages]], dtype=np.int64),
        recompute=np.array([[st.recompute for st in plan.stages]], dtype=bool),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind_cases())
def test_kind_level_cost_equals_the_cost_model_on_the_concrete_plan(case: tuple) -> None:
    profile, cluster, stages, plan = case
    tables = CostTables.of(profile, cluster)
    got = evaluate_kinds(tables, kind_batch(tables, stages, plan), plan.global_batch, plan.schedule)
    est = simulate(plan, profile, cluster)
    assert got.batch_time_s[0] == pytest.approx(est.batch_time_s, rel=1e-9, abs=1e-12)
    assert bool(got.fits[0]) == est.fits
    assert got.cost_per_hour[0] == pytest.approx(est.cost_per_hour, rel=1e-12)
    ev = BatchEvaluator(profile, cluster).evaluate(
        PlanBatch.from_plans([plan], cluster), plan.global_batch, plan.schedule
    )
    assert got.memory_ratio[0] == pytest.approx(ev.memory_ratio[0], rel=1e-12)
    assert ev.recompute_ratio is not None and got.recompute_ratio is not None
    assert got.recompute_ratio[0] == pytest.approx(ev.recompute_ratio[0], rel=1e-12)


def test_without_recompute_flags_no_stage_recomputes() -> None:
    """``recompute=None`` costs as all-false flags, and a recomputing stage costs more time
    and holds less memory where its activations outweigh its inputs."""
    profile = ModelProfile("toy", (3, 8, 8), tuple(_layer(i, 4) for i in range(4)))
    cluster = _one_kind()
    tables = CostTables.of(profile, cluster)
    plain = dataclasses.replace(_good(), bounds=np.array([[0, 2, 4]]))
    off = dataclasses.replace(plain, recompute=np.zeros((1, 2), dtype=bool))
    on = dataclasses.replace(plain, recompute=np.array([[True, False]]))
    a, b, c = (evaluate_kinds(tables, x, 8) for x in (plain, off, on))
    assert a.batch_time_s[0] == b.batch_time_s[0] and a.memory_ratio[0] == b.memory_ratio[0]
    assert c.batch_time_s[0] > a.batch_time_s[0]


def test_a_population_of_kind_plans_is_costed_row_by_row() -> None:
    """Several plans at once (several nodes, part of a node, two kinds) each equal their own
    concrete plan's simulation."""
    cluster = ClusterSpec.from_dict(
        {
            "name": "kinds",
            "device_types": {
                "a": {"flops": 2e12, "memory_gb": 8, "memory_bandwidth_gbps": 100},
                "b": {"flops": 5e11, "memory_gb": 4, "memory_bandwidth_gbps": 50},
            },
            "nodes": [
                {"name": "fat", "devices": {"a": 4}, "count": 3},
                {"name": "thin", "devices": {"b": 2}, "count": 2},
            ],
            "network": {
                "intra_node": {"bandwidth_gbps": 100, "latency_us": 5},
                "inter_node": {"bandwidth_gbps": 10, "latency_us": 20},
            },
        }
    )
    profile = ModelProfile("toy", (3, 8, 8), tuple(_layer(i, 6) for i in range(6)))
    tables = CostTables.of(profile, cluster)
    rows: list[tuple[list[KindStage], tuple[int, ...]]] = [
        ([("fat", "a", 4, 2), ("thin", "b", 2, 1), ("thin", "b", 1, 1)], (0, 4, 5, 6)),
        ([("fat", "a", 1, 1), ("fat", "a", 3, 2), ("thin", "b", 1, 1)], (0, 1, 3, 6)),
        ([("thin", "b", 2, 1), ("fat", "a", 2, 3), ("thin", "b", 1, 1)], (0, 2, 5, 6)),
    ]
    for schedule in Schedule:
        plans = []
        for stages, bounds in rows:
            devices = concrete(cluster, stages)
            plans.append(
                Plan(
                    30,
                    tuple(
                        Stage((bounds[s], bounds[s + 1]), devices[s], 4) for s in range(len(stages))
                    ),
                    schedule,
                )
            )
        batch = KindBatch(
            bounds=np.array([b for _, b in rows], dtype=np.int64),
            microbatch=np.full((3, 3), 4, dtype=np.int64),
            type_index=np.array(
                [[tables.type_index[t] for _, t, _, _ in s] for s, _ in rows], dtype=np.int64
            ),
            replicas=np.array([[d * n for _, _, d, n in s] for s, _ in rows], dtype=np.int64),
            nodes=np.array([[n for _, _, _, n in s] for s, _ in rows], dtype=np.int64),
        )
        got = evaluate_kinds(tables, batch, 30, schedule)
        want = [simulate(p, profile, cluster).batch_time_s for p in plans]
        np.testing.assert_allclose(got.batch_time_s, want, rtol=1e-9)


def _layer(i: int, n: int) -> LayerProfile:
    return LayerProfile(
        f"l{i}", "fc", 10**6 * (i + 1), 1e9 * (1 + i % 3), 10**5, (i + 1,) if i < n - 1 else ()
    )


def _one_kind() -> ClusterSpec:
    return ClusterSpec.from_dict(
        {
            "name": "one",
            "device_types": {"a": {"flops": 1e12, "memory_gb": 8, "memory_bandwidth_gbps": 100}},
            "nodes": [{"name": "n", "devices": {"a": 2}, "count": 2}],
            "network": {
                "intra_node": {"bandwidth_gbps": 100, "latency_us": 5},
                "inter_node": {"bandwidth_gbps": 10, "latency_us": 20},
            },
        }
    )


def _good() -> KindBatch:
    return KindBatch(
        bounds=np.array([[0, 1, 2]]),
        microbatch=np.array([[2, 2]]),
        type_index=np.array([[0, 0]]),
        replicas=np.array([[2, 1]]),
        nodes=np.array([[1, 1]]),
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("bounds", np.array([[0, 1, 3]]), "kind plans.bounds: must run from 0 to the 2 layers"),
        ("bounds", np.array([[0, 2, 2]]), "every stage needs at least one layer"),
        ("bounds", np.array([[0, 2]]), "kind plans.bounds: shape (1, 2), expected (1, 3)"),
        ("microbatch", np.array([[0, 2]]), "kind plans.microbatch: must be >= 1, got 0"),
        ("microbatch", np.array([[9, 2]]), "kind plans.microbatch: 9 exceeds the global batch 8"),
        ("replicas", np.array([[2]]), "kind plans.replicas: shape (1, 1), expected (1, 2)"),
        ("nodes", np.array([[0, 1]]), "kind plans.nodes: must be >= 1, got 0"),
        ("nodes", np.array([[3, 1]]), "spans more nodes than it has replicas"),
        ("type_index", np.array([[0, 7]]), "kind plans.type_index: 7 is not a type of"),
        ("recompute", np.array([[True]]), "kind plans.recompute: shape (1, 1), expected (1, 2)"),
        ("recompute", np.array([[1, 0]]), "kind plans.recompute: expected bools, got int64"),
    ],
)
def test_bad_kind_plans_are_refused_naming_the_field(
    field: str, value: np.ndarray, message: str
) -> None:
    profile = ModelProfile("toy", (3, 8, 8), (_layer(0, 2), _layer(1, 2)))
    cluster = _one_kind()
    tables = CostTables.of(profile, cluster)
    good = _good()
    bad = KindBatch(**{**good.__dict__, field: value})
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate_kinds(tables, bad, 8)
