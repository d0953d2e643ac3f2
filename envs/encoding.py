"""TAPP layer encoding: 32 numbers per layer of a :class:`~core.profile.ModelProfile`.

TAPP (Mao et al. 2021) encodes each entry of the parameter library as an op-name word vector
(16 wide), three metrics (parameters MB, GFLOPs, activation MB; 4 wide each) and two
next-layer numbers (2 wide each, -0.1 when absent). The paper does not say how a "width" is
filled; here every width is a fixed, deterministic function of the profile, so the same model
always gives the same encoding (the env stays deterministic for ``check_env``, and a policy
trained on some models reads an unseen model in the same coordinates).

**Op name, 16 wide** (columns 0-15): a fixed word vector per op kind. Columns 0-12 are a
one-hot over :data:`core.profile.OPS` (TAPP's named conv, relu, pool, fc, pad, then the kinds
modern models add; TAPP's "Unknown" is ``other``). Columns 13-15 are shared attributes that
make related kinds alike: *has weights* (conv, fc, norm, embedding, attention), *cheap
elementwise / reshaping* (relu, pad, dropout, add, flatten) and *joins branches* (add,
concat). A learned embedding table would be no richer: the first linear layer of a network
over a one-hot *is* a learned embedding table, and keeping the encoding fixed keeps it out of
the env and identical across runs.

**Metrics, 4 wide each** (params MB at 16-19, GFLOPs at 20-23, activation MB at 24-27): four
continuous views of the one number ``v`` of layer ``i`` (rather than a quantised binary code,
whose neighbouring values can be far apart in Hamming distance, which a network generalises
poorly over):

- ``log10(1 + v / 1e-3) / 7``: absolute size on a log scale, 1 KB (1 MFLOP) ~ 0.04, 1 MB
  (1 GFLOP) ~ 0.43, 10 GB (10 TFLOP) ~ 1; the scale memory fit depends on;
- ``v / sum(v)``: share of the whole model; what a balanced partition balances;
- ``sum(v[:i]) / sum(v)``: share of the model *before* this layer; it tells a per-layer
  network where in the model's mass the layer sits (where cuts land), and makes the layers
  of repeated blocks distinguishable;
- ``v / max(v)``: size relative to the model's largest layer.

All four are in ``[0, 1]`` (the first is clipped) and 0 when the model's total is 0.

**Next layers, 2 wide each** (first successor at 28-29, second at 30-31): the nearest
successor and, when there are several, the farthest one (it decides how long an activation
stays live across cuts); successors in between are dropped. Each successor ``s`` of layer
``i`` in an ``L``-layer model is ``(s / L, log(s - i) / log(L))``: where it is, and how far it
skips (0 for the next layer). Absent successors are ``(-0.1, -0.1)`` as in the paper.
"""

from __future__ import annotations

import math

import numpy as np

from pipeplan.core.profile import OPS, ModelProfile

WIDTH = 32
"""Values per layer."""
OP_SLICE = slice(0, 16)
PARAMS_SLICE = slice(16, 20)
FLOPS_SLICE = slice(20, 24)
ACTIVATION_SLICE = slice(24, 28)
NEXT_SLICE = slice(28, 32)
ABSENT = -0.1
"""The value of a next-layer number that does not exist."""

_WEIGHTED = frozenset({"conv", "fc", "norm", "embedding", "attention"})
_ELEMENTWISE = frozenset({"relu", "pad", "dropout", "add", "flatten"})
_JOINS = frozenset({"add", "concat"})


def op_vector(op: str) -> np.ndarray:
    """The fixed 16-wide word vector of an op kind (``other`` for unknown kinds)."""
    v = np.zeros(16, dtype=np.float32)
    v[OPS.index(op) if op in OPS else OPS.index("other")] = 1.0
    v[13] = float(op in _WEIGHTED)
    v[14] = float(op in _ELEMENTWISE)
    v[15] = float(op in _JOINS)
    return v


def metric_features(values: np.ndarray) -> np.ndarray:
    """(L,) sizes in MB or GFLOPs -> (L, 4): log scale, share, share before, ratio to max."""
    v = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
    total, largest = v.sum(), v.max(initial=0.0)
    out = np.zeros((len(v), 4))
    out[:, 0] = np.minimum(np.log10(1.0 + v / 1e-3) / 7.0, 1.0)
    if total > 0:
        out[:, 1] = v / total
        out[:, 2] = np.minimum((np.cumsum(v) - v) / total, 1.0)
    if largest > 0:
        out[:, 3] = v / largest
    return out


def next_features(i: int, successors: tuple[int, ...], n_layers: int) -> np.ndarray:
    """The two next-layer numbers of layer ``i``, 2 wide each (-0.1 where absent)."""
    out = np.full(4, ABSENT)
    succ = sorted(successors)
    picked = succ[:1] + (succ[-1:] if len(succ) > 1 else [])
    scale = math.log(max(n_layers, 2))
    for k, s in enumerate(picked):
        out[2 * k] = s / n_layers
        out[2 * k + 1] = min(math.log(max(s - i, 1)) / scale, 1.0)
    return out


def encode_profile(profile: ModelProfile) -> np.ndarray:
    """(L, 32) float32: the TAPP encoding of every layer (see the module docstring)."""
    layers = profile.layers
    n = len(layers)
    out = np.zeros((n, WIDTH), dtype=np.float32)
    for i, layer in enumerate(layers):
        out[i, OP_SLICE] = op_vector(layer.op)
        out[i, NEXT_SLICE] = next_features(i, layer.successors, n)
    out[:, PARAMS_SLICE] = metric_features(np.array([x.params_bytes / 1e6 for x in layers]))
    out[:, FLOPS_SLICE] = metric_features(np.array([x.flops / 1e9 for x in layers]))
    out[:, ACTIVATION_SLICE] = metric_features(np.array([x.activation_bytes / 1e6 for x in layers]))
    return out
