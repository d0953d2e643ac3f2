"""The placement env's config: its keys and defaults, their validation, and the
:class:`envs.mdp.Instance` built from them.

Every check runs before any table is built, and every error names the key and the value
(:class:`EnvConfigError`), so a bad config from RLlib's ``env_config`` or the CLI fails at
construction, not in the middle of an episode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeplan.core import rules
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.errors import PipeplanError
from pipeplan.core.objective import Objective, score
from pipeplan.core.plan import Schedule
from pipeplan.core.profile import ModelProfile
from pipeplan.core.tables import CostTables
from pipeplan.envs.encoding import encode_profile
from pipeplan.envs.mdp import ACTION_SPACES, LAYERS, STAGES, Instance


class EnvConfigError(PipeplanError):
    """The env config is malformed; the message names the key and the value."""


@dataclass(frozen=True)
class EnvOptions:
    """The env config's keys besides ``profile`` and ``cluster``, with their defaults."""

    objective: Objective | str = Objective.TIME
    """``time`` | ``throughput`` | ``cost`` (:class:`core.objective.Objective`)."""
    global_batch: int = 64
    """Samples per training batch."""
    microbatches: int | Sequence[int] | None = 4
    """The microbatch count M; a list of counts, or None for every divisor of
    ``global_batch``: then the first step chooses one."""
    schedule: Schedule | str = Schedule.GPIPE
    """The pipeline schedule the plans are costed with."""
    min_throughput: float | None = None
    """Samples/s a plan must reach (cost objective)."""
    min_stages: int = 1
    """Fewest stages a plan may have."""
    max_stages: int | None = None
    """Most stages a plan may have; None: as many as devices."""
    max_replicas: int = 1
    """Devices per stage (1: no replica actions)."""
    lookahead: int = 2
    """Layers after the current one whose encodings the observation holds."""
    infeasible_reward: float = 0.0
    """The reward of a plan that does not fit in memory or misses ``min_throughput``."""
    actions: str = LAYERS
    """The action space (:data:`envs.mdp.ACTION_SPACES`): ``layers`` (one layer per step) or
    ``stages`` (open a stage, add replicas, choose its end)."""
    exploring_starts: float = 0.0
    """Probability that an episode starts after a few random legal actions, each of a random
    kind (:func:`envs.mdp.exploring_start`), instead of from the empty plan."""
    start_steps: int = 3
    """The most random actions an exploring start takes (at least one)."""
    elite_starts: float = 0.0
    """Probability that an episode starts from a random proper prefix of an elite episode's
    actions (:func:`envs.mdp.elite_start`; the elites are those given to
    :meth:`envs.env.PlacementEnv.set_elites`, none: the other starts)."""
    twin_opens: bool = False
    """``stages`` only: D more actions, each opening a stage on a device together with its
    free twins (the free devices of its type on its node, up to ``max_replicas``) as
    replicas: one decision for what otherwise takes an open and a replica step per twin."""
    elite_mutations: float = 0.0
    """Probability that an elite start replaces the last action of its prefix by another of
    the same kind (:func:`envs.mdp.elite_start`)."""
    stage_sizes: bool = False
    """``stages`` with several counts only: after each stage's end, one more step chooses
    that stage's own microbatch size among the counts' sizes (UMPIPE's unequal microbatches);
    False: every stage takes the shared one."""


OPTION_KEYS: tuple[str, ...] = tuple(f.name for f in fields(EnvOptions))
CONFIG_KEYS: frozenset[str] = frozenset({"profile", "cluster", *OPTION_KEYS})
"""Every key :class:`envs.env.PlacementEnv`'s config may hold."""


def make_instance(profile: ModelProfile, cluster: ClusterSpec, **options: Any) -> Instance:
    """Check the options (the keys of :class:`EnvOptions`) and precompute the tables of one
    profile on one cluster."""
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise EnvConfigError(
            f"config: unknown key {unknown[0]!r} (known: {', '.join(sorted(CONFIG_KEYS))})"
        )
    opt = EnvOptions(**options)
    n_dev = len(cluster.device_ids)
    top = n_dev if opt.max_stages is None else opt.max_stages
    counts = _counts(opt.global_batch, opt.microbatches)
    objective, schedule = _check_options(opt, top, n_dev)
    _check_stage_sizes(opt, counts)
    if opt.min_stages > len(profile):
        raise EnvConfigError(
            f"min_stages: {opt.min_stages} exceeds the {len(profile)} layers of {profile.name!r}"
        )
    tb = CostTables.of(profile, cluster)
    fixed = tb.fb_fixed_prefix[tb.dev_type]  # (D, L+1)
    per_sample = tb.fb_per_sample_prefix[tb.dev_type]
    B = opt.global_batch
    ref_time = rules.compute_s(fixed[:, -1], per_sample[:, -1], B)  # whole batch, each device
    reference = score(objective, ref_time, np.ones(n_dev, bool), tb.dev_price, global_batch=B)
    return Instance(
        profile=profile,
        cluster=cluster,
        objective=objective,
        global_batch=B,
        counts=counts,
        schedule=schedule,
        min_throughput=opt.min_throughput,
        min_stages=opt.min_stages,
        max_stages=top,
        max_replicas=opt.max_replicas,
        lookahead=opt.lookahead,
        infeasible_reward=opt.infeasible_reward,
        encoding=encode_profile(profile),
        params=tb.params_prefix,
        acts=tb.acts_prefix,
        flops=tb.flops_prefix,
        fixed=fixed,
        per_sample=per_sample,
        capacity=tb.dev_capacity,
        speed=tb.dev_flops / tb.dev_flops.max(),
        node=tb.dev_node,
        kind=tb.dev_node * len(tb.type_index) + tb.dev_type,
        membw=tb.dev_membw,
        cuts=tb.cuts,
        link_lat=tb.link_lat,
        link_bps=tb.link_bps,
        reference=float(reference.min()),
        actions=opt.actions,
        exploring_starts=float(opt.exploring_starts),
        start_steps=opt.start_steps,
        elite_starts=float(opt.elite_starts),
        elite_mutations=float(opt.elite_mutations),
        stage_sizes=bool(opt.stage_sizes),
        twin_opens=bool(opt.twin_opens),
    )


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


def _check_options(opt: EnvOptions, max_stages: int, n_devices: int) -> tuple[Objective, Schedule]:
    """Check the options that ``_counts`` does not; the objective and schedule as enums."""
    try:
        objective = Objective(opt.objective)
    except ValueError:
        known = ", ".join(o.value for o in Objective)
        raise EnvConfigError(f"objective: unknown {opt.objective!r} (one of {known})") from None
    try:
        schedule = Schedule(opt.schedule)
    except ValueError:
        known = ", ".join(s.value for s in Schedule)
        raise EnvConfigError(f"schedule: unknown {opt.schedule!r} (one of {known})") from None
    if not 1 <= opt.min_stages <= max_stages <= n_devices:
        raise EnvConfigError(
            f"min_stages/max_stages: need 1 <= {opt.min_stages} <= {max_stages} <= {n_devices} "
            "(the cluster's devices)"
        )
    if not _is_int(opt.max_replicas) or not 1 <= opt.max_replicas <= n_devices:
        raise EnvConfigError(
            f"max_replicas: must be an integer in [1, {n_devices}] (the cluster's devices), "
            f"got {opt.max_replicas!r}"
        )
    if opt.lookahead < 0:
        raise EnvConfigError(f"lookahead: must be >= 0, got {opt.lookahead}")
    for key in ("exploring_starts", "elite_starts", "elite_mutations"):
        if not 0.0 <= getattr(opt, key) <= 1.0:
            raise EnvConfigError(f"{key}: must be in [0, 1], got {getattr(opt, key)!r}")
    if not _is_int(opt.start_steps) or opt.start_steps < 1:
        raise EnvConfigError(f"start_steps: must be an integer >= 1, got {opt.start_steps!r}")
    if opt.actions not in ACTION_SPACES:
        raise EnvConfigError(
            f"actions: unknown {opt.actions!r} (one of {', '.join(ACTION_SPACES)})"
        )
    return objective, schedule


def _check_stage_sizes(opt: EnvOptions, counts: tuple[int, ...]) -> None:
    """``stage_sizes`` is a bool, and True only where a stage has sizes to choose from;
    ``twin_opens`` a bool, True with the ``stages`` actions only."""
    if not isinstance(opt.twin_opens, bool | np.bool_):
        raise EnvConfigError(f"twin_opens: must be true or false, got {opt.twin_opens!r}")
    if opt.twin_opens and opt.actions != STAGES:
        raise EnvConfigError(
            f"twin_opens: True needs actions {STAGES!r}, got actions {opt.actions!r}"
        )
    if not isinstance(opt.stage_sizes, bool | np.bool_):
        raise EnvConfigError(f"stage_sizes: must be true or false, got {opt.stage_sizes!r}")
    if opt.stage_sizes and (opt.actions != STAGES or len(counts) < 2):
        raise EnvConfigError(
            f"stage_sizes: True needs actions {STAGES!r} and several microbatch counts, got "
            f"actions {opt.actions!r} and counts {list(counts)}"
        )


def instances_from_config(config: Mapping[str, Any]) -> list[Instance]:
    """One :class:`Instance` per profile of an env config (``profile``: one or a list of
    ModelProfiles or paths; ``cluster``: a ClusterSpec or a path; the rest
    :class:`EnvOptions`)."""
    unknown = sorted(set(config) - CONFIG_KEYS)
    if unknown:
        raise EnvConfigError(
            f"config: unknown key {unknown[0]!r} (known: {', '.join(sorted(CONFIG_KEYS))})"
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
    made = [make_instance(_load_profile(p), cluster, **options) for p in profiles]
    slots = max(inst.n_layers for inst in made)  # one action space for every profile
    return [replace(inst, slots=slots) for inst in made]


def _load_profile(p: Any) -> ModelProfile:
    if isinstance(p, ModelProfile):
        return p
    if isinstance(p, str | Path):
        return ModelProfile.load(p)
    raise EnvConfigError(f"config.profile: expected a ModelProfile or a path, got {p!r}")
