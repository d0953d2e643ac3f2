"""What both gymnasium shells of the placement MDPs share (:class:`envs.env.PlacementEnv`,
:class:`envs.kind_env.KindPlacementEnv`): the ``{"observations", "action_mask"}``
observation, the mask a step's action is checked against (a masked action becomes the first
allowed one) and the episode's actions; ``step`` over the MDP's pure functions, which each
shell names once (:class:`MDP`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from pipeplan.core.plan import Plan
from pipeplan.envs.mdp import legal_action, outcome

Step = tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]


@dataclass(frozen=True)
class MDP:
    """An MDP's pure functions of ``(instance, state)`` that a shell steps with."""

    action_mask: Callable[[Any, Any], np.ndarray]
    observe: Callable[[Any, Any], np.ndarray]
    is_terminal: Callable[[Any, Any], bool]
    transition: Callable[[Any, Any, int], Any]
    to_plan: Callable[[Any, Any], Plan]
    reward: Callable[[Any, float], float]


class MaskedShell(gym.Env[dict[str, np.ndarray], int]):
    """``step`` and the observation of a placement MDP; a subclass names its :class:`MDP`
    and holds ``instance`` and ``state``."""

    mdp: MDP
    instance: Any
    state: Any
    mask: np.ndarray
    actions: list[int]  # this episode's, its start's included

    def _obs(self) -> dict[str, np.ndarray]:
        mask = self.mdp.action_mask(self.instance, self.state)
        self.mask = np.asarray(mask, dtype=np.float32)  # step() checks the action on it
        return {
            "observations": self.mdp.observe(self.instance, self.state),
            "action_mask": self.mask,
        }

    def step(self, action: int) -> Step:
        inst, mdp = self.instance, self.mdp
        if mdp.is_terminal(inst, self.state):
            raise RuntimeError("step() after the episode ended; call reset()")
        chosen = legal_action(self.mask, int(action))
        self.state = mdp.transition(inst, self.state, chosen)
        self.actions.append(chosen)
        info: dict[str, Any] = {"action": chosen, "repaired": chosen != int(action)}
        if not mdp.is_terminal(inst, self.state):
            return self._obs(), 0.0, False, False, info
        value, end = outcome(inst, mdp.to_plan(inst, self.state), self.actions)
        info.update(end)
        return self._obs(), float(mdp.reward(inst, value)), True, False, info
