"""The cost model against the contract, on cases worked out by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.core.calibration import Calibration
from pipeplan.core.cluster import ClusterSpec, DeviceType, Link, Network, Node
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import LayerProfile, LayerTiming, ModelProfile
from pipeplan.core.schedules import (
    gpipe_order,
    one_f_one_b_order,
    one_f_one_b_warmups,
    stage_orders,
    upstream_microbatch,
)
from pipeplan.core.tables import cut_bytes


def chain(n: int, flops: float = 1e6, act: int = 100, params: int = 1000) -> ModelProfile:
    layers = [
        LayerProfile(f"l{i}", "fc", params, flops, act, (i + 1,) if i < n - 1 else ())
        for i in range(n)
    ]
    return ModelProfile("chain", (3,), tuple(layers))


def cluster(gb: float = 1.0) -> ClusterSpec:
    return ClusterSpec(
        "c",
        {"a": DeviceType("a", 1e9, gb, 100.0, 1.0), "b": DeviceType("b", 5e8, gb, 50.0, 0.5)},
        (Node("n0", {"a": 2}), Node("n1", {"a": 1, "b": 1})),
    )


def test_gpipe_order_is_all_forwards_then_all_backwards() -> None:
    assert gpipe_order(4) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("F", 3),
        ("B", 0),
        ("B", 1),
        ("B", 2),
        ("B", 3),
    ]


def test_one_f_one_b_orders_for_three_stages_four_microbatches() -> None:
    f, b = "F", "B"
    assert one_f_one_b_order(4, 0, 3) == [
        (f, 0),
        (f, 1),
        (f, 2),
        (b, 0),
        (f, 3),
        (b, 1),
        (b, 2),
        (b, 3),
    ]
    assert one_f_one_b_order(4, 1, 3) == [
        (f, 0),
        (f, 1),
        (b, 0),
        (f, 2),
        (b, 1),
        (f, 3),
        (b, 2),
        (b, 3),
    ]
    assert one_f_one_b_order(4, 2, 3) == [
        (f, 0),
        (b, 0),
        (f, 1),
        (b, 1),
        (f, 2),
        (b, 2),
        (f, 3),
        (b, 3),
    ]


def test_one_f_one_b_warmup_is_capped_by_microbatch_count() -> None:
    assert one_f_one_b_order(1, 0, 4) == [("F", 0), ("B", 0)]


def test_upstream_microbatch_is_the_one_holding_the_last_sample() -> None:
    # stage s has microbatch 4, upstream 2: its microbatch 0 needs upstream 0 and 1
    assert [upstream_microbatch(j, 4, 2) for j in range(2)] == [1, 3]
    # microbatch 2 against 4 downstream: 0,0,1,1
    assert [upstream_microbatch(j, 2, 4) for j in range(4)] == [0, 0, 1, 1]
    assert [upstream_microbatch(j, 3, 2) for j in range(2)] == [1, 2]


def test_two_stage_gpipe_on_paper() -> None:
    """S=2, B=4, b=2 (M=2), one device each, across nodes.

    F = 2 layers x 2 samples x 1e6 / 1e9 = 4 ms, backward 8 ms, both stages on type a.
    Update 4 x 2000 / 1e11 = 0.08 us; every backward also accumulates gradients,
    (M - 1) / M x 0.08 = a = 0.04 us. Send: 50 us + 100 B x 2 / 1.25e9 B/s = 50.16 us.
      s0: F0 0-4, F1 4-8; sends deliver 4.05016, 8.05016
      s1: F0 4.05016-8.05016, F1 8.05016-12.05016, B0 -20.05016+a, B1 -28.05016+2a
      grads deliver 20.10032+a, 28.10032+2a (50.16 us each)
      s0: B0 20.10032+a - 28.10032+2a, B1 - 36.10032+3a; update 2a
    """
    a = 4e-8
    plan = Plan(4, (Stage((0, 2), ("n0/a:0",), 2), Stage((2, 4), ("n1/a:0",), 2)))
    est = simulate(plan, chain(4), cluster())
    assert est.batch_time_s == pytest.approx(0.03610032 + 5 * a, rel=1e-12)
    assert est.stages[1].end_s == pytest.approx(0.02805016 + 4 * a, rel=1e-12)
    assert est.throughput == pytest.approx(4 / est.batch_time_s)
    comm = 4 * 50.16e-6
    assert est.comm_fraction == pytest.approx(comm / (comm + 4 * (0.012 + a)), rel=1e-12)
    price = 2.0  # two devices of type a at $1/h
    assert est.cost_per_hour == price
    assert est.cost_per_batch == pytest.approx(price * est.batch_time_s / 3600)
    kinds = [(e.stage, e.kind, e.microbatch) for e in est.timeline if e.kind in "FB"]
    assert kinds[:2] == [(0, "F", 0), (0, "F", 1)]


def test_unequal_microbatches_and_replicas() -> None:
    """Stage 0: b=2 on one device; stage 1: b=4 over two replicas (2 samples each).

    s1's forward 0 waits for s0's microbatch 1; s0's backwards 0 and 1 both wait for
    s1's gradient 0. All-reduce over n1/a:0 + n0/a:1 crosses nodes:
    2 x 1/2 x 2000 / 1.25e9 + 2 x 50 us = 101.6 us. Gradient accumulation per backward:
    s1 (M=2) 1/2 x 0.08 us = 0.04 us, s0 (M=4) 3/4 x 0.08 us = 0.06 us. s1's two backwards
    end 0.08 us later, so s0's first starts 0.04 us later (gradient 0), and its four run back
    to back: 0.04 + 4 x 0.06 = 0.28 us on top.
    """
    plan = Plan(8, (Stage((0, 2), ("n0/a:0",), 2), Stage((2, 4), ("n1/a:0", "n0/a:1"), 4)))
    est = simulate(plan, chain(4), cluster())
    assert est.stages[1].allreduce_s == pytest.approx(101.6e-6, rel=1e-12)
    assert est.stages[1].end_s == pytest.approx(0.03605016 + 8e-8 + 8e-8 + 101.6e-6, rel=1e-12)
    assert est.batch_time_s == pytest.approx(0.06010048 + 28e-8 + 8e-8, rel=1e-12)
    assert est.stages[0].microbatches == 4 and est.stages[1].microbatches == 2


def test_a_links_all_reduce_numbers_price_the_ring_and_not_the_sends() -> None:
    """The same plan on links with their own ``all_reduce`` numbers: the ring over n1/a:0 +
    n0/a:1 costs 2 x 1/2 x 2000 / 2.5e8 + 2 x 1 ms = 2.008 ms, the sends stay priced on the
    link; a calibration's fitted link keeps the ring numbers."""
    plan = Plan(8, (Stage((0, 2), ("n0/a:0",), 2), Stage((2, 4), ("n1/a:0", "n0/a:1"), 4)))
    base = cluster()
    ringed = ClusterSpec(
        "c",
        base.device_types,
        base.nodes,
        Network(inter_node=Link(10.0, 50.0, ring_bandwidth_gbps=2.0, ring_latency_us=1000.0)),
    )
    before, after = simulate(plan, chain(4), base), simulate(plan, chain(4), ringed)
    assert after.stages[1].allreduce_s == pytest.approx(2.008e-3, rel=1e-12)
    assert after.stages[0].transfer_s == before.stages[0].transfer_s
    assert after.stages[1].end_s == pytest.approx(before.stages[1].end_s + 2.008e-3 - 101.6e-6)
    fitted = ringed.calibrated(Calibration(network={"inter_node": (20.0, 10.0)}))
    assert fitted.links.inter_node == Link(20.0, 10.0, 2.0, 1000.0)
    again = simulate(plan, chain(4), fitted)
    assert again.stages[1].allreduce_s == pytest.approx(2.008e-3, rel=1e-12)
    assert again.stages[0].transfer_s < after.stages[0].transfer_s


def test_slowest_replica_sets_stage_time() -> None:
    plan = Plan(4, (Stage((0, 4), ("n1/a:0", "n1/b:0"), 4),))
    est = simulate(plan, chain(4), cluster())
    # b is half as fast: 4 layers x 2 samples x 1e6 / 5e8 = 16 ms forward
    assert est.stages[0].forward_s == pytest.approx(0.016)
    assert est.stages[0].backward_s == pytest.approx(0.032)
    # intra-node all-reduce: 100 Gbit/s, 5 us; update on b's 50 GB/s
    ar = 2 * 0.5 * 4000 / 12.5e9 + 2 * 5e-6
    assert est.batch_time_s == pytest.approx(0.048 + 4 * 4000 / 50e9 + ar, rel=1e-12)


def test_replicas_are_costed_for_the_busiest_share() -> None:
    """Rule 2i: a microbatch of 4 on three replicas is 2 samples on the first (the executor's
    split 2, 1, 1), as a microbatch of 6 is; 4 layers x 2 samples x 1e6 / 1e9 = 8 ms forward.
    Its memory holds 2 samples of activations per device: 4 x 4000 + 2 x 400 bytes."""
    plan = Plan(4, (Stage((0, 4), ("n0/a:0", "n0/a:1", "n1/a:0"), 4),))
    est = simulate(plan, chain(4), cluster())
    assert est.stages[0].forward_s == pytest.approx(0.008)
    assert est.stages[0].backward_s == pytest.approx(0.016)
    six = simulate(
        Plan(6, (Stage((0, 4), ("n0/a:0", "n0/a:1", "n1/a:0"), 6),)), chain(4), cluster()
    )
    assert six.stages[0].forward_s == est.stages[0].forward_s
    assert est.stages[0].memory_bytes == pytest.approx(4 * 4000 + 2 * 400)


def test_each_replica_computes_its_own_share_the_first_ones_larger() -> None:
    """Rule 2i with unlike replicas: 5 samples on (a, b) are 3 on a, 2 on b (the executor's
    split); b, half as fast, sets the pace: 4 layers x 2 x 1e6 / 5e8 = 16 ms forward (a's 3
    samples take 12 ms). In the other order b gets 3: 24 ms."""
    model = chain(4)
    first = simulate(Plan(5, (Stage((0, 4), ("n1/a:0", "n1/b:0"), 5),)), model, cluster())
    assert first.stages[0].forward_s == pytest.approx(0.016)
    swapped = simulate(Plan(5, (Stage((0, 4), ("n1/b:0", "n1/a:0"), 5),)), model, cluster())
    assert swapped.stages[0].forward_s == pytest.approx(0.024)


def test_measured_timings_with_fixed_costs_take_precedence() -> None:
    t = {"a": LayerTiming(fwd_s=1e-3, bwd_s=2e-3, fwd_fixed_s=5e-3, bwd_fixed_s=1e-2)}
    layers = (LayerProfile("x", "conv", 0, 1e12, 0, (), t),)
    plan = Plan(4, (Stage((0, 1), ("n0/a:0",), 2),))
    est = simulate(plan, ModelProfile("m", (1,), layers), cluster())
    assert est.stages[0].forward_s == pytest.approx(5e-3 + 2e-3)
    assert est.batch_time_s == pytest.approx(2 * (7e-3 + 1.4e-2))


def test_one_f_one_b_two_stages_on_paper() -> None:
    """S=2, M=2 under 1F1B: s0 runs F0 F1 B0 B1 (warm-up 1), s1 runs F0 B0 F1 B1.

    Every backward also accumulates gradients: a = 1/2 x 0.08 us (see the GPipe case).
    s1: F0 4.05016-8.05016, B0 -16.05016+a, F1 (s0's F1 delivered 8.05016) 16.05016+a -
        20.05016+a, B1 -28.05016+2a; s0: B0 waits grad 0 at 16.10032+a -> 24.10032+2a, B1
        grad 1 at 28.10032+2a -> 36.10032+3a; update 2a.
    """
    a = 4e-8
    plan = Plan(
        4, (Stage((0, 2), ("n0/a:0",), 2), Stage((2, 4), ("n1/a:0",), 2)), Schedule.ONE_F_ONE_B
    )
    est = simulate(plan, chain(4), cluster())
    b1 = [e for e in est.timeline if (e.stage, e.kind) == (1, "F")]
    assert b1[1].start == pytest.approx(0.01605016 + a, rel=1e-12)
    assert est.batch_time_s == pytest.approx(0.03610032 + 5 * a, rel=1e-12)
    # memory: in-flight min(S - s, M) = 2 for stage 0, 1 for stage 1
    assert est.stages[0].memory_bytes == 4 * 2000 + 2 * 2 * 200
    assert est.stages[1].memory_bytes == 4 * 2000 + 1 * 2 * 200


def test_skip_activations_are_relayed_across_cuts() -> None:
    layers = (
        LayerProfile("a", "conv", 0, 1.0, 10, (1, 3)),
        LayerProfile("b", "conv", 0, 1.0, 20, (2,)),
        LayerProfile("c", "conv", 0, 1.0, 40, (3,)),
        LayerProfile("d", "add", 0, 1.0, 80, ()),
    )
    x = cut_bytes(ModelProfile("skip", (1,), layers))
    assert list(x) == [0, 10, 10 + 20, 10 + 40, 0]


def test_memory_overflow_is_reported_per_device() -> None:
    big = chain(2, params=400_000_000)  # 2 x 4 x 400 MB = 3.2 GB > 1 GB
    plan = Plan(2, (Stage((0, 2), ("n0/a:0",), 2),))
    est = simulate(plan, big, cluster(gb=1.0))
    assert not est.fits and not est.stages[0].fits
    assert "n0/a:0" in est.not_fitting[0] and "> 1 GB" in est.not_fitting[0]
    assert est.to_dict()["fits"] is False


def test_gpipe_memory_counts_every_microbatch_in_flight() -> None:
    plan = Plan(8, (Stage((0, 4), ("n0/a:0",), 2),))
    est = simulate(plan, chain(4), cluster())
    assert est.stages[0].memory_bytes == 4 * 4000 + 4 * 2 * 400


def test_plan_must_match_the_profile() -> None:
    plan = Plan(4, (Stage((0, 3), ("n0/a:0",), 2),))
    with pytest.raises(ValueError, match="ends at 3 but profile 'chain' has 4 layers"):
        simulate(plan, chain(4), cluster())


def test_unknown_device_is_refused() -> None:
    plan = Plan(4, (Stage((0, 4), ("n9/a:0",), 2),))
    with pytest.raises(ValueError, match="unknown device 'n9/a:0'"):
        simulate(plan, chain(4), cluster())


def test_intra_node_link_when_all_on_one_node() -> None:
    net = Network(intra_node=Link(8.0, 0.0), inter_node=Link(1.0, 0.0))
    c = ClusterSpec("one", {"a": DeviceType("a", 1e9, 1.0)}, (Node("n0", {"a": 2}),), net)
    plan = Plan(2, (Stage((0, 1), ("n0/a:0",), 2), Stage((1, 2), ("n0/a:1",), 2)))
    est = simulate(plan, chain(2, act=1000), c)
    sends = [e for e in est.timeline if e.kind == "send"]
    assert sends[0].end - sends[0].start == pytest.approx(2000 / 1e9)


def test_comm_fraction_keeps_short_sends_of_a_long_batch_exact() -> None:
    """Rule 10 sums every send's duration; ``end - start`` at t ~ 1000 s would lose 2e-9 of it.

    S=2, B=1 across nodes, 1 layer each: F = 1e12 / 1e9 = 1000 s, Bk = 2000 s; no activation
    bytes, so each send (one forward, one gradient) is exactly the 50 us inter-node latency.
    """
    plan = Plan(1, (Stage((0, 1), ("n0/a:0",), 1), Stage((1, 2), ("n1/a:0",), 1)))
    est = simulate(plan, chain(2, flops=1e12, act=0, params=0), cluster())
    comm = 2 * 50e-6
    assert est.comm_fraction == pytest.approx(comm / (comm + 2 * 3000.0), rel=1e-12, abs=0)
    assert est.transfer_s == pytest.approx(comm, rel=1e-12, abs=0)
    b1 = next(e for e in est.timeline if (e.stage, e.kind) == (1, "B"))
    assert b1.start == pytest.approx(2000.0 + 50e-6, rel=1e-15)
    assert b1.end == pytest.approx(4000.0 + 50e-6, rel=1e-15)


def test_last_microbatch_holds_the_remainder_under_gpipe() -> None:
    """B=5: stage 0 b=2 (2, 2, 1 samples), stage 1 b=3 (3, 2), one layer each, across nodes.

    1 ms forward and 2 ms backward per sample; no parameters (no update). A send of n
    samples: 50 us + 100 B x n / 1.25e9 B/s.
      s0: F0 0-2, F1 2-4, F2 4-5 (1 sample); deliveries 2.05016, 4.05016, 5.05008
      s1: F0 (samples 0-2, last in s0's mb 1) 4.05016-7.05016, F1 (samples 3-4, s0's mb 2)
          7.05016-9.05016, B0 (3 samples) -15.05016, B1 -19.05016; gradients delivered
          15.1004 (3 samples) and 19.10032 (2)
      s0: B0 (samples 0-1, s1's mb 0) 15.1004-19.1004, B1 (samples 2-3, s1's mb 1)
          -23.1004, B2 (sample 4) -25.1004
    """
    plan = Plan(5, (Stage((0, 1), ("n0/a:0",), 2), Stage((1, 2), ("n1/a:0",), 3)))
    est = simulate(plan, chain(2, params=0), cluster())
    boxes = {(e.stage, e.kind, e.microbatch): (e.start, e.end) for e in est.timeline}
    assert boxes[(0, "F", 2)] == pytest.approx((0.004, 0.005), rel=1e-12)
    assert boxes[(0, "send", 2)] == pytest.approx((0.005, 0.00505008), rel=1e-12)
    assert boxes[(1, "F", 0)] == pytest.approx((0.00405016, 0.00705016), rel=1e-12)
    assert boxes[(1, "B", 1)] == pytest.approx((0.01505016, 0.01905016), rel=1e-12)
    assert boxes[(1, "grad", 0)] == pytest.approx((0.01505016, 0.0151004), rel=1e-12)
    assert boxes[(0, "B", 1)] == pytest.approx((0.0191004, 0.0231004), rel=1e-12)
    assert est.batch_time_s == pytest.approx(0.0251004, rel=1e-12)
    assert [s.microbatches for s in est.stages] == [3, 2]
    assert [s.compute_s for s in est.stages] == pytest.approx([0.015, 0.015], rel=1e-12)
    # GPipe holds every sample: 5 x 100 bytes
    assert [s.memory_bytes for s in est.stages] == pytest.approx([500.0, 500.0])


def test_one_f_one_b_warmups_count_samples_and_cannot_deadlock() -> None:
    # equal microbatches: S - s - 1, capped by M (with or without a remainder)
    assert one_f_one_b_warmups([4, 4, 4], 32) == [2, 1, 0]
    assert one_f_one_b_warmups([4, 4, 4], 6) == [2, 1, 0]
    assert one_f_one_b_warmups([8, 8, 8, 8], 8) == [1, 1, 1, 0]
    # unequal: what the stages after it hold, in the stage's own microbatches
    assert one_f_one_b_warmups([1, 2], 4) == [2, 0]
    assert one_f_one_b_warmups([2, 4, 4], 16) == [4, 1, 0]
    # b = (2, 9, 3), B = 17: stage 1's first backward needs all 17 samples forwarded
    # (its warm-up and F1), so stage 0 forwards all 9 of its microbatches before its B0
    # (8 warm-up forwards, then F8); ceil(12 / 2) = 6 would deadlock.
    assert one_f_one_b_warmups([2, 9, 3], 17) == [8, 1, 0]
    assert stage_orders(Schedule.ONE_F_ONE_B, [1, 2], 4) == [
        [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)],
    ]
    assert upstream_microbatch(1, 3, 2, 5) == 2  # samples 3-4: the last, 4, is in mb 2


def test_unequal_one_f_one_b_on_paper() -> None:
    """B=4, b=(1, 2) under 1F1B, one layer each, across nodes; no parameters.

    s0 warms up with 2 (what stage 1 holds: 2 samples) and runs F0 F1 F2 B0 F3 B1 B2 B3;
    s1 runs F0 B0 F1 B1. Sends: 50.08 us for 1 sample, 50.16 us for 2.
      s0: F0 0-1, F1 1-2, F2 2-3 (delivered 1.05008, 2.05008, 3.05008)
      s1: F0 (s0's mb 1) 2.05008-4.05008, B0 -8.05008 (gradient delivered 8.10024)
      s0: B0 8.10024-10.10024, F3 -11.10024 (delivered 11.15032)
      s1: F1 11.15032-13.15032, B1 -17.15032 (gradient delivered 17.20048)
      s0: B1 (s1's mb 0) 11.10024-13.10024, B2 (s1's mb 1) 17.20048-19.20048, B3 -21.20048
    Memory: s0 holds its first w + 1 = 3 microbatches (3 samples), s1 its first (2 samples).
    """
    plan = Plan(
        4, (Stage((0, 1), ("n0/a:0",), 1), Stage((1, 2), ("n1/a:0",), 2)), Schedule.ONE_F_ONE_B
    )
    est = simulate(plan, chain(2, params=0), cluster())
    boxes = {(e.stage, e.kind, e.microbatch): (e.start, e.end) for e in est.timeline}
    assert boxes[(0, "B", 0)] == pytest.approx((0.00810024, 0.01010024), rel=1e-12)
    assert boxes[(1, "F", 1)] == pytest.approx((0.01115032, 0.01315032), rel=1e-12)
    assert boxes[(0, "B", 1)] == pytest.approx((0.01110024, 0.01310024), rel=1e-12)
    assert boxes[(0, "B", 2)] == pytest.approx((0.01720048, 0.01920048), rel=1e-12)
    assert est.batch_time_s == pytest.approx(0.02120048, rel=1e-12)
    assert [s.memory_bytes for s in est.stages] == pytest.approx([300.0, 200.0])


def test_one_f_one_b_with_a_remainder_holds_its_first_microbatches() -> None:
    """B=5, b=2 on both stages under 1F1B: warm-ups (1, 0); stage 0 holds its first two
    microbatches (4 samples), stage 1 one (2 samples); the last one has 1 sample."""
    plan = Plan(
        5, (Stage((0, 1), ("n0/a:0",), 2), Stage((1, 2), ("n1/a:0",), 2)), Schedule.ONE_F_ONE_B
    )
    est = simulate(plan, chain(2, params=0), cluster())
    assert [s.memory_bytes for s in est.stages] == pytest.approx([400.0, 200.0])
    f2 = next(e for e in est.timeline if (e.stage, e.kind, e.microbatch) == (1, "F", 2))
    assert f2.end - f2.start == pytest.approx(0.001, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda batch: st.tuples(
            st.just(batch), st.lists(st.integers(1, batch), min_size=2, max_size=6)
        )
    )
)
def test_one_f_one_b_never_deadlocks(case: tuple[int, list[int]]) -> None:
    """Every stage runs all its ops, for any per-stage sizes and remainder."""
    batch, sizes = case
    n = len(sizes)
    ids = [f"n{k % 2}/a:{k // 2}" for k in range(n)]
    big = ClusterSpec(
        "big", {"a": DeviceType("a", 1e9, 1.0)}, (Node("n0", {"a": 3}), Node("n1", {"a": 3}))
    )
    stages = tuple(Stage((s, s + 1), (ids[s],), b) for s, b in enumerate(sizes))
    est = simulate(Plan(batch, stages, Schedule.ONE_F_ONE_B), chain(n), big)
    ops = sum(1 for e in est.timeline if e.kind in ("F", "B"))
    assert ops == 2 * sum(-(-batch // b) for b in sizes)
