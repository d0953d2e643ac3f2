"""Benchmark instances shared by the planning benchmarks: models x clusters."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np

from pipeplan.core.cluster import ClusterSpec, DeviceType, Link, Network, Node
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.profile import LayerTiming, ModelProfile
from pipeplan.core.tables import layer_costs

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("local-hetero", "tapp-paper", "cloud-mix")
ZOO = {  # name -> (zoo name, input size, options): sizes small enough to profile quickly
    "alexnet": ("alexnet", 64, {}),
    "vgg16": ("vgg16", 32, {}),
    "inception_v3": ("inception_v3", 75, {}),
    "resnet50": ("resnet50", 32, {}),
    "gpt": ("gpt", 64, {"n_layer": 12}),
}
PIPEDREAM = ("pipedream-alexnet", "pipedream-resnet18")
WEIGHT_READS = "+weights"  # model-name suffix: per-call weight-read costs (weight_reads)


@dataclass(frozen=True)
class Instance:
    model: str
    cluster: str
    profile: ModelProfile
    spec: ClusterSpec

    @property
    def name(self) -> str:
        return f"{self.model}@{self.cluster}"


@cache
def model_profile(name: str) -> ModelProfile:
    """Analytic zoo profiles (FLOP-based times) or PipeDream's measured GPU profiles."""
    if name.startswith("pipedream-"):
        model = name.removeprefix("pipedream-")
        path = ROOT / "tests" / "data" / "pipedream" / f"{model}.graph.txt"
        # PipeDream timed these on a V100-class GPU at minibatch 256
        return load_pipedream(path, 256, "v100", name=name)
    from pipeplan.models import profiler, zoo

    zname, size, options = ZOO[name]
    module, example = zoo.build(zname, size, **options)
    return profiler.profile_model(module, example, name=name, device_type=None)


def random_cluster(seed: int) -> ClusterSpec:
    """A small heterogeneous cluster: 2-3 nodes, 4-5 devices of 2-3 types."""
    rng = np.random.default_rng(seed)
    kinds = {
        "cpu": DeviceType("cpu", 1.0e12, 64, 100, 0.68),
        "t4": DeviceType("t4", 8.1e12, 16, 320, 0.526),
        "v100": DeviceType("v100", 1.57e13, 16, 900, 3.06),
        "a100": DeviceType("a100", 1.95e13, 40, 1555, 4.10),
    }
    names = list(rng.choice(list(kinds), size=int(rng.integers(2, 4)), replace=False))
    nodes, total = [], int(rng.integers(4, 6))
    for k in range(int(rng.integers(2, 4))):
        nodes.append({str(names[k % len(names)]): 1})
    for _ in range(total - len(nodes)):
        node = nodes[int(rng.integers(len(nodes)))]
        t = str(rng.choice(names))
        node[t] = node.get(t, 0) + 1
    used = {t for n in nodes for t in n}
    net = Network(Link(100.0, 5.0), Link(float(rng.choice([10.0, 25.0])), 50.0))
    return ClusterSpec(
        f"random{seed}",
        {t: kinds[t] for t in used},
        tuple(Node(f"n{i}", d) for i, d in enumerate(nodes)),
        net,
    )


def cluster(name: str) -> ClusterSpec:
    if name.startswith("random"):
        return random_cluster(int(name.removeprefix("random")))
    return ClusterSpec.load(ROOT / "examples" / "clusters" / f"{name}.yaml")


def weight_reads(profile: ModelProfile, spec: ClusterSpec) -> ModelProfile:
    """The profile with a fixed cost per call on every device type of ``spec``: a roofline
    term for streaming the layer's weights from device memory once per call (forward: read
    the weights; backward: read them and write their gradients, twice the bytes), on top of
    the per-sample times the profile already has (or FLOP-derived ones, rule 1).

    Analytic profiles cost a call linearly in its samples, so the microbatch size only moves
    fill, drain and per-transfer latency; real kernels pay per call (the DESIGN's AlexNet
    classifier: ~0.24 s per call), which is what unequal microbatches (UMPIPE) trade on.
    """
    costs = {name: layer_costs(profile, t) for name, t in spec.device_types.items()}
    layers = []
    for i, layer in enumerate(profile.layers):
        timings = dict(layer.timings)
        for name, t in spec.device_types.items():
            c, read = costs[name], layer.params_bytes / (t.memory_bandwidth_gbps * 1e9)
            timings[name] = LayerTiming(
                float(c.fwd_per_sample[i]),
                float(c.bwd_per_sample[i]),
                float(c.fwd_fixed[i]) + read,
                float(c.bwd_fixed[i]) + 2 * read,
            )
        layers.append(replace(layer, timings=timings))
    return replace(profile, name=profile.name + WEIGHT_READS, layers=tuple(layers))


def instance(model: str, cluster_name: str) -> Instance:
    """``model`` may end in :data:`WEIGHT_READS` for :func:`weight_reads` on that cluster."""
    spec = cluster(cluster_name)
    base = model.removesuffix(WEIGHT_READS)
    profile = model_profile(base)
    if base != model:
        profile = weight_reads(profile, spec)
    return Instance(model, cluster_name, profile, spec)


def instances(models: list[str], clusters: list[str]) -> list[Instance]:
    return [instance(m, c) for m in models for c in clusters]
