"""Gymnasium MDP of pipeline placement: :mod:`envs.config` (the config and its checks),
:mod:`envs.mdp` (the pure MDP), :mod:`envs.env` (the gymnasium shell) and
:mod:`envs.encoding` (TAPP's layer encoding); at production scale, the MDP by node kinds and
counts: :mod:`envs.kinds` (pure) and :mod:`envs.kind_env` (its shell).

Importing this package registers :data:`ENV_ID` with gymnasium:
``gymnasium.make("pipeplan/Placement-v0", config={...})``. RLlib gets :class:`PlacementEnv`
itself in ``agents/rllib_ppo.py``; nothing here imports Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium

from pipeplan.envs.config import EnvConfigError
from pipeplan.envs.encoding import WIDTH, encode_profile
from pipeplan.envs.env import PlacementEnv
from pipeplan.envs.kind_env import KindPlacementEnv

ENV_ID = "pipeplan/Placement-v0"


def make_env(config: Mapping[str, Any]) -> PlacementEnv:
    """A :class:`PlacementEnv` from a config dict (RLlib passes an ``EnvContext``, a dict)."""
    return PlacementEnv(dict(config))


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="pipeplan.envs.env:PlacementEnv")

__all__ = [
    "ENV_ID",
    "WIDTH",
    "EnvConfigError",
    "KindPlacementEnv",
    "PlacementEnv",
    "encode_profile",
    "make_env",
]
