"""TAPP's networks: a feed-forward partition network, attention allocation networks and a
microbatch head, held together by :class:`TAPPPolicy`.

The partition network scores "open the next group" for one layer; the allocation network
is scaled dot-product attention of one query over a set of keys (a group over the devices,
or a left-over device over the groups and "idle"); the stage-microbatch head scores each
allowed microbatch size for one stage (UMPIPE's unequal sizes). Their inputs are built in
:mod:`agents.tapp.features` and the decisions drawn in :mod:`agents.tapp.sampling`. Every
width is fixed, so one policy plans any model on any cluster.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from pipeplan.agents.tapp.features import (
    KEY_IN,
    LAYER_IN,
    MICROBATCH_IN,
    PARTITION_IN,
    QUERY_IN,
    REPLICA_KEY_IN,
    REPLICA_QUERY_IN,
    STAGE_SIZE_IN,
)


def _mlp(n_in: int, hidden: int, n_out: int, last_std: float = 0.0) -> nn.Sequential:
    """Two tanh hidden layers. The output layer starts with zero bias and small weights
    (``last_std``, or 1% of PyTorch's default when 0): outputs near the prior / uniform."""
    last = nn.Linear(hidden, n_out)
    nn.init.zeros_(last.bias)
    if last_std > 0:
        nn.init.normal_(last.weight, std=last_std)
    else:
        last.weight.data.mul_(0.01)
    return nn.Sequential(
        nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), last
    )


class PartitionNet(nn.Module):
    """(..., PARTITION_IN) -> (...,) logit of "open the next group" (before the prior).

    The input is a layer's features (the first ``LAYER_IN``) then the decision's state.
    :meth:`layer_part` and :meth:`from_layer_part` compute the same logit in two parts, so
    that a sampler multiplies each layer's features by the first linear layer once per
    layer, not once per plan and decision."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = _mlp(PARTITION_IN, hidden, 1)

    def forward(self, layers: Tensor) -> Tensor:
        out: Tensor = self.net(layers).squeeze(-1)
        return out

    def layer_part(self, layer_inputs: Tensor) -> Tensor:
        """(..., LAYER_IN) -> (..., hidden): the layer features through the first linear
        layer's columns for them, bias included."""
        first = cast(nn.Linear, self.net[0])
        return F.linear(layer_inputs, first.weight[:, :LAYER_IN], first.bias)

    def from_layer_part(self, layer_part: Tensor, state: Tensor) -> Tensor:
        """The logit from :meth:`layer_part`'s output and the state columns, (..., 3)."""
        first = cast(nn.Linear, self.net[0])
        out: Tensor = self.net[1:](layer_part + F.linear(state, first.weight[:, LAYER_IN:]))
        return out.squeeze(-1)


class AllocationNet(nn.Module):
    """Scaled dot-product attention of one query over a set of keys: a group over the
    devices (primary allocation) or a left-over device over the groups and "idle"."""

    def __init__(
        self, hidden: int, dim: int, query_in: int = QUERY_IN, key_in: int = KEY_IN
    ) -> None:
        super().__init__()
        self.query = _mlp(query_in, hidden, dim, last_std=0.1)
        self.key = _mlp(key_in, hidden, dim, last_std=0.1)
        self.dim = dim

    def forward(self, query_in: Tensor, key_in: Tensor) -> Tensor:
        """(P, query_in), (P, K, key_in) -> (P, K) scores."""
        q, k = self.query(query_in), self.key(key_in)
        scores: Tensor = (k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(self.dim)
        return scores


class TAPPPolicy(nn.Module):
    """The five heads of a TAPP plan: microbatch (shared), partition, allocation, replicas,
    and each stage's own microbatch size."""

    def __init__(self, hidden: int = 64, attention_dim: int = 32) -> None:
        super().__init__()
        self.hidden, self.attention_dim = hidden, attention_dim
        self.microbatch = _mlp(MICROBATCH_IN, hidden, 1)
        self.partition = PartitionNet(hidden)
        self.allocation = AllocationNet(hidden, attention_dim)
        self.replica = AllocationNet(hidden, attention_dim, REPLICA_QUERY_IN, REPLICA_KEY_IN)
        self.stage_microbatch = _mlp(STAGE_SIZE_IN, hidden, 1)

    def save(self, path: str | Path | IO[bytes]) -> None:
        """Write the policy (its widths and weights) to ``path`` (a file name or an open
        binary file), for :meth:`load`."""
        torch.save(
            {
                "hidden": self.hidden,
                "attention_dim": self.attention_dim,
                "state": self.state_dict(),
            },
            path,
        )

    @classmethod
    def load(cls, path: str | Path) -> TAPPPolicy:
        """A policy saved by :meth:`save`. One saved before the stage-microbatch head existed
        loads with that head freshly initialised (seeded: every such load gives the same)."""
        doc = torch.load(path, weights_only=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            policy = cls(int(doc["hidden"]), int(doc["attention_dim"]))
        missing, unexpected = policy.load_state_dict(doc["state"], strict=False)
        absent = [k for k in missing if not k.startswith("stage_microbatch.")]
        if absent or unexpected:
            raise ValueError(
                f"{path}: not a TAPP policy: missing {absent}, unexpected {list(unexpected)}"
            )
        return policy
