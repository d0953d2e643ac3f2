"""The placement MDP as plain functions of explicit state: one episode cuts one model into
pipeline stages and places them.

:class:`Instance` is what stays fixed during an episode (the problem and the tables the
functions read; :func:`envs.config.make_instance` builds it), :class:`State` what an action
changes. :func:`initial_state`, :func:`action_mask`, :func:`transition`, :func:`is_terminal`,
:func:`to_plan`, :func:`plan_value`, :func:`reward` and :func:`observe` are the whole
dynamics; :class:`envs.env.PlacementEnv` is a thin gymnasium shell around them. Values come
from the contract cost model and :func:`core.objective.score`, so the MDP is deterministic;
measured rewards are a reward source of the planners, never computed here.

An episode may first choose the microbatch count (when the config offers several), then
places layers one per step; a step right after opening a stage may instead add a replica
device to it. So the action space holds every plan of equal microbatches that
``brute`` enumerates (DESIGN.md, "Planners"), not only one device per stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from core import rules
from core.cluster import ClusterSpec
from core.costmodel import Estimate
from core.objective import Objective, score
from core.plan import Plan, Schedule, Stage
from core.profile import ModelProfile
from envs.encoding import WIDTH

DEVICE_FEATURES = 5
"""Per device: speed, memory left, remaining layers fit, used, holds the open stage."""
GLOBAL_FEATURES = 10
"""Progress, layers left, stages opened, open stage size, its FLOP share, its load, its
replicas, the closed stages' worst load, the microbatch size, choosing the microbatch."""


# --- the static problem of an episode ---------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """Everything fixed during an episode: the problem and the tables the pure functions read
    (taken from :class:`core.tables.CostTables`, per device).

    Prefix sums run over layers: ``params[b] - params[a]`` is the parameter bytes of layers
    ``a..b-1``; ``fixed[d, b] - fixed[d, a] + n * (per_sample[d, b] - per_sample[d, a])``
    their forward + backward seconds for ``n`` samples on device ``d`` (index into
    ``cluster.device_ids``). ``counts`` are the microbatch counts an episode may use (one:
    fixed, no choosing step).
    """

    profile: ModelProfile
    cluster: ClusterSpec
    objective: Objective
    global_batch: int
    counts: tuple[int, ...]
    schedule: Schedule
    min_throughput: float | None
    min_stages: int
    max_stages: int
    max_replicas: int
    lookahead: int
    infeasible_reward: float
    encoding: np.ndarray  # (L, 32)
    params: np.ndarray  # (L+1,)
    acts: np.ndarray  # (L+1,)
    flops: np.ndarray  # (L+1,)
    fixed: np.ndarray  # (D, L+1)
    per_sample: np.ndarray  # (D, L+1)
    capacity: np.ndarray  # (D,) bytes
    speed: np.ndarray  # (D,) flops / fastest flops
    node: np.ndarray  # (D,) node index
    reference: float  # objective value of the whole batch at once on the best single device

    @property
    def n_layers(self) -> int:
        return len(self.profile)

    @property
    def n_devices(self) -> int:
        return len(self.capacity)

    @property
    def chooses_microbatches(self) -> bool:
        return len(self.counts) > 1

    @property
    def replica_offset(self) -> int:
        """First "add a replica" action (``1 + D``)."""
        return 1 + self.n_devices

    @property
    def count_offset(self) -> int:
        """First "choose a microbatch count" action."""
        return self.replica_offset + (self.n_devices if self.max_replicas > 1 else 0)

    @property
    def n_actions(self) -> int:
        return self.count_offset + (len(self.counts) if self.chooses_microbatches else 0)

    def stage_time(self, d: int, start: int, end: int, samples: float) -> float:
        """Forward + backward seconds of layers ``[start, end)`` for ``samples`` on ``d``."""
        fixed = self.fixed[d, end] - self.fixed[d, start]
        per_sample = self.per_sample[d, end] - self.per_sample[d, start]
        return float(rules.compute_s(fixed, per_sample, samples))


# --- state, mask, transition -----------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """Layers ``0..layer-1`` are placed; stage ``k`` starts at ``starts[k]`` on the devices
    ``devices[k]`` (the first opened it, the rest are replicas). ``count`` indexes the
    instance's microbatch counts (-1: not chosen yet); ``closed``: the agent ended the
    episode at the last layer instead of adding a replica."""

    layer: int
    starts: tuple[int, ...]
    devices: tuple[tuple[int, ...], ...]
    count: int
    closed: bool = False

    @property
    def used(self) -> tuple[int, ...]:
        return tuple(d for devs in self.devices for d in devs)


def initial_state(inst: Instance) -> State:
    return State(0, (), (), -1 if inst.chooses_microbatches else 0)


def microbatch_size(inst: Instance, state: State) -> int:
    """Samples per microbatch (that of the first count while none is chosen)."""
    return inst.global_batch // inst.counts[max(state.count, 0)]


def in_flight(inst: Instance, state: State) -> int:
    """Microbatches held per stage for the memory mask: exact for GPipe; for 1F1B the stage
    count is not known yet, so the lower bound 1 (mask only sure misfits)."""
    count = inst.counts[max(state.count, 0)]
    return int(rules.in_flight(inst.schedule, count, 1))  # 1F1B: as if the last stage


def stage_memory(inst: Instance, state: State, start: int, end: int, replicas: int) -> float:
    """Rule 9 for layers ``[start, end)`` on each of ``replicas`` devices."""
    params = inst.params[end] - inst.params[start]
    acts = inst.acts[end] - inst.acts[start]
    share = microbatch_size(inst, state) / replicas
    return float(rules.memory_bytes(params, acts, share, in_flight(inst, state)))


def _replica_slots(inst: Instance, state: State) -> bool:
    """Whether the open stage may take a replica now: right after it was opened (it holds
    one layer), below ``max_replicas``, an unused device left beyond those that the stages
    ``min_stages`` still needs."""
    if inst.max_replicas < 2 or not state.starts or state.closed:
        return False
    if state.layer - state.starts[-1] != 1 or len(state.devices[-1]) >= inst.max_replicas:
        return False
    free = inst.n_devices - len(state.used)
    return free - 1 >= max(inst.min_stages - len(state.starts), 0)


def is_terminal(inst: Instance, state: State) -> bool:
    """Every layer is placed and the last stage takes no more replicas (or the agent chose
    to stay)."""
    return state.layer >= inst.n_layers and (state.closed or not _replica_slots(inst, state))


def structural_mask(inst: Instance, state: State) -> np.ndarray:
    """(n_actions,) bool: actions that keep the plan valid (contiguous, no device twice, stage
    count within ``[min_stages, max_stages]``, replicas within ``max_replicas``, one
    microbatch count chosen first). Always allows at least one action."""
    D = inst.n_devices
    mask = np.zeros(inst.n_actions, dtype=bool)
    if is_terminal(inst, state):
        mask[0] = True
        return mask
    if state.count < 0:
        mask[inst.count_offset :] = True
        return mask
    free = np.ones(D, dtype=bool)
    free[np.asarray(state.used, dtype=np.int64)] = False
    if _replica_slots(inst, state):
        mask[inst.replica_offset : inst.replica_offset + D] = free
    if state.layer >= inst.n_layers:  # only replicas or "stay" (= close) remain
        mask[0] = True
        return mask
    opened = len(state.starts)
    layers_left = inst.n_layers - state.layer
    must_open = opened == 0 or inst.min_stages - opened >= layers_left
    mask[0] = not must_open
    if opened < inst.max_stages:
        mask[1 : 1 + D] = free
    return mask


def memory_mask(inst: Instance, state: State) -> np.ndarray:
    """(n_actions,) bool: actions whose stage still fits all its devices' memory after this
    step (choosing the microbatch count is never masked for memory)."""
    i, D = state.layer, inst.n_devices
    mask = np.zeros(inst.n_actions, dtype=bool)
    if is_terminal(inst, state):
        mask[0] = True
        return mask
    mask[inst.count_offset :] = True
    if state.count < 0:
        return mask
    if state.starts:
        start, devs = state.starts[-1], state.devices[-1]
        worst = inst.capacity[list(devs)].min()
        end = min(i + 1, inst.n_layers)
        mask[0] = i >= inst.n_layers or (stage_memory(inst, state, start, end, len(devs)) <= worst)
        if inst.max_replicas > 1:  # the new replica holds the stage's (one-layer) share
            need = stage_memory(inst, state, start, i, len(devs) + 1)
            mask[inst.replica_offset : inst.replica_offset + D] = need <= inst.capacity
    if i < inst.n_layers:
        mask[1 : 1 + D] = stage_memory(inst, state, i, i + 1, 1) <= inst.capacity
    return mask


def action_mask(inst: Instance, state: State) -> np.ndarray:
    """(n_actions,) float32 of 0/1: structurally valid actions that also fit in memory; when
    none fits, the structurally valid ones (the plan will then be infeasible, not invalid)."""
    valid = structural_mask(inst, state)
    fitting = valid & memory_mask(inst, state)
    return (fitting if fitting.any() else valid).astype(np.float32)


def transition(inst: Instance, state: State, action: int) -> State:
    """Apply one (allowed) action: 0 keeps layer ``state.layer`` in the open stage (at the
    end: closes the episode), ``1..D`` opens a stage on device ``action - 1``, then adds a
    replica device to the open stage, then chooses a microbatch count."""
    if action >= inst.count_offset:
        return replace(state, count=action - inst.count_offset)
    if action >= inst.replica_offset:
        d = action - inst.replica_offset
        return replace(state, devices=(*state.devices[:-1], (*state.devices[-1], d)))
    if action == 0:
        if state.layer >= inst.n_layers:
            return replace(state, closed=True)
        return replace(state, layer=state.layer + 1)
    return State(
        state.layer + 1,
        (*state.starts, state.layer),
        (*state.devices, (action - 1,)),
        state.count,
    )


def legal_action(mask: np.ndarray, action: int) -> int:
    """``action`` when the mask allows it, else the first allowed action (deterministic)."""
    if 0 <= action < len(mask) and mask[action] > 0:
        return action
    return int(np.flatnonzero(mask > 0)[0])


# --- plan, value, reward ---------------------------------------------------------------------


def to_plan(inst: Instance, state: State) -> Plan:
    """The plan of a terminal state: its stages and replicas, equal microbatches."""
    ids = inst.cluster.device_ids
    ends = (*state.starts[1:], inst.n_layers)
    b = microbatch_size(inst, state)
    stages = tuple(
        Stage((s, e), tuple(ids[d] for d in devs), b)
        for s, e, devs in zip(state.starts, ends, state.devices, strict=True)
    )
    return Plan(inst.global_batch, stages, inst.schedule)


def plan_value(inst: Instance, est: Estimate) -> float:
    """The objective value of a simulated plan (``inf`` when it is infeasible)."""
    value = score(
        inst.objective,
        np.array([est.batch_time_s]),
        np.array([est.fits]),
        np.array([est.cost_per_hour]),
        global_batch=inst.global_batch,
        min_throughput=inst.min_throughput,
    )
    return float(value[0])


def reward(inst: Instance, value: float) -> float:
    """``reference / value``: 1 = as good as the best single device computing the whole batch
    at once (no communication, no update); a pipeline over ``n`` devices can approach ``n``.
    Infeasible plans get ``infeasible_reward``; a plan that costs nothing (a model of zero
    cost) 1."""
    if not np.isfinite(value):
        return inst.infeasible_reward
    return inst.reference / value if value > 0 else 1.0


# --- observation -----------------------------------------------------------------------------


def observation_size(n_devices: int, lookahead: int) -> int:
    return WIDTH * (1 + lookahead) + DEVICE_FEATURES * n_devices + GLOBAL_FEATURES


def _load(inst: Instance, state: State, start: int, end: int, devs: tuple[int, ...]) -> float:
    """``t / (t + T / D)``: a stage's microbatch time on its slowest replica against the
    whole model's on the fastest device spread over all devices."""
    b = microbatch_size(inst, state)
    t = max(inst.stage_time(d, start, end, b / len(devs)) for d in devs)
    balanced = min(inst.stage_time(d, 0, inst.n_layers, b) for d in range(inst.n_devices))
    balanced /= inst.n_devices
    return t / (t + balanced) if t + balanced > 0 else 0.0


def observe(inst: Instance, state: State) -> np.ndarray:
    """Flat float32 vector in ``[-1, 1]``: encodings of layers ``i..i+lookahead`` (zero rows
    past the end), then per device (speed, memory left, remaining layers fit, used, holds the
    open stage), then global features (progress, layers left, stages opened, open stage size,
    its FLOP share, its load, its replicas, the closed stages' worst load, the microbatch size
    ``log b / log B``, choosing the microbatch count)."""
    L, D, i = inst.n_layers, inst.n_devices, min(state.layer, inst.n_layers)
    rows = np.zeros((1 + inst.lookahead, WIDTH), dtype=np.float32)
    ahead = inst.encoding[i : i + 1 + inst.lookahead]
    rows[: len(ahead)] = ahead
    dev = np.zeros((D, DEVICE_FEATURES))
    dev[:, 0] = inst.speed
    used = np.zeros(D)
    left = inst.capacity.copy()
    ends = (*state.starts[1:], i) if state.starts else ()
    glob = np.zeros(GLOBAL_FEATURES)
    for s, e, devs in zip(state.starts, ends, state.devices, strict=True):
        for d in devs:
            used[d] = 1.0
            left[d] -= stage_memory(inst, state, s, e, len(devs))
    for s, e, devs in zip(state.starts[:-1], ends[:-1], state.devices[:-1], strict=True):
        glob[7] = max(glob[7], _load(inst, state, s, e, devs))
    dev[:, 1] = np.clip(left / inst.capacity, 0.0, 1.0)
    rest = stage_memory(inst, state, i, L, 1)
    dev[:, 2] = np.clip(left / rest, 0.0, 1.0) if rest > 0 else 1.0
    dev[:, 3] = used
    glob[0], glob[1] = i / L, (L - i) / L
    glob[2] = len(state.starts) / D
    if state.starts:
        start, devs = state.starts[-1], state.devices[-1]
        dev[list(devs), 4] = 1.0
        glob[3] = (i - start) / L
        total_flops = inst.flops[-1]
        glob[4] = (inst.flops[i] - inst.flops[start]) / total_flops if total_flops > 0 else 0.0
        glob[5] = _load(inst, state, start, i, devs)
        glob[6] = len(devs) / D
    B = inst.global_batch
    glob[8] = np.log(microbatch_size(inst, state)) / np.log(B) if B > 1 else 0.0
    glob[9] = float(state.count < 0)
    out = np.concatenate([rows.ravel(), dev.ravel(), glob]).astype(np.float32)
    return np.clip(out, -1.0, 1.0)
