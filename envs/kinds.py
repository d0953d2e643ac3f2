"""The placement MDP by kinds and counts: the pure functions of :class:`envs.kind_env.
KindPlacementEnv` (the gymnasium shell).

On a cluster whose nodes are given with counts (``count: N``, DESIGN.md) identical nodes are
interchangeable, and an episode decides what the kind-level planners decide
(:mod:`agents.provision.kinds`): the microbatch size, then stage after stage its **option**
(a device type on the nodes of one kind), its **node count** (it runs on every device of that
type on ``n`` whole nodes, as replicas) and its **end** (the last layer it holds). A stage
takes the first free nodes of its kind, so plans equal up to renaming identical nodes are
one plan, and an episode is ``1 + 3 S`` steps for ``S`` stages however many devices there
are. The options come from the caller (a list of ``(type, kind)`` and each kind's node names),
so this module needs nothing but :mod:`core`.

Masks (what "action masking" keeps out): the size first (when there are several); an
option whose kind has no free node, or any option once ``max_stages`` stages are open; more
nodes than its kind has free; an end before the stage's start; an end before the last layer
when no node would be left for the rest; and ends whose stage would not fit its devices'
memory (rule 9 at the chosen size; for 1F1B, whose holding depends on the stages after it,
as for the last stage: only sure misfits), unless no end fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.objective import Objective
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.envs.mdp import legal_action

PHASES = 4
"""Decision kinds, in an episode's order: size, option, node count, end."""
SIZE, OPTION, NODES, END = range(PHASES)
OPTION_FEATURES = 3
"""Per option: FLOP/s over the fastest, memory over the largest, free nodes of its kind."""
END_FEATURES = 2
"""Per end slot: the stage's load ``t / (t + T)`` if it ends there, and whether it fits."""
WORK_PER_FLOP = 1.0 + rules.BACKWARD_FLOPS_RATIO
"""Forward plus backward FLOPs per forward FLOP (rule 1 without timings)."""


@dataclass(frozen=True)
class KindOption:
    """A way to staff a stage: every device of ``type`` on nodes of kind ``kind``."""

    type: str
    kind: int
    per_node: int


@dataclass(frozen=True)
class KindInstance:
    """Everything fixed during an episode. ``params``, ``acts`` and ``flops`` are prefix
    sums over layers (``x[b] - x[a]``: layers ``a..b-1``); ``fair_s`` is the compute bound
    of the whole batch on the whole cluster (3 x forward FLOPs over its FLOP/s), the scale
    of the end features' loads and of the reward."""

    profile: ModelProfile
    cluster: ClusterSpec
    objective: Objective
    global_batch: int
    schedule: Schedule
    min_throughput: float | None
    sizes: tuple[int, ...]
    options: tuple[KindOption, ...]
    kind_nodes: tuple[tuple[str, ...], ...]
    max_stages: int
    params: np.ndarray
    acts: np.ndarray
    flops: np.ndarray
    fair_s: float

    @property
    def n_layers(self) -> int:
        return len(self.profile)

    @property
    def max_nodes(self) -> int:
        return max(len(n) for n in self.kind_nodes)

    @property
    def option_offset(self) -> int:
        return len(self.sizes)

    @property
    def nodes_offset(self) -> int:
        return self.option_offset + len(self.options)

    @property
    def end_offset(self) -> int:
        return self.nodes_offset + self.max_nodes

    @property
    def n_actions(self) -> int:
        return self.end_offset + self.n_layers


def make_kind_instance(
    profile: ModelProfile,
    cluster: ClusterSpec,
    options: list[tuple[str, int]],
    kind_nodes: list[list[str]],
    sizes: list[int],
    *,
    objective: str = "time",
    global_batch: int = 64,
    schedule: str = "gpipe",
    min_throughput: float | None = None,
    max_stages: int | None = None,
) -> KindInstance:
    """An instance from plain data (what an env config holds); a ``ValueError`` naming the
    field and the value when something does not fit the cluster."""
    if not kind_nodes or any(not nodes for nodes in kind_nodes):
        raise ValueError(f"kind_nodes: every kind needs at least one node, got {kind_nodes!r}")
    by_name = {n.name: n for n in cluster.nodes}
    for nodes in kind_nodes:
        for name in nodes:
            if name not in by_name:
                raise ValueError(f"kind_nodes: no node {name!r} in cluster {cluster.name!r}")
    opts = []
    for t, k in options:
        if not 0 <= k < len(kind_nodes):
            raise ValueError(f"options: kind {k} of ({t!r}, {k}) not in 0..{len(kind_nodes) - 1}")
        per_node = by_name[kind_nodes[k][0]].devices.get(t, 0)
        if per_node < 1:
            raise ValueError(f"options: nodes of kind {k} have no device of type {t!r}")
        opts.append(KindOption(t, k, per_node))
    if not opts:
        raise ValueError("options: at least one option is needed, got none")
    if not sizes or any(global_batch % b or b < 1 for b in sizes):
        raise ValueError(f"sizes: divisors of global_batch {global_batch} needed, got {sizes!r}")
    if Objective(objective) is Objective.COST:
        raise ValueError("objective: the kind-level MDP plans the batch time, got 'cost'")
    if max_stages is not None and max_stages < 1:
        raise ValueError(f"max_stages: must be >= 1, got {max_stages!r}")
    layers = profile.layers
    flops = _prefix([x.flops for x in layers])
    types = cluster.device_types
    total_flops = sum(c * types[t].flops for n in cluster.nodes for t, c in n.devices.items())
    cap = min(len(layers), sum(len(n) for n in kind_nodes), max_stages or len(layers))
    return KindInstance(
        profile=profile,
        cluster=cluster,
        objective=Objective(objective),
        global_batch=global_batch,
        schedule=Schedule(schedule),
        min_throughput=min_throughput,
        sizes=tuple(sorted(set(sizes))),
        options=tuple(opts),
        kind_nodes=tuple(tuple(n) for n in kind_nodes),
        max_stages=cap,
        params=_prefix([x.params_bytes for x in layers]),
        acts=_prefix([x.activation_bytes for x in layers]),
        flops=flops,
        fair_s=float(WORK_PER_FLOP * flops[-1] * global_batch / total_flops),
    )


def _prefix(xs: list[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(xs, dtype=np.float64))])


@dataclass(frozen=True)
class KindState:
    """The size chosen (index into ``sizes``, -1: not yet), the stages so far as ``(start,
    option, nodes)`` (``nodes`` 0 while not chosen), and ``layer``: the first layer no
    closed stage holds."""

    size: int
    stages: tuple[tuple[int, int, int], ...]
    layer: int


def initial_state(inst: KindInstance) -> KindState:
    return KindState(-1 if len(inst.sizes) > 1 else 0, (), 0)


def phase(inst: KindInstance, state: KindState) -> int:
    """What the next action decides (:data:`SIZE` .. :data:`END`)."""
    if state.size < 0:
        return SIZE
    if state.stages and state.stages[-1][0] == state.layer < inst.n_layers:
        return NODES if state.stages[-1][2] == 0 else END
    return OPTION


def is_terminal(inst: KindInstance, state: KindState) -> bool:
    return state.layer >= inst.n_layers


def free_nodes(inst: KindInstance, state: KindState) -> np.ndarray:
    """(kinds,) nodes of each kind no stage takes."""
    used = np.zeros(len(inst.kind_nodes), dtype=np.int64)
    for _, o, n in state.stages:
        used[inst.options[o].kind] += n
    return np.array([len(k) for k in inst.kind_nodes]) - used


def stage_memory(inst: KindInstance, state: KindState, start: int, ends: np.ndarray) -> np.ndarray:
    """Rule 9 per device of the open stage for each end (layers ``[start, end]``)."""
    _, o, n = state.stages[-1]
    b = inst.sizes[state.size]
    share = rules.replica_share(b, n * inst.options[o].per_node)
    held = rules.in_flight(inst.schedule, inst.global_batch // b, 1)
    params = inst.params[ends + 1] - inst.params[start]
    acts = inst.acts[ends + 1] - inst.acts[start]
    return np.asarray(rules.memory_bytes(params, acts, share, held), dtype=np.float64)


def action_mask(inst: KindInstance, state: KindState) -> np.ndarray:
    """(n_actions,) bool: the legal actions (module docstring); at least one."""
    mask = np.zeros(inst.n_actions, dtype=bool)
    if is_terminal(inst, state):
        mask[inst.end_offset + inst.n_layers - 1] = True
        return mask
    ph, free = phase(inst, state), free_nodes(inst, state)
    if ph == SIZE:
        mask[: inst.option_offset] = True
    elif ph == OPTION:
        kinds = np.array([o.kind for o in inst.options])
        mask[inst.option_offset : inst.nodes_offset] = free[kinds] > 0
    elif ph == NODES:
        left = int(free[inst.options[state.stages[-1][1]].kind])
        mask[inst.nodes_offset : inst.nodes_offset + left] = True
    else:
        mask[inst.end_offset :] = _end_mask(inst, state, free)
    return mask


def _end_mask(inst: KindInstance, state: KindState, free: np.ndarray) -> np.ndarray:
    start, L = state.layer, inst.n_layers
    ends = np.arange(L)
    ok = ends >= start
    if free.sum() == 0 or len(state.stages) >= inst.max_stages:
        ok &= ends == L - 1
    fits = ok.copy()
    fits[ok] = stage_memory(inst, state, start, ends[ok]) <= _capacity(inst, state)
    return fits if fits.any() else ok


def _capacity(inst: KindInstance, state: KindState) -> float:
    t = inst.options[state.stages[-1][1]].type
    return float(rules.capacity_bytes(inst.cluster.device_types[t].memory_gb))


def transition(inst: KindInstance, state: KindState, action: int) -> KindState:
    """The state after a legal ``action``."""
    ph = phase(inst, state)
    if ph == SIZE:
        return replace(state, size=action)
    if ph == OPTION:
        o = action - inst.option_offset
        return replace(state, stages=(*state.stages, (state.layer, o, 0)))
    if ph == NODES:
        start, o, _ = state.stages[-1]
        n = action - inst.nodes_offset + 1
        return replace(state, stages=(*state.stages[:-1], (start, o, n)))
    return replace(state, layer=action - inst.end_offset + 1)


def replay(
    inst: KindInstance, actions: tuple[int, ...], steps: int
) -> tuple[KindState, tuple[int, ...]]:
    """The state after the first ``steps`` of ``actions``, each made legal (an elite start:
    the prefix of an earlier episode), and the actions taken."""
    state, taken = initial_state(inst), []
    for a in actions[:steps]:
        if is_terminal(inst, state):
            break
        a = legal_action(action_mask(inst, state), int(a))
        state = transition(inst, state, a)
        taken.append(a)
    return state, tuple(taken)


def to_plan(inst: KindInstance, state: KindState) -> Plan:
    """The plan of a terminal state: each stage on every device of its type on the first
    free nodes of its kind."""
    taken = [0] * len(inst.kind_nodes)
    ends = [s for s, _, _ in state.stages[1:]] + [inst.n_layers]
    stages = []
    for (start, o, n), end in zip(state.stages, ends, strict=True):
        opt = inst.options[o]
        names = inst.kind_nodes[opt.kind][taken[opt.kind] : taken[opt.kind] + n]
        taken[opt.kind] += n
        devices = tuple(f"{name}/{opt.type}:{c}" for name in names for c in range(opt.per_node))
        stages.append(Stage((start, end), devices, inst.sizes[state.size]))
    return Plan(inst.global_batch, tuple(stages), inst.schedule)


def reward(inst: KindInstance, value: float) -> float:
    """``fair_s / value`` (1: the compute bound reached), 0 for an infeasible plan."""
    if not np.isfinite(value) or value <= 0:
        return 0.0
    return inst.fair_s / value


# --- observation -----------------------------------------------------------------------------


def observation_size(inst: KindInstance) -> int:
    return global_size(inst) + OPTION_FEATURES * len(inst.options) + END_FEATURES * inst.n_layers


def global_size(inst: KindInstance) -> int:
    return PHASES + 4 + len(inst.options) + len(inst.kind_nodes)


def observe(inst: KindInstance, state: KindState) -> np.ndarray:
    """Features in [-1, 1]: the phase, progress, stages opened, the size, the open stage's
    option and nodes, free nodes per kind; per option its speed, memory and free nodes;
    per end slot the open stage's load and whether it fits (zeros outside the end phase)."""
    ph = phase(inst, state) if not is_terminal(inst, state) else END
    free = free_nodes(inst, state)
    avail = np.array([len(k) for k in inst.kind_nodes], dtype=np.float64)
    g = np.zeros(global_size(inst))
    g[ph] = 1.0
    g[PHASES] = state.layer / inst.n_layers
    g[PHASES + 1] = len(state.stages) / inst.max_stages
    b = inst.sizes[max(state.size, 0)]
    g[PHASES + 2] = np.log(b) / np.log(inst.global_batch) if state.size >= 0 else 0.0
    at = PHASES + 4
    if state.stages and ph in (NODES, END):
        _, o, n = state.stages[-1]
        g[at + o] = 1.0
        g[PHASES + 3] = n / inst.max_nodes
    g[at + len(inst.options) :] = free / avail
    types = inst.cluster.device_types
    fastest = max(types[o.type].flops for o in inst.options)
    largest = max(types[o.type].memory_gb for o in inst.options)
    opt = np.array(
        [
            [types[o.type].flops / fastest, types[o.type].memory_gb / largest]
            + [free[o.kind] / avail[o.kind]]
            for o in inst.options
        ]
    ).ravel()
    ends = np.zeros((inst.n_layers, END_FEATURES))
    if ph == END and not is_terminal(inst, state):
        _, o, n = state.stages[-1]
        start = state.layer
        js = np.arange(start, inst.n_layers)
        r = n * inst.options[o].per_node
        work = WORK_PER_FLOP * (inst.flops[js + 1] - inst.flops[start])
        t = work * inst.global_batch / (r * types[inst.options[o].type].flops)
        ends[js, 0] = t / (t + inst.fair_s)
        fits = stage_memory(inst, state, start, js) <= _capacity(inst, state)
        ends[js, 1] = np.where(fits, 1.0, -1.0)
    return np.clip(np.concatenate([g, opt, ends.ravel()]), -1.0, 1.0).astype(np.float32)
