"""Hypothesis strategies for random profiles, clusters and plans (shared by core tests)."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from pipeplan.core.calibration import Calibration, CallOverhead
from pipeplan.core.cluster import ClusterSpec, DeviceType, Link, Network, Node
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile

TYPES = ("cpu", "t4", "v100")


@st.composite
def profiles(draw: st.DrawFn, min_layers: int = 2, max_layers: int = 12) -> ModelProfile:
    n = draw(st.integers(min_layers, max_layers))
    timed = draw(st.sets(st.sampled_from(TYPES)))
    layers = []
    for i in range(n):
        succ: set[int] = set()
        if i < n - 1:
            succ.add(i + 1)
            succ |= draw(st.sets(st.integers(i + 1, n - 1), max_size=2))
        timings = {
            t: LayerTiming(
                draw(st.floats(0, 1e-2)),
                draw(st.floats(0, 2e-2)),
                draw(st.floats(0, 1e-3)),
                draw(st.floats(0, 1e-3)),
            )
            for t in timed
        }
        layers.append(
            LayerProfile(
                f"l{i}",
                "conv",
                draw(st.integers(0, 10**8)),
                draw(st.floats(0, 1e10)),
                draw(st.integers(0, 10**7)),
                tuple(sorted(succ)),
                timings,
            )
        )
    return ModelProfile("random", (3, 8, 8), tuple(layers))


@st.composite
def clusters(draw: st.DrawFn) -> ClusterSpec:
    types = {
        t: DeviceType(
            t,
            draw(st.floats(1e9, 1e13)),
            draw(st.floats(0.5, 40)),
            draw(st.floats(10, 1000)),
            draw(st.floats(0, 3)),
        )
        for t in TYPES
    }
    nodes = []
    for k in range(draw(st.integers(1, 3))):
        counts = {t: draw(st.integers(0, 2)) for t in TYPES}
        nodes.append(Node(f"n{k}", counts))
    if sum(sum(n.devices.values()) for n in nodes) == 0:
        nodes[0] = Node("n0", {"cpu": 1})
    net = Network(
        Link(draw(st.floats(1, 200)), draw(st.floats(0, 20)), *draw(ring_rates(1, 200, 20))),
        Link(draw(st.floats(0.1, 50)), draw(st.floats(0, 200)), *draw(ring_rates(0.1, 50, 200))),
    )
    return ClusterSpec("random", types, tuple(nodes), net, calibration=draw(calibrations()))


@st.composite
def kind_clusters(draw: st.DrawFn, max_devices: int = 4) -> ClusterSpec:
    """A cluster of one to three node kinds (``count: N`` entries, one to three nodes each),
    each node with one or two device types."""
    base = draw(clusters())
    kinds = []
    for k in range(draw(st.integers(1, 3))):
        types = draw(st.sets(st.sampled_from(TYPES), min_size=1, max_size=2))
        devices = {t: draw(st.integers(1, max_devices)) for t in sorted(types)}
        kinds.append(Node(f"k{k}", devices, count=draw(st.integers(1, 3))))
    return dataclasses.replace(base, nodes=tuple(kinds))


def ring_rates(
    low_gbps: float, high_gbps: float, max_us: float
) -> st.SearchStrategy[tuple[float | None, float | None]]:
    """A link's own ``all_reduce`` (bandwidth, latency), or none (rule 8 uses the link's)."""
    return st.one_of(
        st.just((None, None)),
        st.tuples(st.floats(low_gbps, high_gbps), st.floats(0, max_us)),
    )


@st.composite
def calibrations(draw: st.DrawFn) -> Calibration | None:
    """None, or a calibration of some of the types and link classes (rules 1c, 4, 8c, 8u)."""
    if not draw(st.booleans()):
        return None
    scaled = draw(st.sets(st.sampled_from(TYPES)))
    called = draw(st.sets(st.sampled_from(TYPES)))
    fitted = draw(st.sets(st.sampled_from(("intra_node", "inter_node"))))
    rings = draw(st.sets(st.sampled_from(("intra_node", "inter_node"))))
    updated = draw(st.sets(st.sampled_from(TYPES)))
    return Calibration(
        compute_scale={t: draw(st.floats(0.5, 2.0)) for t in scaled},
        call_overhead={
            t: CallOverhead(draw(st.floats(0, 5e-3)), draw(st.floats(0, 5e-3))) for t in called
        },
        network={k: (draw(st.floats(0.1, 100)), draw(st.floats(0, 500))) for k in fitted},
        all_reduce={k: (draw(st.floats(0.1, 100)), draw(st.floats(0, 500))) for k in rings},
        step_overhead_s=draw(st.floats(0, 1e-2)),
        memory_bandwidth_gbps={t: draw(st.floats(1.0, 200.0)) for t in updated},
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def plans(
    draw: st.DrawFn,
    profile: ModelProfile,
    cluster: ClusterSpec,
    num_stages: int,
    schedule: Schedule,
    batch: int,
    recompute: bool = False,
) -> Plan:
    """A valid plan of ``num_stages`` stages; ``recompute``: each stage may recompute."""
    n = len(profile)
    cuts = sorted(
        draw(st.sets(st.integers(1, n - 1), min_size=num_stages - 1, max_size=num_stages - 1))
    )
    bounds = [0, *cuts, n]
    ids = list(draw(st.permutations(cluster.device_ids)))
    extra = len(ids) - num_stages
    # divisors of the batch, or any size up to it (the last microbatch holds the remainder);
    # equal or unequal under either schedule
    sizes = draw(st.sampled_from((divisors(batch), list(range(1, batch + 1)))))
    stages, equal_mb, unequal = [], draw(st.sampled_from(sizes)), draw(st.booleans())
    for s in range(num_stages):
        r = 1 + draw(st.integers(0, min(extra, 2)))
        extra -= r - 1
        devices, ids = ids[:r], ids[r:]
        mb = draw(st.sampled_from(sizes)) if unequal else equal_mb
        again = draw(st.booleans()) if recompute else False
        stages.append(Stage((bounds[s], bounds[s + 1]), tuple(devices), mb, again))
    return Plan(batch, tuple(stages), schedule)
