"""CostTables: the tables every simulator and searcher reads, against direct sums."""

from __future__ import annotations

import numpy as np
import pytest

from pipeplan.core.cluster import ClusterSpec, DeviceType, Node
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from pipeplan.core.tables import INTER, INTRA, CostTables, cut_bytes, range_sums


def profile() -> ModelProfile:
    timed = {"a": LayerTiming(1e-3, 2e-3, 1e-4, 2e-4)}
    layers = (
        LayerProfile("l0", "conv", 100, 1e6, 10, (1, 3)),
        LayerProfile("l1", "relu", 0, 1e5, 20, (2,), timed),
        LayerProfile("l2", "conv", 300, 2e6, 30, (3,)),
        LayerProfile("l3", "fc", 400, 4e6, 40, ()),
    )
    return ModelProfile("p", (3,), layers)


def cluster() -> ClusterSpec:
    return ClusterSpec(
        "c",
        {"a": DeviceType("a", 1e9, 2.0, 100.0, 1.0), "b": DeviceType("b", 5e8, 1.0, 50.0, 0.5)},
        (Node("n0", {"a": 2}), Node("n1", {"b": 1})),
    )


def test_rule_1_timings_first_then_flops() -> None:
    tb = CostTables(profile(), cluster())
    a, b = tb.type_index["a"], tb.type_index["b"]
    assert tb.types == ("a", "b")
    assert tb.fwd_per_sample[a].tolist() == [1e-3, 1e-3, 2e-3, 4e-3]
    assert tb.fwd_fixed[a].tolist() == [0.0, 1e-4, 0.0, 0.0]
    assert tb.bwd_per_sample[b].tolist() == pytest.approx([4e-3, 4e-4, 8e-3, 16e-3])


def test_prefix_and_range_sums_agree() -> None:
    tb = CostTables(profile(), cluster())
    assert tb.params_prefix.tolist() == [0, 100, 100, 400, 800]
    assert tb.params(1, 3) == 300
    assert tb.params_range[1, 3] == 300 and tb.params_range[3, 1] == 0
    assert tb.acts(0, 4) == tb.acts_range[0, 4] == 100
    t = tb.type_index["a"]
    both = tb.fwd_fixed_range + tb.bwd_fixed_range
    per = tb.fwd_per_sample_range + tb.bwd_per_sample_range
    assert tb.fb_time(t, 1, 3, 2.0) == pytest.approx(both[t, 1, 3] + 2.0 * per[t, 1, 3])


def test_range_sums_add_left_to_right() -> None:
    out = range_sums(np.array([1.0, 2.0, 3.0]))
    assert out[0, 3] == 6.0 and out[1, 3] == 5.0 and out[2, 1] == 0.0


def test_cut_bytes_relays_skips() -> None:
    # l0 feeds l1 and l3: its 10 bytes cross the cuts before 1, 2 and 3
    assert cut_bytes(profile()).tolist() == [0.0, 10.0, 30.0, 40.0, 0.0]


def test_devices_and_links() -> None:
    c = cluster()
    tb = CostTables(profile(), c)
    assert tb.dev_node.tolist() == [0, 0, 1]
    assert tb.dev_capacity.tolist() == [2e9, 2e9, 1e9]
    assert tb.dev_price.tolist() == [1.0, 1.0, 0.5]
    assert tb.link_bps[INTRA] == c.network.intra_node.bytes_per_s
    assert tb.link_lat[INTER] == c.network.inter_node.latency_s


def test_of_builds_once_per_pair() -> None:
    p, c = profile(), cluster()
    assert CostTables.of(p, c) is CostTables.of(p, c)
    assert CostTables.of(p, cluster()) is not CostTables.of(p, c)
