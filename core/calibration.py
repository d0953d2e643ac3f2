"""A cluster's calibration: what measured runs taught the cost model about this cluster.

``pipeplan calibrate`` fits it (:mod:`executor.calibrate`) and writes it into the cluster
spec as a ``calibration:`` block; the cost model then uses it (DESIGN.md's contract, rules
1c, 4 and 8c):

- ``compute_scale[TYPE]``: a replica's forward and backward on ``TYPE`` last ``scale x`` the
  sum of their layers' times (rule 1). Layers are profiled one at a time; a stage runs them
  in one call, so the sum can miss (timer and cache effects, cores shared with other stages).
- ``model_scale[MODEL]``: every layer time of the model whose profile has that
  :attr:`~core.profile.ModelProfile.model_key` is multiplied by it too, on every type: what
  the runs of that model's plans took over what its profiles predict. A model of small
  operations (a GPT of a few ms per layer) runs further from its profile than a model of
  large convolutions on the same devices, and a profile is measured at one moment of a
  machine whose speed drifts; one factor per model, fitted to that model's runs, learns
  both without moving the other models' predictions.
- ``call_overhead[TYPE] = {fwd, bwd}``: seconds added to every forward and every backward
  a replica of ``TYPE`` runs: what a stage call costs beyond its layers (the actor call,
  unpacking the input and cloning it for its gradient, packing the output).
- ``network``: the two link classes' sends, fitted (rule 4); the spec's own ``network`` is
  kept beside it, for reference, and is what an uncalibrated copy uses.
- ``all_reduce``: the two link classes' ring rounds, fitted (rule 8r): the bandwidth and
  latency of a round of the replicas' ring all-reduce, which on a shared host is not a lone
  send (``python -m bench.links``) and moves with the machine, so a fit to replicated plans'
  runs learns it instead of trusting the spec's ``network.<class>.all_reduce``.
- ``memory_bandwidth_gbps[TYPE]``: the bandwidth (GB/s) rule 8's update (and rule 2b's
  accumulation) uses on ``TYPE`` instead of the spec's: what the optimizer step a stage
  worker runs really streams at there. Rule 8 has one bandwidth per type for every
  optimizer, and an update shares the memory with whatever runs beside it, so the spec's
  number (the memory's own) can be far from what the runs see (SGD with momentum streams
  more than plain SGD; replicas updating at once on one host share it).
- ``step_overhead_s``: seconds added to every batch time (rule 8c): the driver's part of a
  step (putting the batch, submitting every operation, collecting the results).
- ``fit``: a free-form record of how it was fitted (runs, held-out errors, date), shown to
  people and never read by the cost model.

A spec without the block, or with every term at its default (scale 1, overheads 0, the
spec's network and memory bandwidths), costs plans exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeplan.core import _io
from pipeplan.core.errors import FormatError

MIN_SCALE, MAX_SCALE = 0.1, 10.0
"""Bounds of a compute scale: outside them a fit is wrong, not a cluster."""


@dataclass(frozen=True)
class CallOverhead:
    """Seconds added to each forward and each backward of one replica."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """The fitted terms of one cluster (module docstring). Links are in the spec's units:
    Gbit/s and microseconds."""

    compute_scale: Mapping[str, float] = field(default_factory=dict)
    call_overhead: Mapping[str, CallOverhead] = field(default_factory=dict)
    network: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Link class (``intra_node``, ``inter_node``) -> (bandwidth_gbps, latency_us) of a send."""
    all_reduce: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Link class -> (bandwidth_gbps, latency_us) of a ring all-reduce round."""
    step_overhead_s: float = 0.0
    fit: Mapping[str, Any] = field(default_factory=dict)
    memory_bandwidth_gbps: Mapping[str, float] = field(default_factory=dict)
    """Device type -> the bandwidth (GB/s) of rule 8's update on it."""
    model_scale: Mapping[str, float] = field(default_factory=dict)
    """Model key (:attr:`core.profile.ModelProfile.model_key`) -> the factor on its layers."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute_scale", _io.FrozenMap(dict(self.compute_scale)))
        object.__setattr__(self, "model_scale", _io.FrozenMap(dict(self.model_scale)))
        object.__setattr__(self, "call_overhead", _io.FrozenMap(dict(self.call_overhead)))
        object.__setattr__(self, "network", _io.FrozenMap(dict(self.network)))
        object.__setattr__(self, "all_reduce", _io.FrozenMap(dict(self.all_reduce)))
        object.__setattr__(
            self, "memory_bandwidth_gbps", _io.FrozenMap(dict(self.memory_bandwidth_gbps))
        )
        for t, s in self.compute_scale.items():
            if not MIN_SCALE <= s <= MAX_SCALE:
                raise FormatError(
                    f"calibration.compute_scale.{t}: must be in [{MIN_SCALE:g}, {MAX_SCALE:g}], "
                    f"got {s!r}"
                )
        for key, s in self.model_scale.items():
            if not (isinstance(key, str) and key):
                raise FormatError(
                    f"calibration.model_scale: keys must be model keys (NAME@SHAPE:HASH), "
                    f"got {key!r}"
                )
            if not (isinstance(s, int | float) and MIN_SCALE <= s <= MAX_SCALE):
                raise FormatError(
                    f"calibration.model_scale.{key}: must be in [{MIN_SCALE:g}, {MAX_SCALE:g}], "
                    f"got {s!r}"
                )
        for t, bw in self.memory_bandwidth_gbps.items():
            if not (isinstance(bw, int | float) and math.isfinite(bw) and bw > 0):
                raise FormatError(
                    f"calibration.memory_bandwidth_gbps.{t}: must be a number > 0, got {bw!r}"
                )
        _check_link_classes(self.network, "network")
        _check_link_classes(self.all_reduce, "all_reduce")

    def scale(self, device_type: str) -> float:
        return float(self.compute_scale.get(device_type, 1.0))

    def model(self, model_key: str) -> float:
        """The factor on the layers of the model with ``model_key`` (1 when not fitted)."""
        return float(self.model_scale.get(model_key, 1.0))

    def overhead(self, device_type: str) -> CallOverhead:
        return self.call_overhead.get(device_type, CallOverhead())

    def check_types(self, known: Mapping[str, Any]) -> None:
        """Every type named must be one of the cluster's."""
        for where, names in (
            ("compute_scale", self.compute_scale),
            ("call_overhead", self.call_overhead),
            ("memory_bandwidth_gbps", self.memory_bandwidth_gbps),
        ):
            for t in names:
                if t not in known:
                    raise FormatError(
                        f"calibration.{where}: unknown device type {t!r} "
                        f"(known: {', '.join(sorted(known))})"
                    )

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "compute_scale": dict(self.compute_scale),
            "call_overhead": {
                t: {"fwd_s": o.fwd_s, "bwd_s": o.bwd_s} for t, o in self.call_overhead.items()
            },
            "step_overhead_s": self.step_overhead_s,
        }
        if self.memory_bandwidth_gbps:
            doc["memory_bandwidth_gbps"] = dict(self.memory_bandwidth_gbps)
        if self.model_scale:
            doc["model_scale"] = dict(self.model_scale)
        for key, links in (("network", self.network), ("all_reduce", self.all_reduce)):
            if links:
                doc[key] = {
                    k: {"bandwidth_gbps": bw, "latency_us": lat} for k, (bw, lat) in links.items()
                }
        if self.fit:
            doc["fit"] = dict(self.fit)
        return doc

    @classmethod
    def from_dict(cls, doc: Any) -> Calibration:
        where = "calibration"
        if not isinstance(doc, Mapping):
            raise FormatError(f"{where}: expected an object, got {doc!r}")
        _io.known_keys(doc, where, KEYS)
        scales = _mapping(doc, "compute_scale")
        overheads = _mapping(doc, "call_overhead")
        links = _mapping(doc, "network")
        rings = _mapping(doc, "all_reduce")
        fit = _mapping(doc, "fit")
        bandwidths = _mapping(doc, "memory_bandwidth_gbps")
        models = _mapping(doc, "model_scale")
        _check_link_classes(links, "network")  # before parsing them, so the name comes first
        _check_link_classes(rings, "all_reduce")
        return cls(
            compute_scale={str(t): _io.number(scales, t, f"{where}.compute_scale") for t in scales},
            call_overhead={
                str(t): CallOverhead(
                    _io.number(o, "fwd_s", f"{where}.call_overhead.{t}", 0.0),
                    _io.number(o, "bwd_s", f"{where}.call_overhead.{t}", 0.0),
                )
                for t, o in overheads.items()
            },
            network={str(k): _link(v, f"{where}.network.{k}") for k, v in links.items()},
            all_reduce={str(k): _link(v, f"{where}.all_reduce.{k}") for k, v in rings.items()},
            step_overhead_s=_io.number(doc, "step_overhead_s", where, 0.0),
            fit=dict(fit),
            memory_bandwidth_gbps={
                str(t): _io.number(bandwidths, t, f"{where}.memory_bandwidth_gbps")
                for t in bandwidths
            },
            model_scale={str(m): _io.number(models, m, f"{where}.model_scale") for m in models},
        )


LINK_CLASSES = ("intra_node", "inter_node")
KEYS = frozenset(
    {
        "compute_scale",
        "call_overhead",
        "network",
        "all_reduce",
        "step_overhead_s",
        "fit",
        "memory_bandwidth_gbps",
        "model_scale",
    }
)


def _check_link_classes(names: Mapping[str, Any], where: str) -> None:
    for key in names:
        if key not in LINK_CLASSES:
            raise FormatError(
                f"calibration.{where}: unknown link class {key!r} "
                f"(known: {', '.join(LINK_CLASSES)})"
            )


def _mapping(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = doc.get(key) or {}
    if not isinstance(value, Mapping):
        raise FormatError(f"calibration.{key}: expected an object, got {value!r}")
    return value


def _link(doc: Any, where: str) -> tuple[float, float]:
    bandwidth = _io.number(doc, "bandwidth_gbps", where)
    if not bandwidth > 0:
        raise FormatError(f"{where}.bandwidth_gbps: must be > 0, got {bandwidth!r}")
    return bandwidth, _io.number(doc, "latency_us", where)
