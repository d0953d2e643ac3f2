"""``heterps_cpu_gpu``: HeterPS's baseline -- the first layer on the CPU, the rest on the GPU.

Two stages: layer 0 on CPU nodes (the lowest-FLOP/s type, HeterPS's data-intensive
embedding layer), layers ``[1, L)`` on the nodes of one GPU option. The GPU option, both
counts and the microbatch size are chosen (:func:`~agents.provision.counts.best_counts`:
exact for the bottleneck of that structure) and the best ``candidates`` of them simulated.
A one-layer model, or a catalogue of one speed, has no such split: one stage on the best
option. Deterministic; the seed is unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.agents.problem import InfeasibleError, Objective, Problem
from pipeplan.agents.provision.counts import best_counts
from pipeplan.agents.provision.exact import Found, evaluate_found
from pipeplan.agents.provision.kinds import Catalogue, StageCosts
from pipeplan.agents.registry import Planner
from pipeplan.agents.search import Search


@dataclass(frozen=True)
class CpuGpuConfig:
    """Options of ``heterps_cpu_gpu``."""

    candidates: int = 64
    """Best structures (GPU option x microbatch size, counts chosen) simulated."""

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise TypeError(f"candidates: must be >= 1, got {self.candidates!r}")


def split_options(catalogue: Catalogue) -> tuple[list[int], list[int]]:
    """Options of the CPU (the lowest-FLOP/s type) and of the GPUs (every other type)."""
    types = catalogue.cluster.device_types
    slowest = min(types[o.type].flops for o in catalogue.options)
    cpu = [k for k, o in enumerate(catalogue.options) if types[o.type].flops == slowest]
    gpu = [k for k, o in enumerate(catalogue.options) if types[o.type].flops != slowest]
    return cpu, gpu


class CpuGpuPlanner(Planner):
    """HeterPS's baseline: layer 0 on CPU nodes, the rest on one GPU kind, counts chosen."""

    name = "heterps_cpu_gpu"
    Config = CpuGpuConfig
    config: CpuGpuConfig

    def search(self, problem: Problem, search: Search) -> None:
        tables = search.evaluator.tables
        catalogue = Catalogue.of(problem.cluster, tables)
        cpu, gpu = split_options(catalogue)
        L = len(problem.profile)
        shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]
        if L >= 2 and cpu and gpu:
            shapes = [((0, 1, L), (c, g)) for c in cpu for g in gpu]
        else:
            shapes = [((0, L), (o,)) for o in range(len(catalogue.options))]
        tp = problem.min_throughput if problem.objective is Objective.COST else None
        t_max = problem.global_batch / tp if tp else float("inf")
        found: list[Found] = []
        for b in problem.microbatch_sizes():
            costs = StageCosts(problem, tables, catalogue, b)
            for bounds, options in shapes:
                f = best_counts(problem, catalogue, costs, bounds, options, t_max)
                if f is not None:
                    found.append(f)
        if not found:
            raise InfeasibleError(
                f"heterps_cpu_gpu on {problem.profile.name!r} / cluster "
                f"{problem.cluster.name!r}: no counts of a CPU stage (layer 0) and a GPU stage "
                "(the rest) fit in memory with a bottleneck bound reaching the target"
            )
        found.sort(key=lambda f: (f.value, f.bound))
        evaluate_found(search, catalogue, found[: self.config.candidates])
