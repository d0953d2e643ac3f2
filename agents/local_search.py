"""Local search over whole plans: one-edit neighbours and a steepest-descent polish.

:func:`neighbours` lists the plans one edit away from a plan (a boundary moved, devices
exchanged, a replica added or removed, stages merged or split), each with every allowed
equal microbatch size; :func:`polish` walks downhill over them from a search's best plan,
every step valued through the search (so through its reward source). PPO polishes its answer
with it, and ``bench/ppo_quality.py`` reports PPO with and without it.
"""

from __future__ import annotations

from itertools import permutations

from pipeplan.agents.problem import Problem
from pipeplan.agents.search import Search
from pipeplan.core.plan import Plan, Stage

StageSpec = tuple[int, int, tuple[str, ...]]
"""A stage as layers ``[start, end)`` on devices."""
StageList = list[StageSpec]


def neighbours(plan: Plan, problem: Problem) -> list[Plan]:
    """Plans one edit away from ``plan``, each with every allowed equal microbatch size.

    Edits: a stage boundary moved by 1-2 layers (also with the stages' device groups in
    every order, up to 4 stages), the device groups reordered, a stage's device exchanged
    with an unused one or with another stage's, a replica added or removed, two adjacent
    stages merged (on the devices of both, or of either), a stage split with one part on an
    unused device or on one of its replicas."""
    stages: StageList = [(s.start, s.end, s.devices) for s in plan.stages]
    unused = [d for d in problem.cluster.device_ids if d not in plan.devices]
    out = [edit for moved in _boundary_moves(stages) for edit in _reorderings(moved)]
    for k in range(len(stages)):
        out += _stage_edits(stages, k, unused)
    return [
        Plan(problem.global_batch, tuple(Stage((s, e), d, b) for s, e, d in new), plan.schedule)
        for new in out
        for b in problem.microbatch_sizes()
    ]


def _boundary_moves(stages: StageList) -> list[StageList]:
    """``stages`` itself, then each boundary moved by -2, -1, +1 or +2 layers."""
    moved: list[StageList] = [stages]
    for k in range(len(stages) - 1):  # move the boundary between k and k+1
        for step in (-2, -1, 1, 2):
            cut = stages[k][1] + step
            if stages[k][0] < cut < stages[k + 1][1]:
                new = list(stages)
                new[k] = (stages[k][0], cut, stages[k][2])
                new[k + 1] = (cut, stages[k + 1][1], stages[k + 1][2])
                moved.append(new)
    return moved


def _reorderings(stages: StageList) -> list[StageList]:
    """The stages with their device groups in every order (up to 4 stages; else as is)."""
    groups = [d for _, _, d in stages]
    orders = permutations(groups) if len(groups) <= 4 else iter([tuple(groups)])
    return [[(s, e, g) for (s, e, _), g in zip(stages, order, strict=True)] for order in orders]


def _stage_edits(stages: StageList, k: int, unused: list[str]) -> list[StageList]:
    """Edits of stage ``k``: a device exchanged (with an unused one or a later stage's), a
    replica removed or added, the stage split, merged with the next one."""
    s, e, devs = stages[k]
    out: list[StageList] = []
    for i, d in enumerate(devs):
        for u in unused:  # exchange a device for an unused one
            out.append(_with(stages, k, (s, e, (*devs[:i], u, *devs[i + 1 :]))))
        for j in range(k + 1, len(stages)):  # exchange with another stage's device
            for i2, d2 in enumerate(stages[j][2]):
                new = _with(stages, k, (s, e, (*devs[:i], d2, *devs[i + 1 :])))
                sj, ej, o = stages[j]
                out.append(_with(new, j, (sj, ej, (*o[:i2], d, *o[i2 + 1 :]))))
        if len(devs) > 1:  # remove a replica
            out.append(_with(stages, k, (s, e, (*devs[:i], *devs[i + 1 :]))))
    for u in unused:  # add a replica
        out.append(_with(stages, k, (s, e, (*devs, u))))
    for cut in range(s + 1, e):  # split off a new stage on an unused device or a replica
        for u in unused:
            out.append([*stages[:k], (s, cut, devs), (cut, e, (u,)), *stages[k + 1 :]])
            out.append([*stages[:k], (s, cut, (u,)), (cut, e, devs), *stages[k + 1 :]])
        for i, x in enumerate(devs if len(devs) > 1 else ()):
            rest = (*devs[:i], *devs[i + 1 :])
            out.append([*stages[:k], (s, cut, rest), (cut, e, (x,)), *stages[k + 1 :]])
            out.append([*stages[:k], (s, cut, (x,)), (cut, e, rest), *stages[k + 1 :]])
    if k + 1 < len(stages):  # merge with the next stage, on both's or either's devices
        after = stages[k + 1]
        for group in (devs + after[2], devs, after[2]):
            out.append([*stages[:k], (s, after[1], group), *stages[k + 2 :]])
    return out


def _with(stages: StageList, k: int, stage: StageSpec) -> StageList:
    return [*stages[:k], stage, *stages[k + 1 :]]


def polish(search: Search, evaluations: int) -> None:
    """Steepest-descent local search from the best plan over :func:`neighbours`, each step
    valued through ``search``, until no neighbour improves or ``evaluations`` are spent."""
    spent = 0
    while search.best_plan is not None and spent < evaluations and not search.exhausted():
        before = search.best_value
        plans = neighbours(search.best_plan, search.problem)[: evaluations - spent]
        if not plans:
            return
        search.evaluate_plans(plans)
        spent += len(plans)
        if not search.best_value < before:
            return
