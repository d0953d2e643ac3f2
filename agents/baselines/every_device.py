"""TAPP's baselines as the paper ran them: every device of the cluster, no search over which.

- :func:`bsp_all`: synchronous data parallelism, one stage holding every layer replicated
  on *every* device ("BSP"). The ``data_parallel`` planner also tries every fastest-first
  prefix of the devices and keeps the best; this is the literal baseline, slowest replica
  included.
- :func:`pipe_torch_all`: GPipe's equal split, equal layer counts over *every* device,
  fastest first ("Pipe-Torch"). The ``uniform`` planner also tries fewer stages.

Both take the microbatch size the cost model likes best among the problem's allowed sizes
(a fixed microbatch count is respected), and refuse with a :class:`~agents.problem.InfeasibleError`
when no such plan fits in memory.
"""

from __future__ import annotations

from pipeplan.agents.baselines.common import devices_fastest_first
from pipeplan.agents.problem import InfeasibleError, Problem
from pipeplan.core.costmodel import simulate
from pipeplan.core.plan import Plan, Stage, uniform_stages


def bsp_all(problem: Problem) -> Plan:
    """One stage on every device (replicas), the best allowed microbatch of at least one
    sample per replica."""
    ids = problem.cluster.device_ids
    devices = tuple(ids[i] for i in devices_fastest_first(problem.cluster))
    n = len(problem.profile)
    candidates = [
        Plan(problem.global_batch, (Stage((0, n), devices, m),), problem.schedule)
        for m in problem.microbatch_sizes()
        if m >= len(devices)  # every replica gets a share of every microbatch
    ]
    return _best(problem, candidates, f"BSP on all {len(devices)} devices")


def pipe_torch_all(problem: Problem) -> Plan:
    """Equal layer counts over every device, fastest first, the best allowed microbatch
    (as many stages as layers allow when there are more devices than layers)."""
    ids = problem.cluster.device_ids
    order = [ids[i] for i in devices_fastest_first(problem.cluster)]
    n = len(problem.profile)
    S = min(len(order), n)
    ranges = uniform_stages(n, S)
    candidates = [
        Plan(
            problem.global_batch,
            tuple(Stage(r, (order[s],), m) for s, r in enumerate(ranges)),
            problem.schedule,
        )
        for m in problem.microbatch_sizes()
    ]
    return _best(problem, candidates, f"Pipe-Torch over {S} devices")


def _best(problem: Problem, candidates: list[Plan], what: str) -> Plan:
    scored = []
    for plan in candidates:
        est = simulate(plan, problem.profile, problem.cluster)
        value = problem.score_estimate(est)
        scored.append((value, est.fits, plan))
    feasible = [(v, p) for v, fits, p in scored if fits and v != float("inf")]
    if not feasible:
        raise InfeasibleError(
            f"{what}: no microbatch size in {problem.microbatch_sizes()} gives a plan that "
            "fits in memory" + (" and meets min_throughput" if problem.min_throughput else "")
        )
    return min(feasible, key=lambda vp: vp[0])[1]
