"""The placement MDP as plain functions of explicit state: one episode cuts one model into
pipeline stages and places them.

:class:`Instance` is what stays fixed during an episode (the problem and the tables the
functions read; :func:`envs.config.make_instance` builds it), :class:`State` what an action
changes. :func:`initial_state`, :func:`action_mask`, :func:`transition`, :func:`is_terminal`,
:func:`to_plan`, :func:`plan_value`, :func:`reward` and :func:`observe` are the whole
dynamics; :class:`envs.env.PlacementEnv` is a thin gymnasium shell around them. Values come
from the contract cost model and :func:`core.objective.score`, so the MDP is deterministic;
measured rewards are a reward source of the planners, never computed here.

An episode may first choose the microbatch count (when the config offers several). Then one
of two action spaces (:data:`ACTION_SPACES`, the env config's ``actions``) builds the stages:

- ``layers`` (TAPP's MDP): one layer per step, kept in the open stage or opening a new one on
  a device; a step right after opening a stage may instead add a replica device to it.
- ``stages``: one stage per few steps: open it on a device, add replicas, then choose where
  it ends (its last layer). With ``twin_opens`` a stage may also open on a device and its
  free twins (same type, same node) as replicas at once. Episodes are a few steps per stage
  instead of one per layer, so the one reward at the end is credited over far fewer
  decisions; while a stage's end is chosen, the observation holds, for every candidate end,
  the stage's time against the balanced share and against the rest of the model spread over
  the free devices.

With ``stage_sizes`` (``stages`` only, several counts offered) each stage also gets its own
microbatch size (UMPIPE's unequal microbatches): the first action still chooses the shared
count, which prices the end features and the memory masks, and right after a stage's end one
more step chooses that stage's size among the sizes of the offered counts; while it does,
the observation holds, for every size, the stage's busy time over the whole batch at that
size (:func:`size_features`). The episode ends once the last stage's size is chosen.

Both hold every plan of equal microbatches that ``brute`` enumerates (DESIGN.md,
"Planners"), not only one device per stage; with ``stage_sizes``, ``stages`` also holds
those of ``brute``'s ``unequal`` option.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import Estimate, simulate
from pipeplan.core.objective import Objective, score
from pipeplan.core.plan import Plan, Schedule, Stage
from pipeplan.core.profile import ModelProfile
from pipeplan.envs.encoding import WIDTH

DEVICE_FEATURES = 5
"""Per device: speed, memory left, remaining layers fit, used, holds the open stage."""
GLOBAL_FEATURES = 10
"""Progress, layers left, stages opened, open stage size, its FLOP share, its load, its
replicas, the closed stages' worst load, the microbatch size, choosing the microbatch."""
END_FEATURES = 3
"""``stages`` actions, per candidate end: the stage's load, its share against the rest, the
cut's transfer against the balanced share."""
SIZE_FEATURES = 4
"""``stage_sizes``, per allowed microbatch size: the stage's busy time at its best size over
that at this one, the shared size, the size, the busy time's load over the batch."""
LAYERS, STAGES = "layers", "stages"
ACTION_SPACES = (LAYERS, STAGES)


# --- the static problem of an episode ---------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """Everything fixed during an episode: the problem and the tables the pure functions read
    (taken from :class:`core.tables.CostTables`, per device).

    Prefix sums run over layers: ``params[b] - params[a]`` is the parameter bytes of layers
    ``a..b-1``; ``fixed[d, b] - fixed[d, a] + n * (per_sample[d, b] - per_sample[d, a])``
    their forward + backward seconds for ``n`` samples on device ``d`` (index into
    ``cluster.device_ids``). ``counts`` are the microbatch counts an episode may use (one:
    fixed, no choosing step); with ``stage_sizes`` a stage may also take the size
    ``global_batch // c`` of any of them (:attr:`sizes`).
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
    kind: np.ndarray  # (D,) devices of one type on one node share a value (twins)
    membw: np.ndarray  # (D,) memory bandwidth, GB/s (rule 8's update, rule 2b)
    cuts: np.ndarray  # (L+1,) activation bytes per sample crossing a cut before layer c
    link_lat: np.ndarray  # (2,) seconds: within a node, between nodes (core.tables)
    link_bps: np.ndarray  # (2,) bytes/s, the same classes
    reference: float  # objective value of the whole batch at once on the best single device
    actions: str = LAYERS  # the action space (ACTION_SPACES)
    exploring_starts: float = 0.0  # probability of an exploring start (exploring_start)
    start_steps: int = 3  # the most random actions of an exploring start
    elite_starts: float = 0.0  # probability of an elite start (elite_start), given elites
    elite_mutations: float = 0.0  # probability that an elite start changes its last action
    slots: int = 0  # ``stages``: end actions (>= n_layers; a shared env pads to its largest)
    stage_sizes: bool = False  # ``stages``: each stage chooses its own microbatch size
    twin_opens: bool = False  # ``stages``: open a stage on a device and its free twins at once

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
    def by_stage(self) -> bool:
        return self.actions == STAGES

    @property
    def sizes(self) -> tuple[int, ...]:
        """The microbatch size of each count: ``global_batch // counts[k]``."""
        return tuple(self.global_batch // c for c in self.counts)

    @property
    def open_offset(self) -> int:
        """First "open a stage on a device" action (``1`` for layers, ``0`` for stages)."""
        return 0 if self.by_stage else 1

    @property
    def twin_offset(self) -> int:
        """``twin_opens``: first "open a stage on a device and its free twins" action
        (``open_offset + D``)."""
        return self.open_offset + self.n_devices

    @property
    def replica_offset(self) -> int:
        """First "add a replica" action (``twin_offset``, plus ``D`` with ``twin_opens``)."""
        return self.twin_offset + (self.n_devices if self.twin_opens else 0)

    @property
    def end_offset(self) -> int:
        """``stages``: first "end the open stage" action (``end_offset + k``: after layer
        ``k``, so the stage holds layers ``[start, k + 1)``)."""
        return self.replica_offset + (self.n_devices if self.max_replicas > 1 else 0)

    @property
    def end_slots(self) -> int:
        return max(self.slots, self.n_layers) if self.by_stage else 0

    @property
    def count_offset(self) -> int:
        """First "choose a microbatch count" action."""
        return self.end_offset + self.end_slots

    @property
    def size_offset(self) -> int:
        """``stage_sizes``: first "choose the closed stage's microbatch size" action
        (``size_offset + k``: ``sizes[k]``)."""
        return self.count_offset + (len(self.counts) if self.chooses_microbatches else 0)

    @property
    def n_actions(self) -> int:
        return self.size_offset + (len(self.counts) if self.stage_sizes else 0)

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
    episode at the last layer instead of adding a replica; ``sizes`` (``stage_sizes``): the
    own microbatch size of stages ``0, 1, ...`` whose end is chosen, as indices into the
    instance's counts (the rest take the shared one)."""

    layer: int
    starts: tuple[int, ...]
    devices: tuple[tuple[int, ...], ...]
    count: int
    closed: bool = False
    sizes: tuple[int, ...] = ()

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


def stage_memory(
    inst: Instance, state: State, start: int, end: int, replicas: int, count: int | None = None
) -> float:
    """Rule 9 for layers ``[start, end)`` on each of ``replicas`` devices, in microbatches of
    the shared size or of the ``count``-th count's."""
    if count is not None:
        state = replace(state, count=count)
    params = inst.params[end] - inst.params[start]
    acts = inst.acts[end] - inst.acts[start]
    share = rules.replica_share(microbatch_size(inst, state), replicas)
    return float(rules.memory_bytes(params, acts, share, in_flight(inst, state)))


def stage_bounds(state: State) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` of every stage opened (the open one ends at ``state.layer``)."""
    ends = (*state.starts[1:], state.layer) if state.starts else ()
    return tuple(zip(state.starts, ends, strict=True))


def _replica_slots(inst: Instance, state: State) -> bool:
    """Whether the open stage may take a replica now: right after it was opened (it holds
    one layer), below ``max_replicas``, an unused device left beyond those that the stages
    ``min_stages`` still needs."""
    if inst.max_replicas < 2 or not state.starts or state.closed:
        return False
    opened_now = 0 if inst.by_stage else 1  # layers the open stage holds right after opening
    if state.layer - state.starts[-1] != opened_now:
        return False
    if len(state.devices[-1]) >= inst.max_replicas:
        return False
    free = inst.n_devices - len(state.used)
    return free - 1 >= max(inst.min_stages - len(state.starts), 0)


def size_pending(inst: Instance, state: State) -> bool:
    """``stage_sizes``: a stage's end is chosen and its own microbatch size not yet."""
    if not inst.stage_sizes:
        return False
    ended = len(state.starts) - _pending(inst, state)
    return len(state.sizes) < ended


def is_terminal(inst: Instance, state: State) -> bool:
    """Every layer is placed and the last stage takes no more replicas (or the agent chose
    to stay; ``stages``: the last stage's end was chosen, and with ``stage_sizes`` its
    size)."""
    if inst.by_stage:
        return state.layer >= inst.n_layers and not size_pending(inst, state)
    return state.layer >= inst.n_layers and (state.closed or not _replica_slots(inst, state))


def structural_mask(inst: Instance, state: State) -> np.ndarray:
    """(n_actions,) bool: actions that keep the plan valid (contiguous, no device twice, stage
    count within ``[min_stages, max_stages]``, replicas within ``max_replicas``, one
    microbatch count chosen first, a stage's own size right after its end). Always allows at
    least one action."""
    D = inst.n_devices
    mask = np.zeros(inst.n_actions, dtype=bool)
    if is_terminal(inst, state):
        mask[0] = True
        return mask
    if state.count < 0:
        mask[inst.count_offset : inst.size_offset] = True
        return mask
    if size_pending(inst, state):
        mask[inst.size_offset :] = True
        return mask
    free = np.ones(D, dtype=bool)
    free[np.asarray(state.used, dtype=np.int64)] = False
    if inst.by_stage:
        return _stage_structural_mask(inst, state, free, mask)
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


def _pending(inst: Instance, state: State) -> bool:
    """``stages``: a stage is open and its end not chosen yet."""
    return bool(state.starts) and state.starts[-1] == state.layer < inst.n_layers


def _stage_structural_mask(
    inst: Instance, state: State, free: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """``stages``: open a stage on a free device when none is pending; while one is, add a
    replica (``_replica_slots``) or end it where the layers and free devices left can still
    hold the stages ``min_stages`` needs -- at the last layer when no device is left or
    ``max_stages`` is reached."""
    opened = len(state.starts)
    if not _pending(inst, state):
        mask[inst.open_offset : inst.open_offset + inst.n_devices] = free
        if inst.twin_opens and opened < inst.max_stages:
            for d in np.flatnonzero(free):
                taken = len(twins(inst, state, int(d)))
                left = int(free.sum()) - taken  # devices for the stages min_stages still needs
                mask[inst.twin_offset + d] = taken > 1 and left >= inst.min_stages - opened - 1
        return mask
    if _replica_slots(inst, state):
        mask[inst.replica_offset : inst.replica_offset + inst.n_devices] = free
    start, L = state.starts[-1], inst.n_layers
    still = max(inst.min_stages - opened, 0)  # stages needed after this one
    ends = np.arange(start + 1, L + 1)  # candidate ends (exclusive)
    room = (L - ends >= still) & (int(free.sum()) >= still)
    if opened >= inst.max_stages or not free.any():
        room &= ends == L
    else:
        room &= (ends == L) | (L - ends >= max(still, 1))
    mask[inst.end_offset + ends - 1] = room
    return mask


def _stage_memory_mask(inst: Instance, state: State, mask: np.ndarray) -> np.ndarray:
    """``stages``: a device opens a stage when one layer fits it (with its twins: when the
    one-layer share fits them all); a replica joins when the stage's one-layer share fits
    it; an end is allowed when the stage fits all its devices."""
    i, D = state.layer, inst.n_devices
    if not _pending(inst, state):
        need = stage_memory(inst, state, i, i + 1, 1)
        mask[inst.open_offset : inst.open_offset + D] = need <= inst.capacity
        if inst.twin_opens:
            for d in range(D):
                devs = twins(inst, state, d)
                share = stage_memory(inst, state, i, i + 1, len(devs))
                mask[inst.twin_offset + d] = share <= inst.capacity[list(devs)].min()
        return mask
    devs = state.devices[-1]
    if inst.max_replicas > 1:
        need = stage_memory(inst, state, i, i + 1, len(devs) + 1)
        mask[inst.replica_offset : inst.replica_offset + D] = need <= inst.capacity
    worst = inst.capacity[list(devs)].min()
    ends = np.arange(i + 1, inst.n_layers + 1)
    need_e = stage_memory_ends(inst, state, i, ends, len(devs))
    mask[inst.end_offset + ends - 1] = need_e <= worst
    return mask


def stage_memory_ends(
    inst: Instance, state: State, start: int, ends: np.ndarray, replicas: int
) -> np.ndarray:
    """:func:`stage_memory` of layers ``[start, e)`` for every ``e`` of ``ends``."""
    params = inst.params[ends] - inst.params[start]
    acts = inst.acts[ends] - inst.acts[start]
    share = rules.replica_share(microbatch_size(inst, state), replicas)
    return np.asarray(rules.memory_bytes(params, acts, share, in_flight(inst, state)))


def size_memory(inst: Instance, state: State) -> np.ndarray:
    """``stage_sizes``: (K,) :func:`stage_memory` of the stage whose size is pending, in
    microbatches of each allowed size."""
    k = len(state.sizes)
    (start, end), devs = stage_bounds(state)[k], state.devices[k]
    return np.array(
        [stage_memory(inst, state, start, end, len(devs), c) for c in range(len(inst.counts))]
    )


def memory_mask(inst: Instance, state: State) -> np.ndarray:
    """(n_actions,) bool: actions whose stage still fits all its devices' memory after this
    step (choosing the microbatch count is never masked for memory; a stage's own size is)."""
    i, D = state.layer, inst.n_devices
    mask = np.zeros(inst.n_actions, dtype=bool)
    if is_terminal(inst, state):
        mask[0] = True
        return mask
    mask[inst.count_offset : inst.size_offset] = True
    if state.count < 0:
        return mask
    if size_pending(inst, state):
        worst = inst.capacity[list(state.devices[len(state.sizes)])].min()
        mask[inst.size_offset :] = size_memory(inst, state) <= worst
        return mask
    if inst.by_stage:
        return _stage_memory_mask(inst, state, mask)
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


def twins(inst: Instance, state: State, d: int) -> tuple[int, ...]:
    """``d`` and, as its replicas, the free devices of its type on its node (in the
    cluster's order), ``max_replicas`` at most: the stage a twin open gives."""
    used = set(state.used)
    same = [k for k in np.flatnonzero(inst.kind == inst.kind[d]) if k != d and k not in used]
    return (d, *(int(k) for k in same))[: inst.max_replicas]


def transition(inst: Instance, state: State, action: int) -> State:
    """Apply one (allowed) action. ``layers``: 0 keeps layer ``state.layer`` in the open
    stage (at the end: closes the episode), ``1..D`` opens a stage on device ``action - 1``,
    then adds a replica device to the open stage, then chooses a microbatch count.
    ``stages``: ``0..D-1`` opens a stage on a device at the first unplaced layer (with
    ``twin_opens``, the next ``D`` on a device and its free :func:`twins`), then adds a
    replica, then ends the open stage after a layer, then chooses a microbatch count, then
    (``stage_sizes``) the size of the stage just ended."""
    if action >= inst.size_offset:
        return replace(state, sizes=(*state.sizes, action - inst.size_offset))
    if action >= inst.count_offset:
        return replace(state, count=action - inst.count_offset)
    if inst.by_stage and action >= inst.end_offset:
        return replace(state, layer=action - inst.end_offset + 1)
    if action >= inst.replica_offset:
        d = action - inst.replica_offset
        return replace(state, devices=(*state.devices[:-1], (*state.devices[-1], d)))
    if inst.by_stage:  # open a stage on a device (and its twins); its end comes later
        if action >= inst.twin_offset:
            devs = twins(inst, state, action - inst.twin_offset)
        else:
            devs = (action - inst.open_offset,)
        return replace(state, starts=(*state.starts, state.layer), devices=(*state.devices, devs))
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


def exploring_start(inst: Instance, rng: np.random.Generator) -> tuple[State, tuple[int, ...]]:
    """The first state of an episode and the actions that led there: the empty plan, or with
    probability ``inst.exploring_starts`` the state after ``1..start_steps`` random legal
    actions that do not end the episode, each of a kind drawn uniformly
    (:func:`action_kinds`), then uniformly among the actions of that kind (Monte Carlo with
    exploring starts: every start keeps being tried however the policy has converged, so a
    plan whose first decisions look bad under a poor continuation -- slow devices first, with
    replicas -- is still learned from). Actions chosen here are the env's, not the agent's."""
    state, taken = initial_state(inst), []
    if inst.exploring_starts <= 0 or rng.random() >= inst.exploring_starts:
        return state, ()
    for _ in range(int(rng.integers(1, inst.start_steps + 1))):
        going_on = _going_on(inst, state)
        if not len(going_on):
            break
        kinds = action_kinds(inst, going_on)
        kind = rng.choice(np.unique(kinds))
        taken.append(int(rng.choice(going_on[kinds == kind])))
        state = transition(inst, state, taken[-1])
    return state, tuple(taken)


def action_kinds(inst: Instance, actions: np.ndarray) -> np.ndarray:
    """The kind of each action: 0 keep a layer (``layers``), 1 open a stage, 2 open one with
    twins, 3 add a replica, 4 end a stage (``stages``), 5 choose the microbatch count, 6
    choose a stage's size. An exploring start draws a kind, then an action of it: drawn
    uniformly over actions, its random steps would end ResNet-50's stages (174 end actions)
    and almost never add one of the 6 replicas, which the best plans there all have."""
    bounds = [
        0,
        inst.open_offset,
        inst.twin_offset,
        inst.replica_offset,
        inst.end_offset,
        inst.count_offset,
        inst.size_offset,
    ]
    return np.searchsorted(bounds, actions, side="right") - 1


def elite_start(
    inst: Instance, actions: tuple[int, ...], rng: np.random.Generator
) -> tuple[State, tuple[int, ...]]:
    """The state after a uniformly random proper prefix (``1 .. len - 1`` actions) of an elite
    episode's ``actions``, and that prefix: Go-Explore's return to a promising state, as the
    env's own start; the agent decides the rest. Replay stops early at an action the mask
    does not allow (an episode of another instance) or one that would end the episode; an
    elite of one action gives the empty plan. With probability ``inst.elite_mutations`` the
    prefix's last action is replaced by another of its kind (:func:`action_kinds`; another
    end of the stage, another size, another device), drawn uniformly among the legal ones
    that do not end the episode: Go-Explore's exploring from the state returned to, one
    decision of a good plan changed."""
    state, taken = initial_state(inst), []
    if len(actions) < 2:
        return state, ()
    prefix = actions[: int(rng.integers(1, len(actions)))]
    mutate = inst.elite_mutations > 0 and rng.random() < inst.elite_mutations
    for i, a in enumerate(prefix):
        if not 0 <= a < inst.n_actions or not action_mask(inst, state)[a]:
            break
        if mutate and i == len(prefix) - 1:
            a = _another_of_its_kind(inst, state, a, rng)
        after = transition(inst, state, a)
        if is_terminal(inst, after):
            break
        state = after
        taken.append(a)
    return state, tuple(taken)


def _another_of_its_kind(
    inst: Instance, state: State, action: int, rng: np.random.Generator
) -> int:
    """A uniformly drawn legal action of ``action``'s kind other than it that does not end the
    episode (``action`` when there is none)."""
    going_on = _going_on(inst, state)
    kinds = action_kinds(inst, going_on)
    others = going_on[(kinds == action_kinds(inst, np.array([action]))[0]) & (going_on != action)]
    return int(rng.choice(others)) if len(others) else action


def _going_on(inst: Instance, state: State) -> np.ndarray:
    """The allowed actions of ``state`` that do not end the episode, in action order."""
    allowed = np.flatnonzero(action_mask(inst, state))
    return np.array(
        [a for a in allowed if not is_terminal(inst, transition(inst, state, int(a)))],
        dtype=np.int64,
    )


def legal_action(mask: np.ndarray, action: int) -> int:
    """``action`` when the mask allows it, else the first allowed action (deterministic)."""
    if 0 <= action < len(mask) and mask[action] > 0:
        return action
    return int(np.flatnonzero(mask > 0)[0])


# --- plan, value, reward ---------------------------------------------------------------------


def to_plan(inst: Instance, state: State) -> Plan:
    """The plan of a terminal state: its stages and replicas, each stage in microbatches of
    its own size (``stage_sizes``) or else of the shared one."""
    ids = inst.cluster.device_ids
    ends = (*state.starts[1:], inst.n_layers)
    own = [inst.sizes[k] for k in state.sizes]
    sizes = own + [microbatch_size(inst, state)] * (len(state.starts) - len(own))
    stages = tuple(
        Stage((s, e), tuple(ids[d] for d in devs), b)
        for s, e, devs, b in zip(state.starts, ends, state.devices, sizes, strict=True)
    )
    return Plan(inst.global_batch, stages, inst.schedule)


class Scored(Protocol):
    """What valuing a plan reads of an instance (this MDP's and :mod:`envs.kinds`')."""

    @property
    def profile(self) -> ModelProfile: ...
    @property
    def cluster(self) -> ClusterSpec: ...
    @property
    def objective(self) -> Objective: ...
    @property
    def global_batch(self) -> int: ...
    @property
    def min_throughput(self) -> float | None: ...


def plan_value(inst: Scored, est: Estimate) -> float:
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


def outcome(inst: Scored, plan: Plan, actions: Sequence[int]) -> tuple[float, dict[str, Any]]:
    """An episode's end: the plan's value by the contract cost model, and what the terminal
    step's ``info`` holds (``plan``, ``estimate``, ``value``, ``feasible``, ``actions``)."""
    est = simulate(plan, inst.profile, inst.cluster)
    value = plan_value(inst, est)
    feasible = bool(np.isfinite(value))
    return value, {
        "plan": plan,
        "estimate": est,
        "value": value,
        "feasible": feasible,
        "actions": tuple(actions),
    }


def reward(inst: Instance, value: float) -> float:
    """``reference / value``: 1 = as good as the best single device computing the whole batch
    at once (no communication, no update); a pipeline over ``n`` devices can approach ``n``.
    Infeasible plans get ``infeasible_reward``; a plan that costs nothing (a model of zero
    cost) 1."""
    if not np.isfinite(value):
        return inst.infeasible_reward
    return inst.reference / value if value > 0 else 1.0


# --- observation -----------------------------------------------------------------------------


def global_offset(inst: Instance) -> int:
    """Where the observation's global features (:data:`GLOBAL_FEATURES` of them) start."""
    return WIDTH * (1 + inst.lookahead) + DEVICE_FEATURES * inst.n_devices


@dataclass(frozen=True)
class SlotGroup:
    """Actions that each have a row of their own in the observation: action
    ``action_offset + k`` is described by ``observation[obs_offset + k * features :
    obs_offset + (k + 1) * features]``, for ``k < count`` (``stages``: the end slots and
    :func:`end_features`; ``stage_sizes``: the sizes and :func:`size_features`). A policy
    may score such actions from their rows with one function shared by all of them."""

    obs_offset: int
    features: int
    action_offset: int
    count: int


def slot_groups(inst: Instance) -> tuple[SlotGroup, ...]:
    """The observation's per-action rows, in the order :func:`observe` writes them."""
    at, groups = global_offset(inst) + GLOBAL_FEATURES, []
    if inst.by_stage:
        groups.append(SlotGroup(at, END_FEATURES, inst.end_offset, inst.end_slots))
        at += END_FEATURES * inst.end_slots
    if inst.stage_sizes:
        groups.append(SlotGroup(at, SIZE_FEATURES, inst.size_offset, len(inst.counts)))
    return tuple(groups)


def observation_size(inst: Instance) -> int:
    return (
        global_offset(inst) + GLOBAL_FEATURES + sum(g.features * g.count for g in slot_groups(inst))
    )


def _load(inst: Instance, state: State, start: int, end: int, devs: tuple[int, ...]) -> float:
    """``t / (t + T / D)``: a stage's microbatch time on its slowest replica against the
    whole model's on the fastest device spread over all devices."""
    b = microbatch_size(inst, state)
    t = max(inst.stage_time(d, start, end, rules.replica_share(b, len(devs))) for d in devs)
    balanced = min(inst.stage_time(d, 0, inst.n_layers, b) for d in range(inst.n_devices))
    balanced /= inst.n_devices
    return t / (t + balanced) if t + balanced > 0 else 0.0


def observe(inst: Instance, state: State) -> np.ndarray:
    """Flat float32 vector in ``[-1, 1]``: encodings of layers ``i..i+lookahead`` (zero rows
    past the end), then per device (speed, memory left, remaining layers fit, used, holds the
    open stage), then global features (progress, layers left, stages opened, open stage size,
    its FLOP share, its load, its replicas, the closed stages' worst load, the microbatch size
    ``log b / log B``, choosing the microbatch count); ``stages``: :func:`end_features`;
    ``stage_sizes``: :func:`size_features`."""
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
    own = (*state.sizes, *[None] * (len(state.starts) - len(state.sizes)))
    for s, e, devs, c in zip(state.starts, ends, state.devices, own, strict=True):
        for d in devs:
            used[d] = 1.0
            left[d] -= stage_memory(inst, state, s, e, len(devs), c)
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
    parts: list[np.ndarray] = [rows.ravel(), dev.ravel(), glob]
    if inst.by_stage:
        parts.append(end_features(inst, state).ravel())
    if inst.stage_sizes:
        parts.append(size_features(inst, state).ravel())
    out = np.concatenate(parts).astype(np.float32)
    return np.clip(out, -1.0, 1.0)


def _cut_seconds(
    inst: Instance, devs: tuple[int, ...], free: np.ndarray, ends: np.ndarray, b: int
) -> np.ndarray:
    """Seconds to send a microbatch's activations across each cut of ``ends`` and their
    gradients back (rule 3, both directions), over the best link from the open stage's first
    device to a free one (within its node when one is free there); 0 at the last layer."""
    if not len(free):
        return np.zeros(len(ends))
    inside = bool((inst.node[free] == inst.node[devs[0]]).any())
    k = 0 if inside else 1
    seconds = 2.0 * (inst.link_lat[k] + b * inst.cuts[ends] / inst.link_bps[k])
    return np.where(ends == inst.n_layers, 0.0, seconds)


def end_features(inst: Instance, state: State) -> np.ndarray:
    """``stages``: (slots, 3) in ``[0, 1]``; row ``k`` describes ending the pending stage
    after layer ``k`` (zeros where that is not a candidate, and while no stage is pending):
    the stage's load ``t / (t + T / D)`` as in :func:`observe`; ``t / (t + r)`` with ``r``
    the rest of the model's microbatch time spread over the free devices (their rates added;
    no communication): 0.5 is a stage as long as each of the rest's stages would be if the
    free devices shared it perfectly, the balance a bottleneck plan looks for; and the
    cut's transfer ``c / (c + T / D)`` (:func:`_cut_seconds`), which decides where a
    pipeline on slow links should cut."""
    out = np.zeros((inst.end_slots, END_FEATURES))
    if not _pending(inst, state):
        return out
    start, devs, L = state.starts[-1], state.devices[-1], inst.n_layers
    b = microbatch_size(inst, state)
    ends = np.arange(start + 1, L + 1)
    d = np.asarray(devs)
    t = rules.compute_s(
        inst.fixed[d][:, ends] - inst.fixed[d, start, None],
        inst.per_sample[d][:, ends] - inst.per_sample[d, start, None],
        rules.replica_share(b, len(devs)),
    ).max(axis=0)
    balanced = min(inst.stage_time(k, 0, L, b) for k in range(inst.n_devices)) / inst.n_devices
    free = np.setdiff1d(np.arange(inst.n_devices), np.asarray(state.used))
    r = np.full(len(ends), np.inf)  # no free device: nothing can take the rest
    if len(free):
        rest = rules.compute_s(
            inst.fixed[free, L, None] - inst.fixed[free][:, ends],
            inst.per_sample[free, L, None] - inst.per_sample[free][:, ends],
            b,
        )  # (F, E): the rest after each end on each free device
        with np.errstate(divide="ignore"):
            r = 1.0 / (1.0 / rest).sum(axis=0)  # rates added; a free rest (0 s) gives 0
    r[ends == L] = 0.0
    out[ends - 1, 0] = t / (t + balanced) if balanced > 0 else (t > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(np.isinf(r), 0.0, t / (t + r))
    out[ends - 1, 1] = np.where(t + r > 0, share, 0.5)
    comm = _cut_seconds(inst, devs, free, ends, b)
    out[ends - 1, 2] = comm / (comm + balanced) if balanced > 0 else (comm > 0)
    return out


def size_features(inst: Instance, state: State) -> np.ndarray:
    """``stage_sizes``: (K, 4) in ``[0, 1]``; row ``k`` describes giving the stage whose size
    is pending microbatches of ``b_k = sizes[k]`` (zeros while none is pending). Its busy
    time over the whole batch at ``b_k`` is, on its slowest replica, ``B / b_k`` microbatches
    of compute (rules 1-2, ``ceil(b_k / r)`` samples each) plus their gradient accumulation (rule
    2b), which grows with the count and with the stage's parameters; the row holds that
    stage's least busy time at any size over this one (1: its best size), whether ``b_k`` is
    the shared size, ``log b_k / log B`` (smaller microbatches fill the pipeline sooner, which
    busy time does not see), and the load ``t / (t + T / D)`` of busy time ``t`` against the
    whole model's over the batch at the shared size on the fastest device, ``T``."""
    K = len(inst.counts)
    out = np.zeros((K, SIZE_FEATURES))
    if not size_pending(inst, state):
        return out
    k = len(state.sizes)
    (start, end), d = stage_bounds(state)[k], np.asarray(state.devices[k])
    sizes = np.asarray(inst.sizes, dtype=np.float64)
    micro = np.ceil(inst.global_batch / sizes)  # (K,)
    t = rules.compute_s(
        (inst.fixed[d, end] - inst.fixed[d, start])[:, None],
        (inst.per_sample[d, end] - inst.per_sample[d, start])[:, None],
        rules.replica_share(sizes[None, :], len(d)),
    )  # (R, K): a microbatch on each replica (its busiest share, rule 2i)
    update = rules.update_s(inst.params[end] - inst.params[start], inst.membw[d])  # (R,)
    accumulate = rules.accumulation_s(update[:, None], micro[None, :]) * micro[None, :]
    busy = (micro[None, :] * t + accumulate).max(axis=0)  # (K,)
    best = busy.min()
    out[:, 0] = np.where(busy > 0, best / np.where(busy > 0, busy, 1.0), 1.0)
    out[state.count, 1] = 1.0
    B = inst.global_batch
    out[:, 2] = np.log(sizes) / np.log(B) if B > 1 else 0.0
    shared, count = microbatch_size(inst, state), inst.counts[state.count]
    whole = min(inst.stage_time(j, 0, inst.n_layers, shared) for j in range(inst.n_devices))
    balanced = count * whole / inst.n_devices
    out[:, 3] = busy / (busy + balanced) if balanced > 0 else (busy > 0)
    return out
