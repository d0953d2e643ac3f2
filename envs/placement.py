"""The placement MDP: one episode cuts one model into pipeline stages and places them.

The pure core is a handful of functions of explicit state (:func:`make_instance`,
:func:`initial_state`, :func:`action_mask`, :func:`transition`, :func:`is_terminal`,
:func:`to_plan`, :func:`plan_value`, :func:`reward`, :func:`observe`);
:class:`PlacementEnv` is a thin gymnasium shell around them. Rewards come from the contract
cost model (:func:`core.costmodel.simulate`), so the env is deterministic; measured rewards
are a reward source of the planners, never computed inside ``step()``.

An episode may first choose the microbatch count (when the config offers several), then
places layers one per step; a step right after opening a stage may instead add a replica
device to it. So the action space holds every plan of equal microbatches that
``brute`` enumerates (DESIGN.md, "Planners"), not only one device per stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from core.cluster import ClusterSpec
from core.costmodel import Estimate, layer_costs, simulate
from core.errors import PipeplanError
from core.plan import Plan, Schedule, Stage
from core.profile import ModelProfile
from envs.encoding import WIDTH, encode_profile

ObjectiveName = Literal["time", "throughput", "cost"]
OBJECTIVES: tuple[str, ...] = ("time", "throughput", "cost")
DEVICE_FEATURES = 5
"""Per device: speed, memory left, remaining layers fit, used, holds the open stage."""
GLOBAL_FEATURES = 10
"""Progress, layers left, stages opened, open stage size, its FLOP share, its load, its
replicas, the closed stages' worst load, the microbatch size, choosing the microbatch."""


class EnvConfigError(PipeplanError):
    """The env config is malformed; the message names the key and the value."""


# --- the static problem of an episode ---------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """Everything fixed during an episode: the problem and the tables the pure functions read.

    Prefix sums run over layers: ``params[b] - params[a]`` is the parameter bytes of layers
    ``a..b-1``; ``fixed[d, b] - fixed[d, a] + n * (per_sample[d, b] - per_sample[d, a])``
    their forward + backward seconds for ``n`` samples on device ``d`` (index into
    ``cluster.device_ids``). ``counts`` are the microbatch counts an episode may use (one:
    fixed, no choosing step).
    """

    profile: ModelProfile
    cluster: ClusterSpec
    objective: ObjectiveName
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
        return float(fixed + samples * (self.per_sample[d, end] - self.per_sample[d, start]))


def make_instance(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    objective: ObjectiveName = "time",
    global_batch: int = 64,
    microbatches: int | Sequence[int] | None = 4,
    schedule: Schedule | str = Schedule.GPIPE,
    min_throughput: float | None = None,
    min_stages: int = 1,
    max_stages: int | None = None,
    max_replicas: int = 1,
    lookahead: int = 2,
    infeasible_reward: float = 0.0,
) -> Instance:
    """Check the options and precompute the tables of one profile on one cluster."""
    n_dev = len(cluster.device_ids)
    top = n_dev if max_stages is None else max_stages
    counts = _counts(global_batch, microbatches)
    _check_options(objective, schedule, min_stages, top, max_replicas, lookahead, n_dev)
    if min_stages > len(profile):
        raise EnvConfigError(
            f"min_stages: {min_stages} exceeds the {len(profile)} layers of {profile.name!r}"
        )
    ids = cluster.device_ids
    types = [cluster.device_type(d) for d in ids]
    per_type = {t.name: layer_costs(profile, t) for t in types}
    fixed = np.zeros((n_dev, len(profile) + 1))
    per_sample = np.zeros((n_dev, len(profile) + 1))
    for d, t in enumerate(types):
        c = per_type[t.name]
        fixed[d, 1:] = np.cumsum(c.fwd_fixed + c.bwd_fixed)
        per_sample[d, 1:] = np.cumsum(c.fwd_per_sample + c.bwd_per_sample)
    fastest = max(t.flops for t in types)
    nodes = {n.name: i for i, n in enumerate(cluster.nodes)}
    ref_time = fixed[:, -1] + global_batch * per_sample[:, -1]  # whole batch, each device
    ref_price = np.array([t.price_per_hour for t in types])
    ref = _objective_values(
        objective, global_batch, None, ref_time, np.ones(n_dev, bool), ref_price
    ).min()
    return Instance(
        profile=profile,
        cluster=cluster,
        objective=objective,
        global_batch=global_batch,
        counts=counts,
        schedule=Schedule(schedule),
        min_throughput=min_throughput,
        min_stages=min_stages,
        max_stages=top,
        max_replicas=max_replicas,
        lookahead=lookahead,
        infeasible_reward=infeasible_reward,
        encoding=encode_profile(profile),
        params=_prefix([x.params_bytes for x in profile.layers]),
        acts=_prefix([x.activation_bytes for x in profile.layers]),
        flops=_prefix([x.flops for x in profile.layers]),
        fixed=fixed,
        per_sample=per_sample,
        capacity=np.array([t.memory_bytes for t in types]),
        speed=np.array([t.flops / fastest for t in types]),
        node=np.array([nodes[cluster.device(d).node] for d in ids]),
        reference=float(ref),
    )


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _counts(global_batch: int, microbatches: int | Sequence[int] | None) -> tuple[int, ...]:
    """The allowed microbatch counts: one fixed, a given list, or every divisor of the batch."""
    if not _is_int(global_batch) or global_batch < 1:
        raise EnvConfigError(f"global_batch: must be an integer >= 1, got {global_batch!r}")
    if microbatches is None:
        return tuple(m for m in range(1, global_batch + 1) if global_batch % m == 0)
    raw: list[Any] = (
        [microbatches]
        if _is_int(microbatches)
        else list(microbatches)
        if isinstance(microbatches, Sequence) and not isinstance(microbatches, str)
        else []
    )
    if not raw:
        raise EnvConfigError(
            f"microbatches: expected an integer, a non-empty list of them or None, "
            f"got {microbatches!r}"
        )
    for m in raw:
        if not _is_int(m) or m < 1 or global_batch % m:
            raise EnvConfigError(
                f"microbatches: must be integers >= 1 dividing global_batch {global_batch}, "
                f"got {m!r}"
            )
    if len(set(raw)) != len(raw):
        raise EnvConfigError(f"microbatches: repeated counts in {raw!r}")
    return tuple(int(m) for m in raw)


def _check_options(
    objective: str,
    schedule: Schedule | str,
    min_stages: int,
    max_stages: int,
    max_replicas: int,
    lookahead: int,
    n_devices: int,
) -> None:
    if objective not in OBJECTIVES:
        raise EnvConfigError(f"objective: unknown {objective!r} (one of {', '.join(OBJECTIVES)})")
    try:
        Schedule(schedule)
    except ValueError:
        raise EnvConfigError(
            f"schedule: unknown {schedule!r} (one of {', '.join(s.value for s in Schedule)})"
        ) from None
    if not 1 <= min_stages <= max_stages <= n_devices:
        raise EnvConfigError(
            f"min_stages/max_stages: need 1 <= {min_stages} <= {max_stages} <= {n_devices} "
            "(the cluster's devices)"
        )
    if not _is_int(max_replicas) or not 1 <= max_replicas <= n_devices:
        raise EnvConfigError(
            f"max_replicas: must be an integer in [1, {n_devices}] (the cluster's devices), "
            f"got {max_replicas!r}"
        )
    if lookahead < 0:
        raise EnvConfigError(f"lookahead: must be >= 0, got {lookahead}")


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
    return inst.counts[max(state.count, 0)] if inst.schedule is Schedule.GPIPE else 1


def stage_memory(inst: Instance, state: State, start: int, end: int, replicas: int) -> float:
    """Rule 9 for layers ``[start, end)`` on each of ``replicas`` devices."""
    params = inst.params[end] - inst.params[start]
    acts = inst.acts[end] - inst.acts[start]
    share = microbatch_size(inst, state) / replicas
    return float(4.0 * params + in_flight(inst, state) * share * acts)


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


def _objective_values(
    objective: str,
    global_batch: int,
    min_throughput: float | None,
    batch_time: np.ndarray,
    fits: np.ndarray,
    price: np.ndarray,
) -> np.ndarray:
    """Lower is better, ``inf`` when infeasible (the same rule as ``agents.Problem.score``)."""
    ok = fits.copy()
    if objective == "cost":
        if min_throughput:
            ok &= global_batch / batch_time >= min_throughput
        value = price * batch_time / 3600.0 / global_batch + 1e-15 * batch_time
    else:
        value = batch_time
    return np.where(ok, value, np.inf)


def plan_value(inst: Instance, est: Estimate) -> float:
    """The objective value of a simulated plan (``inf`` when it is infeasible)."""
    return float(
        _objective_values(
            inst.objective,
            inst.global_batch,
            inst.min_throughput,
            np.array([est.batch_time_s]),
            np.array([est.fits]),
            np.array([est.cost_per_hour]),
        )[0]
    )


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


# --- the gymnasium shell ---------------------------------------------------------------------


class PlacementEnv(gym.Env[dict[str, np.ndarray], int]):
    """Place a model's layers, one per step, into pipeline stages on a heterogeneous cluster.

    ## Description

    TAPP's task allocation as an MDP (DESIGN.md, "TAPP planner and the MDP"). When the config
    offers several microbatch counts, the first step chooses one. Then step ``i`` decides
    layer ``i`` of the profile (layers in topological order): keep it in the stage that holds
    layer ``i-1``, or open a new stage for it on an unused device. Right after a stage is
    opened (it holds one layer), a step may instead add an unused device to it as a replica
    (``max_replicas > 1``); such a step places no layer. At the end the stages form a
    :class:`core.plan.Plan` (equal microbatches of ``global_batch / M`` samples) that the
    contract cost model costs.

    ## Action Space

    ``Discrete(1 + D + R + K)`` for a cluster of ``D`` devices (``cluster.device_ids``
    order), ``R = D`` when ``max_replicas > 1`` else 0, ``K`` the microbatch counts offered
    (0 when there is one):

    - ``0``: keep layer ``i`` in the open stage; once every layer is placed and the last
      stage could still take a replica, ``0`` ends the episode;
    - ``1 .. D``: open a new stage for layer ``i`` on device ``d - 1``;
    - ``D + 1 .. 2 D``: add device ``d - D - 1`` to the open stage as a replica;
    - ``1 + D + R + k``: choose the ``k``-th microbatch count (first step only).

    The ``action_mask`` forbids: anything but a microbatch count on the first step when
    choosing (and microbatch counts afterwards), staying at layer 0 (a stage must be
    opened), staying when the layers left are just enough for the stages ``min_stages``
    still needs, devices already used, opening beyond ``max_stages``, replicas except right
    after the open stage was opened, beyond ``max_replicas`` or when the devices left are
    needed for ``min_stages``, and actions whose stage would not fit its devices' memory
    (unless no action fits). A masked action is replaced by the first allowed one and
    ``info["repaired"]`` is set.

    ## Observation Space

    ``Dict(observations=Box(-1, 1, (32 (1 + lookahead) + 5 D + 10,)), action_mask=Box(0, 1,
    (1 + D + R + K,)))``, float32, as RLlib's action-masking modules expect.
    ``observations`` holds the TAPP encoding (:mod:`envs.encoding`) of layer ``i`` and the
    next ``lookahead`` layers (zero rows past the end), per device its speed (FLOP/s over
    the fastest), memory left (fraction), whether the remaining layers would fit in that
    memory (ratio, capped at 1), the used flag and whether it holds the open stage; then
    progress ``i / L``, layers left, stages opened ``/ D``, the open stage's size ``/ L``,
    FLOP share, load ``t / (t + T / D)`` (``t`` its microbatch time on its slowest replica,
    ``T`` the whole model's on the fastest device) and replicas ``/ D``, the worst load of
    the closed stages, the microbatch size ``log b / log B`` and whether the step chooses
    the microbatch count.

    ## Rewards

    0 on every step but the last. The last is ``reference / value`` where ``value`` is the
    objective value of the plan (batch time for ``time``/``throughput``, $ per sample for
    ``cost``) and ``reference`` that of the whole batch computed at once on the best single
    device without communication or update; ``infeasible_reward`` (default 0) when the plan
    does not fit in memory or misses ``min_throughput``.

    ## Starting State

    No layer placed, no microbatch count chosen (unless fixed). With several profiles,
    ``reset`` picks one uniformly with ``self.np_random``.

    ## Episode End

    Terminates when every layer is placed and the last stage takes no replica (none allowed,
    or the agent chose ``0``); ``info`` then holds ``plan``, ``estimate``
    (:class:`core.costmodel.Estimate`), ``value`` and ``feasible``. Never truncated.

    ## Arguments

    ``config`` (a dict): ``profile`` (a ModelProfile, a path to a profile JSON, or a list of
    either), ``cluster`` (a ClusterSpec or a path), ``objective`` (``time`` | ``throughput``
    | ``cost``, default ``time``), ``global_batch`` (64), ``microbatches`` (the count M, 4;
    a list of counts, or None for every divisor of ``global_batch``: the first step
    chooses), ``schedule`` (``gpipe``), ``min_throughput`` (None; cost objective),
    ``min_stages`` (1), ``max_stages`` (None = D), ``max_replicas`` (1: no replica actions),
    ``lookahead`` (2), ``infeasible_reward`` (0.0).
    """

    metadata: dict[str, Any] = {"render_modes": []}
    action_space: spaces.Discrete
    observation_space: spaces.Dict
    _KEYS = frozenset(
        {
            "profile",
            "cluster",
            "objective",
            "global_batch",
            "microbatches",
            "schedule",
            "min_throughput",
            "min_stages",
            "max_stages",
            "max_replicas",
            "lookahead",
            "infeasible_reward",
        }
    )

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.instances = _instances_from_config(dict(config or {}), self._KEYS)
        first = self.instances[0]
        n = first.n_actions
        self.action_space = spaces.Discrete(n)
        self.observation_space = spaces.Dict(
            {
                "observations": spaces.Box(
                    -1.0, 1.0, (observation_size(first.n_devices, first.lookahead),), np.float32
                ),
                "action_mask": spaces.Box(0.0, 1.0, (n,), np.float32),
            }
        )
        self.instance = first
        self.state = initial_state(first)

    def _obs(self) -> dict[str, np.ndarray]:
        return {
            "observations": observe(self.instance, self.state),
            "action_mask": action_mask(self.instance, self.state),
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        k = int(self.np_random.integers(len(self.instances))) if len(self.instances) > 1 else 0
        self.instance = self.instances[k]
        self.state = initial_state(self.instance)
        return self._obs(), {"profile": self.instance.profile.name}

    def step(self, action: int) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        if is_terminal(self.instance, self.state):
            raise RuntimeError("step() after the episode ended; call reset()")
        chosen = legal_action(action_mask(self.instance, self.state), int(action))
        self.state = transition(self.instance, self.state, chosen)
        info: dict[str, Any] = {"action": chosen, "repaired": chosen != int(action)}
        if not is_terminal(self.instance, self.state):
            return self._obs(), 0.0, False, False, info
        plan = to_plan(self.instance, self.state)
        est = simulate(plan, self.instance.profile, self.instance.cluster)
        value = plan_value(self.instance, est)
        info.update(plan=plan, estimate=est, value=value, feasible=bool(np.isfinite(value)))
        return self._obs(), float(reward(self.instance, value)), True, False, info


def _instances_from_config(config: dict[str, Any], keys: frozenset[str]) -> list[Instance]:
    unknown = sorted(set(config) - keys)
    if unknown:
        raise EnvConfigError(
            f"config: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})"
        )
    if "profile" not in config or "cluster" not in config:
        raise EnvConfigError("config: needs 'profile' (one or a list) and 'cluster'")
    raw = config["profile"]
    profiles = list(raw) if isinstance(raw, list | tuple) else [raw]
    if not profiles:
        raise EnvConfigError("config.profile: empty list")
    cluster = config["cluster"]
    if isinstance(cluster, str | Path):
        cluster = ClusterSpec.load(cluster)
    if not isinstance(cluster, ClusterSpec):
        raise EnvConfigError(f"config.cluster: expected a ClusterSpec or a path, got {cluster!r}")
    options = {k: v for k, v in config.items() if k not in ("profile", "cluster")}
    if "objective" in options:
        options["objective"] = str(options["objective"])
    return [make_instance(_load_profile(p), cluster, **options) for p in profiles]


def _load_profile(p: Any) -> ModelProfile:
    if isinstance(p, ModelProfile):
        return p
    if isinstance(p, str | Path):
        return ModelProfile.load(p)
    raise EnvConfigError(f"config.profile: expected a ModelProfile or a path, got {p!r}")
