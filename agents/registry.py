"""``make_planner(name, reward=None, **options)``: one interface over every searcher.

A planner is built with its options and the reward source that values its plans
(:mod:`agents.rewards`; the simulated cost model when none is given); :meth:`Planner.plan`
runs it on a problem through one :class:`~agents.search.Search`.
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pipeplan.agents.problem import PlanResult, Problem, ProblemError
from pipeplan.agents.rewards import RewardSource
from pipeplan.agents.search import OnRecord, Progress, Search

# name -> "module:Class"; modules are imported on demand (optuna, torch, ray stay unloaded)
PLANNERS: dict[str, str] = {
    "uniform": "pipeplan.agents.baselines.uniform:UniformPlanner",
    "balanced": "pipeplan.agents.baselines.balanced:BalancedPlanner",
    "data_parallel": "pipeplan.agents.baselines.data_parallel:DataParallelPlanner",
    "greedy": "pipeplan.agents.baselines.greedy:GreedyPlanner",
    "pipedream_dp": "pipeplan.agents.baselines.pipedream_dp:PipeDreamDPPlanner",
    "dp": "pipeplan.agents.baselines.dp:DPPlanner",
    "brute": "pipeplan.agents.baselines.brute:BrutePlanner",
    "genetic": "pipeplan.agents.provision.genetic_kinds:GeneticPlanner",  # kind-level on catalogues
    "bayes": "pipeplan.agents.baselines.bayes:BayesPlanner",
    "tapp": "pipeplan.agents.tapp.scale:TAPPPlanner",  # kind-level on clusters with counts
    "ppo": "pipeplan.agents.rllib_ppo:PPOPlanner",
    "provision_dp": "pipeplan.agents.provision.exact:ProvisionDPPlanner",
    "heterps_cpu_gpu": "pipeplan.agents.provision.cpu_gpu:CpuGpuPlanner",
    "heterps_rl": "pipeplan.agents.provision.rl:HeterPSRLPlanner",
}


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """This planner takes no options."""


class Planner(ABC):
    """A searcher: data in (a :class:`Problem`), a plan out. Never touches devices: a
    measured reward is a :class:`~agents.rewards.RewardSource` handed to it."""

    name: ClassVar[str]
    Config: ClassVar[type] = NoOptions
    needs_ray: ClassVar[bool] = False
    """Whether the planner itself runs on the current Ray cluster (RLlib's env runners): the
    face connects one (``executor.runtime``) before it plans; agents never start Ray."""

    def __init__(self, reward: RewardSource | None = None, **options: Any) -> None:
        self.reward = reward
        try:
            self.config = self.Config(**options)
        except TypeError as e:
            known = [f.name for f in dataclasses.fields(self.Config)]
            raise ProblemError(
                f"planner {self.name!r}: bad options {options}: {e} "
                f"(known options: {', '.join(known) or 'none'})"
            ) from None

    @property
    def options(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)

    def plan(
        self,
        problem: Problem,
        progress: Progress | None = None,
        on_record: OnRecord | None = None,
    ) -> PlanResult:
        """Search ``problem``; every evaluation goes through the reward source and is
        reported to ``progress`` and ``on_record`` (see :class:`~agents.search.Search`)."""
        search = Search(
            problem, self.name, self.options, progress, reward=self.reward, on_record=on_record
        )
        self.search(problem, search)
        return search.result()

    @abstractmethod
    def search(self, problem: Problem, search: Search) -> None:
        """Propose plans through ``search.evaluate`` until done or ``search.exhausted()``."""


def planner_class(name: str) -> type[Planner]:
    """The class of planner ``name``, its module imported on first use (optuna, torch and
    RLlib load only for the planners that need them)."""
    if name not in PLANNERS:
        raise ProblemError(f"planner: unknown planner {name!r} (one of {', '.join(PLANNERS)})")
    module, cls = PLANNERS[name].split(":")
    try:
        planner_cls: type[Planner] = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ProblemError(f"planner {name!r}: not available ({e})") from None
    return planner_cls


def make_planner(name: str, reward: RewardSource | None = None, **options: Any) -> Planner:
    """The planner ``name`` with ``options``, valued by ``reward`` (default: simulated)."""
    return planner_class(name)(reward=reward, **options)
