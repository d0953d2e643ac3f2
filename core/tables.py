"""The priced problem: every table the cost model reads, built once per (profile, cluster).

:class:`CostTables` holds rule 1's per-layer times on each device type (measured timings,
else the FLOP fallback), their prefix and range sums, the prefix sums of parameter and
activation bytes, rule 3's cut bytes, each device's type, node, memory, memory bandwidth,
FLOP/s and price, and the two link classes of rule 4. The simulator, the population
evaluator, the env, TAPP's features and the classical planners read these arrays instead of
building their own. :meth:`CostTables.of` returns the tables of a (profile, cluster) pair,
building them on first use; profiles and clusters are immutable, so the pair's identity is
the key.

Rule 4 decides a link by *sets* of devices (inter-node when any pair crosses nodes), so the
tables keep each device's node and the two classes' latency and bytes/s
(:data:`INTRA`, :data:`INTER`), not a device-by-device matrix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec, DeviceType
from pipeplan.core.profile import ModelProfile

FloatArray = np.ndarray
IntArray = np.ndarray

INTRA, INTER = 0, 1
"""Indices of the two link classes in :attr:`CostTables.link_lat` and ``link_bps`` (rule 4's
sends) and ``ring_lat`` and ``ring_bps`` (rule 8's ring rounds)."""


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer forward/backward cost on one device type: ``fixed + n * per_sample``."""

    fwd_fixed: FloatArray
    fwd_per_sample: FloatArray
    bwd_fixed: FloatArray
    bwd_per_sample: FloatArray


def layer_costs(profile: ModelProfile, dtype: DeviceType, scale: float = 1.0) -> LayerCosts:
    """Rule 1: measured timings where the profile has them, else ``flops / device flops``
    forward and :data:`~core.rules.BACKWARD_FLOPS_RATIO` times that backward; rule 1c:
    every time times the calibrated compute ``scale`` of the type."""
    rows = []
    for layer in profile.layers:
        t = layer.timings.get(dtype.name)
        if t is not None:
            rows.append((t.fwd_fixed_s, t.fwd_s, t.bwd_fixed_s, t.bwd_s))
        else:
            fwd = rules.flops_forward_s(layer.flops, dtype.flops)
            rows.append((0.0, fwd, 0.0, rules.BACKWARD_FLOPS_RATIO * fwd))
    a = np.array(rows, dtype=np.float64).reshape(len(profile), 4) * scale
    return LayerCosts(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy())


def cut_bytes(profile: ModelProfile) -> FloatArray:
    """Rule 3: ``X[c]`` = activation bytes per sample crossing a cut before layer ``c``.

    A layer ``l < c`` counts when any of its successors is ``>= c`` (skips are relayed): it
    crosses the cuts ``l + 1 .. max(successors)``. Summed in integers, so exactly.
    """
    n = len(profile)
    delta = np.zeros(n + 2, dtype=np.int64)
    for i, layer in enumerate(profile.layers):
        last = max(layer.successors, default=i)
        if last > i:
            delta[i + 1] += layer.activation_bytes
            delta[last + 1] -= layer.activation_bytes
    x = np.cumsum(delta[: n + 1]).astype(np.float64)
    x[0] = x[n] = 0.0
    return x


def prefix_sums(values: FloatArray) -> FloatArray:
    """``out[i] = values[0] + ... + values[i-1]`` along the last axis, ``out[..., 0] == 0``."""
    values = np.asarray(values, dtype=np.float64)
    out = np.zeros((*values.shape[:-1], values.shape[-1] + 1))
    out[..., 1:] = np.cumsum(values, axis=-1)
    return out


def range_sums(values: FloatArray) -> FloatArray:
    """``out[a, b] = values[a] + ... + values[b-1]`` summed left to right (0 when b <= a)."""
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for e in range(1, n + 1):
        out[:e, e] = out[:e, e - 1] + values[e - 1]
    return out


class CostTables:
    """The tables of one profile on one cluster (see the module docstring).

    Layer arrays are indexed ``[t, l]`` with ``t`` into :attr:`types` (sorted type names)
    and prefix sums ``[..., i]`` over layers ``0 .. i-1``; device arrays are indexed like
    ``cluster.device_ids``.
    """

    _cache: ClassVar[OrderedDict[tuple[int, int], CostTables]] = OrderedDict()
    CACHED: ClassVar[int] = 8
    """How many (profile, cluster) pairs :meth:`of` keeps."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec) -> None:
        self.profile, self.cluster = profile, cluster
        self.types: tuple[str, ...] = tuple(sorted(cluster.device_types))
        self.type_index = {t: i for i, t in enumerate(self.types)}
        self._layers(profile, cluster)
        self._devices(cluster)
        net = cluster.links
        self.link_lat = np.array([net.intra_node.latency_s, net.inter_node.latency_s])
        self.link_bps = np.array([net.intra_node.bytes_per_s, net.inter_node.bytes_per_s])
        self.ring_lat = np.array([net.intra_node.ring_latency_s, net.inter_node.ring_latency_s])
        self.ring_bps = np.array([net.intra_node.ring_bytes_per_s, net.inter_node.ring_bytes_per_s])

    def _layers(self, profile: ModelProfile, cluster: ClusterSpec) -> None:
        cal = cluster.calibration
        # rule 1c: the type's compute scale times the model's (both 1 where not fitted)
        model = cal.model(profile.model_key) if cal and cal.model_scale else 1.0
        scale = [cal.scale(t) * model if cal else 1.0 for t in self.types]
        costs = [
            layer_costs(profile, cluster.device_types[t], k)
            for t, k in zip(self.types, scale, strict=True)
        ]
        # rule 1c: seconds added to each forward and each backward call of a replica, (T,)
        calls = [cal.overhead(t) if cal else None for t in self.types]
        self.fwd_call = np.array([c.fwd_s if c else 0.0 for c in calls])
        self.bwd_call = np.array([c.bwd_s if c else 0.0 for c in calls])
        self.step_overhead = cal.step_overhead_s if cal else 0.0
        L = len(profile)
        self.fwd_fixed = np.stack([c.fwd_fixed for c in costs]).reshape(-1, L)
        self.fwd_per_sample = np.stack([c.fwd_per_sample for c in costs]).reshape(-1, L)
        self.bwd_fixed = np.stack([c.bwd_fixed for c in costs]).reshape(-1, L)
        self.bwd_per_sample = np.stack([c.bwd_per_sample for c in costs]).reshape(-1, L)
        # forward + backward of each layer, summed over layers: (T, L+1)
        self.fb_fixed_prefix = prefix_sums(self.fwd_fixed + self.bwd_fixed)
        self.fb_per_sample_prefix = prefix_sums(self.fwd_per_sample + self.bwd_per_sample)
        self.params_prefix = prefix_sums(np.array([x.params_bytes for x in profile.layers]))
        self.acts_prefix = prefix_sums(np.array([x.activation_bytes for x in profile.layers]))
        self.flops_prefix = prefix_sums(np.array([x.flops for x in profile.layers]))
        self.cuts = cut_bytes(profile)

    def _devices(self, cluster: ClusterSpec) -> None:
        devs = [cluster.device(d) for d in cluster.device_ids]
        nodes = {n.name: i for i, n in enumerate(cluster.nodes)}
        dts = [cluster.device_types[d.type] for d in devs]
        self.dev_type = np.array([self.type_index[d.type] for d in devs], dtype=np.int64)
        self.dev_node = np.array([nodes[d.node] for d in devs], dtype=np.int64)
        self.dev_flops = np.array([t.flops for t in dts], dtype=np.float64)
        self.dev_membw = np.array(  # rule 8's update bandwidth, the calibration's where fitted
            [cluster.memory_bandwidth_gbps(d.type) for d in devs], dtype=np.float64
        )
        self.dev_capacity = np.array([t.memory_bytes for t in dts], dtype=np.float64)
        self.dev_price = np.array([t.price_per_hour for t in dts], dtype=np.float64)

    @classmethod
    def of(cls, profile: ModelProfile, cluster: ClusterSpec) -> CostTables:
        """The tables of ``(profile, cluster)``, built on the first call for the pair and
        kept for the last :attr:`CACHED` pairs."""
        key = (id(profile), id(cluster))
        hit = cls._cache.get(key)
        if hit is not None and hit.profile is profile and hit.cluster is cluster:
            cls._cache.move_to_end(key)
            return hit
        tables = cls(profile, cluster)
        cls._cache[key] = tables
        while len(cls._cache) > cls.CACHED:
            cls._cache.popitem(last=False)
        return tables

    # --- range sums: (T, L+1, L+1), [t, a, b] = layers a .. b-1, for populations -----------

    # The fixed parts include rule 1c's call overhead of the type for every non-empty range:
    # a range is one stage's call.

    @cached_property
    def fwd_fixed_range(self) -> FloatArray:
        return _with_call(np.stack([range_sums(v) for v in self.fwd_fixed]), self.fwd_call)

    @cached_property
    def fwd_per_sample_range(self) -> FloatArray:
        return np.stack([range_sums(v) for v in self.fwd_per_sample])

    @cached_property
    def bwd_fixed_range(self) -> FloatArray:
        return _with_call(np.stack([range_sums(v) for v in self.bwd_fixed]), self.bwd_call)

    @cached_property
    def bwd_per_sample_range(self) -> FloatArray:
        return np.stack([range_sums(v) for v in self.bwd_per_sample])

    @cached_property
    def params_range(self) -> FloatArray:
        """(L+1, L+1) parameter bytes of layers ``a .. b-1`` (0 when b <= a)."""
        return _between(self.params_prefix)

    @cached_property
    def acts_range(self) -> FloatArray:
        """(L+1, L+1) activation bytes per sample of layers ``a .. b-1`` (0 when b <= a)."""
        return _between(self.acts_prefix)

    # --- per range and device ---------------------------------------------------------------

    def params(self, start: IntArray | int, end: IntArray | int) -> FloatArray:
        """Parameter bytes of layers ``[start, end)`` (exact: integer byte counts)."""
        return self.params_prefix[end] - self.params_prefix[start]

    def acts(self, start: IntArray | int, end: IntArray | int) -> FloatArray:
        """Activation bytes per sample of layers ``[start, end)``."""
        return self.acts_prefix[end] - self.acts_prefix[start]

    def fb_time(
        self,
        t: IntArray | int,
        start: IntArray | int,
        end: IntArray | int,
        samples: FloatArray | float,
    ) -> FloatArray:
        """Rules 1 and 1c for forward + backward of layers ``[start, end)`` on type ``t`` and
        ``samples`` samples, from the prefix sums (one call each way)."""
        fixed = self.fb_fixed_prefix[t, end] - self.fb_fixed_prefix[t, start]
        fixed = fixed + self.fwd_call[t] + self.bwd_call[t]
        per = self.fb_per_sample_prefix[t, end] - self.fb_per_sample_prefix[t, start]
        return rules.compute_s(fixed, per, samples)


def _with_call(ranges: FloatArray, call: FloatArray) -> FloatArray:
    """``ranges[t, a, b] + call[t]`` where ``b > a`` (a stage), unchanged elsewhere."""
    n = ranges.shape[-1]
    stage = np.triu(np.ones((n, n), dtype=bool), k=1)
    return np.where(stage[None], ranges + call[:, None, None], ranges)


def _between(prefix: FloatArray) -> FloatArray:
    out = prefix[None, :] - prefix[:, None]
    return np.where(out > 0, out, 0.0)
