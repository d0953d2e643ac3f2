"""The placement MDP: one episode cuts one model into pipeline stages and places them.

The pure core is a handful of functions of explicit state (:func:`make_instance`,
:func:`initial_state`, :func:`action_mask`, :func:`transition`, :func:`is_terminal`,
:func:`to_plan`, :func:`plan_value`, :func:`reward`, :func:`observe`);
:class:`PlacementEnv` is a thin gymnasium shell around them. Rewards come from the contract
cost model (:func:`core.costmodel.simulate`), so the env is deterministic; measured rewards
are a reward source of the planners, never computed inside ``step()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
GLOBAL_FEATURES = 6
"""Progress, layers left, stages opened, open stage size, its FLOP share, its load."""


class EnvConfigError(PipeplanError):
    """The env config is malformed; the message names the key and the value."""


# --- the static problem of an episode ---------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """Everything fixed during an episode: the problem and the tables the pure functions read.

    Prefix sums run over layers: ``params[b] - params[a]`` is the parameter bytes of layers
    ``a..b-1``; ``time[d, b] - time[d, a]`` their forward + backward seconds for one microbatch
    on device ``d`` (index into ``cluster.device_ids``).
    """

    profile: ModelProfile
    cluster: ClusterSpec
    objective: ObjectiveName
    global_batch: int
    microbatch: int
    schedule: Schedule
    min_throughput: float | None
    min_stages: int
    max_stages: int
    lookahead: int
    infeasible_reward: float
    encoding: np.ndarray  # (L, 32)
    params: np.ndarray  # (L+1,)
    acts: np.ndarray  # (L+1,)
    flops: np.ndarray  # (L+1,)
    time: np.ndarray  # (D, L+1)
    capacity: np.ndarray  # (D,) bytes
    speed: np.ndarray  # (D,) flops / fastest flops
    node: np.ndarray  # (D,) node index
    reference: float  # objective value of the whole model on the best single device, no comm

    @property
    def n_layers(self) -> int:
        return len(self.profile)

    @property
    def n_devices(self) -> int:
        return len(self.capacity)

    @property
    def in_flight(self) -> int:
        """Microbatches held per stage for the memory mask: exact for GPipe; for 1F1B the
        stage count is not known yet, so the lower bound 1 (mask only sure misfits)."""
        return self.global_batch // self.microbatch if self.schedule is Schedule.GPIPE else 1

    def stage_memory(self, start: int, end: int) -> float:
        """Rule 9 for layers ``[start, end)`` on one device."""
        params = self.params[end] - self.params[start]
        acts = self.acts[end] - self.acts[start]
        return float(4.0 * params + self.in_flight * self.microbatch * acts)


def make_instance(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    objective: ObjectiveName = "time",
    global_batch: int = 64,
    microbatches: int = 4,
    schedule: Schedule | str = Schedule.GPIPE,
    min_throughput: float | None = None,
    min_stages: int = 1,
    max_stages: int | None = None,
    lookahead: int = 2,
    infeasible_reward: float = 0.0,
) -> Instance:
    """Check the options and precompute the tables of one profile on one cluster."""
    n_dev = len(cluster.device_ids)
    top = n_dev if max_stages is None else max_stages
    _check_options(
        objective, global_batch, microbatches, schedule, min_stages, top, lookahead, n_dev
    )
    if min_stages > len(profile):
        raise EnvConfigError(
            f"min_stages: {min_stages} exceeds the {len(profile)} layers of {profile.name!r}"
        )
    ids = cluster.device_ids
    b = global_batch // microbatches
    types = [cluster.device_type(d) for d in ids]
    per_type = {t.name: layer_costs(profile, t) for t in types}
    time = np.zeros((n_dev, len(profile) + 1))
    for d, t in enumerate(types):
        c = per_type[t.name]
        layer = c.fwd_fixed + c.bwd_fixed + b * (c.fwd_per_sample + c.bwd_per_sample)
        time[d, 1:] = np.cumsum(layer)
    fastest = max(t.flops for t in types)
    nodes = {n.name: i for i, n in enumerate(cluster.nodes)}
    ref_time = microbatches * time[:, -1]  # whole batch on each device alone
    ref_price = np.array([t.price_per_hour for t in types])
    ref = _objective_values(
        objective, global_batch, None, ref_time, np.ones(n_dev, bool), ref_price
    ).min()
    return Instance(
        profile=profile,
        cluster=cluster,
        objective=objective,
        global_batch=global_batch,
        microbatch=b,
        schedule=Schedule(schedule),
        min_throughput=min_throughput,
        min_stages=min_stages,
        max_stages=top,
        lookahead=lookahead,
        infeasible_reward=infeasible_reward,
        encoding=encode_profile(profile),
        params=_prefix([x.params_bytes for x in profile.layers]),
        acts=_prefix([x.activation_bytes for x in profile.layers]),
        flops=_prefix([x.flops for x in profile.layers]),
        time=time,
        capacity=np.array([t.memory_bytes for t in types]),
        speed=np.array([t.flops / fastest for t in types]),
        node=np.array([nodes[cluster.device(d).node] for d in ids]),
        reference=float(ref),
    )


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])


def _check_options(
    objective: str,
    global_batch: int,
    microbatches: int,
    schedule: Schedule | str,
    min_stages: int,
    max_stages: int,
    lookahead: int,
    n_devices: int,
) -> None:
    if objective not in OBJECTIVES:
        raise EnvConfigError(f"objective: unknown {objective!r} (one of {', '.join(OBJECTIVES)})")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise EnvConfigError(f"global_batch: must be an integer >= 1, got {global_batch!r}")
    if (
        isinstance(microbatches, bool)
        or not isinstance(microbatches, int)
        or microbatches < 1
        or global_batch % microbatches
    ):
        raise EnvConfigError(
            f"microbatches: must be an integer >= 1 dividing global_batch {global_batch}, "
            f"got {microbatches!r}"
        )
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
    if lookahead < 0:
        raise EnvConfigError(f"lookahead: must be >= 0, got {lookahead}")


# --- state, mask, transition -----------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """Layers ``0..layer-1`` are placed; stage ``k`` starts at ``starts[k]`` on ``devices[k]``."""

    layer: int
    starts: tuple[int, ...]
    devices: tuple[int, ...]


def initial_state() -> State:
    return State(0, (), ())


def is_terminal(inst: Instance, state: State) -> bool:
    return state.layer >= inst.n_layers


def structural_mask(inst: Instance, state: State) -> np.ndarray:
    """(D+1,) bool: actions that keep the plan valid (contiguous, no device twice, stage
    count within ``[min_stages, max_stages]``). Always allows at least one action."""
    mask = np.zeros(inst.n_devices + 1, dtype=bool)
    if is_terminal(inst, state):
        mask[0] = True
        return mask
    opened = len(state.starts)
    layers_left = inst.n_layers - state.layer
    must_open = opened == 0 or inst.min_stages - opened >= layers_left
    mask[0] = not must_open
    if opened < inst.max_stages:
        mask[1:] = True
        mask[1 + np.asarray(state.devices, dtype=np.int64)] = False
    return mask


def memory_mask(inst: Instance, state: State) -> np.ndarray:
    """(D+1,) bool: actions whose stage still fits its device after taking this layer."""
    i = state.layer
    mask = np.zeros(inst.n_devices + 1, dtype=bool)
    if is_terminal(inst, state):
        mask[0] = True
        return mask
    if state.starts:
        mask[0] = inst.stage_memory(state.starts[-1], i + 1) <= inst.capacity[state.devices[-1]]
    mask[1:] = inst.stage_memory(i, i + 1) <= inst.capacity
    return mask


def action_mask(inst: Instance, state: State) -> np.ndarray:
    """(D+1,) float32 of 0/1: structurally valid actions that also fit in memory; when no
    action fits, the structurally valid ones (the plan will then be infeasible, not invalid)."""
    valid = structural_mask(inst, state)
    fitting = valid & memory_mask(inst, state)
    return (fitting if fitting.any() else valid).astype(np.float32)


def transition(state: State, action: int) -> State:
    """Place layer ``state.layer``: 0 keeps the open stage, ``d`` opens one on device d-1."""
    if action == 0:
        return State(state.layer + 1, state.starts, state.devices)
    return State(state.layer + 1, (*state.starts, state.layer), (*state.devices, action - 1))


def legal_action(mask: np.ndarray, action: int) -> int:
    """``action`` when the mask allows it, else the first allowed action (deterministic)."""
    if 0 <= action < len(mask) and mask[action] > 0:
        return action
    return int(np.flatnonzero(mask > 0)[0])


# --- plan, value, reward ---------------------------------------------------------------------


def to_plan(inst: Instance, state: State) -> Plan:
    """The plan of a terminal state: one device per stage, equal microbatches."""
    ids = inst.cluster.device_ids
    ends = (*state.starts[1:], inst.n_layers)
    stages = tuple(
        Stage((s, e), (ids[d],), inst.microbatch)
        for s, e, d in zip(state.starts, ends, state.devices, strict=True)
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
    """``reference / value``: 1 = as good as the best single device computing alone (no
    communication, no update); a pipeline over ``n`` devices can approach ``n``. Infeasible
    plans get ``infeasible_reward``; a plan that costs nothing (a model of zero cost) 1."""
    if not np.isfinite(value):
        return inst.infeasible_reward
    return inst.reference / value if value > 0 else 1.0


# --- observation -----------------------------------------------------------------------------


def observation_size(n_devices: int, lookahead: int) -> int:
    return WIDTH * (1 + lookahead) + DEVICE_FEATURES * n_devices + GLOBAL_FEATURES


def observe(inst: Instance, state: State) -> np.ndarray:
    """Flat float32 vector in ``[-1, 1]``: encodings of layers ``i..i+lookahead`` (zero rows
    past the end), then per device (speed, memory left, remaining layers fit, used, holds the
    open stage), then global features (progress, layers left, stages opened, open stage size,
    its FLOP share, its load ``t / (t + balanced)``)."""
    L, D, i = inst.n_layers, inst.n_devices, state.layer
    rows = np.zeros((1 + inst.lookahead, WIDTH), dtype=np.float32)
    ahead = inst.encoding[i : i + 1 + inst.lookahead]
    rows[: len(ahead)] = ahead
    dev = np.zeros((D, DEVICE_FEATURES))
    dev[:, 0] = inst.speed
    used = np.zeros(D)
    left = inst.capacity.copy()
    ends = (*state.starts[1:], i) if state.starts else ()
    for s, e, d in zip(state.starts, ends, state.devices, strict=True):
        used[d] = 1.0
        left[d] -= inst.stage_memory(s, e)
    dev[:, 1] = np.clip(left / inst.capacity, 0.0, 1.0)
    rest = inst.stage_memory(min(i, L), L)
    dev[:, 2] = np.clip(left / rest, 0.0, 1.0) if rest > 0 else 1.0
    dev[:, 3] = used
    glob = np.zeros(GLOBAL_FEATURES)
    glob[0], glob[1] = i / L, (L - i) / L
    glob[2] = len(state.starts) / D
    if state.starts:
        start, d = state.starts[-1], state.devices[-1]
        dev[d, 4] = 1.0
        glob[3] = (i - start) / L
        total_flops = inst.flops[-1]
        glob[4] = (inst.flops[i] - inst.flops[start]) / total_flops if total_flops > 0 else 0.0
        t = inst.time[d, i] - inst.time[d, start]
        balanced = inst.time[:, -1].min() / D
        glob[5] = t / (t + balanced) if t + balanced > 0 else 0.0
    out = np.concatenate([rows.ravel(), dev.ravel(), glob]).astype(np.float32)
    return np.clip(out, -1.0, 1.0)


# --- the gymnasium shell ---------------------------------------------------------------------


class PlacementEnv(gym.Env[dict[str, np.ndarray], int]):
    """Place a model's layers, one per step, into pipeline stages on a heterogeneous cluster.

    ## Description

    TAPP's task allocation as an MDP (DESIGN.md, "TAPP planner and the MDP"). Step ``i``
    decides layer ``i`` of the profile (layers in topological order): keep it in the stage
    that holds layer ``i-1``, or open a new stage for it on an unused device. At the end the
    stages form a :class:`core.plan.Plan` (one device per stage, equal microbatches of
    ``global_batch / microbatches`` samples) that the contract cost model costs.

    ## Action Space

    ``Discrete(D + 1)`` for a cluster of ``D`` devices (``cluster.device_ids`` order):
    ``0`` keeps layer ``i`` in the open stage, ``d >= 1`` opens a new stage on device
    ``d - 1``. The ``action_mask`` forbids: staying at layer 0 (a stage must be opened),
    staying when the layers left are just enough for the stages ``min_stages`` still needs,
    devices already used, opening beyond ``max_stages``, and actions whose stage would not
    fit its device's memory (unless no action fits). A masked action is replaced by the first
    allowed one and ``info["repaired"]`` is set.

    ## Observation Space

    ``Dict(observations=Box(-1, 1, (32 (1 + lookahead) + 5 D + 6,)), action_mask=Box(0, 1,
    (D + 1,)))``, float32, as RLlib's action-masking modules expect. ``observations`` holds
    the TAPP encoding (:mod:`envs.encoding`) of layer ``i`` and the next ``lookahead`` layers
    (zero rows past the end), per device its speed (FLOP/s over the fastest), memory left
    (fraction), whether the remaining layers would fit in that memory (ratio, capped at 1),
    the used flag and whether it holds the open stage; then progress ``i / L``, layers left,
    stages opened ``/ D``, and the open stage's size ``/ L``, FLOP share and load
    ``t / (t + T / D)`` (``t`` its compute time on its device, ``T`` the whole model's on
    the fastest device).

    ## Rewards

    0 on every step but the last. The last is ``reference / value`` where ``value`` is the
    objective value of the plan (batch time for ``time``/``throughput``, $ per sample for
    ``cost``) and ``reference`` that of the whole batch computed on the best single device
    without communication or update; ``infeasible_reward`` (default 0) when the plan does
    not fit in memory or misses ``min_throughput``.

    ## Starting State

    No layer placed. With several profiles, ``reset`` picks one uniformly with
    ``self.np_random``.

    ## Episode End

    Terminates after ``L`` steps, when every layer is placed; ``info`` then holds ``plan``,
    ``estimate`` (:class:`core.costmodel.Estimate`), ``value`` and ``feasible``. Never
    truncated.

    ## Arguments

    ``config`` (a dict): ``profile`` (a ModelProfile, a path to a profile JSON, or a list of
    either), ``cluster`` (a ClusterSpec or a path), ``objective`` (``time`` | ``throughput``
    | ``cost``, default ``time``), ``global_batch`` (64), ``microbatches`` (the count M, 4),
    ``schedule`` (``gpipe``), ``min_throughput`` (None; cost objective), ``min_stages`` (1),
    ``max_stages`` (None = D), ``lookahead`` (2), ``infeasible_reward`` (0.0).
    """

    metadata: dict[str, Any] = {"render_modes": []}
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
            "lookahead",
            "infeasible_reward",
        }
    )

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.instances = _instances_from_config(dict(config or {}), self._KEYS)
        first = self.instances[0]
        n = first.n_devices
        self.action_space = spaces.Discrete(n + 1)
        self.observation_space = spaces.Dict(
            {
                "observations": spaces.Box(
                    -1.0, 1.0, (observation_size(n, first.lookahead),), np.float32
                ),
                "action_mask": spaces.Box(0.0, 1.0, (n + 1,), np.float32),
            }
        )
        self.instance = first
        self.state = initial_state()

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
        self.state = initial_state()
        return self._obs(), {"profile": self.instance.profile.name}

    def step(self, action: int) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        if is_terminal(self.instance, self.state):
            raise RuntimeError("step() after the episode ended; call reset()")
        chosen = legal_action(action_mask(self.instance, self.state), int(action))
        self.state = transition(self.state, chosen)
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
