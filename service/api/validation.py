"""A request is validated completely before anything is queued (API.md, "Jobs").

- the job's ``spec`` as its kind's request model (:data:`~service.api.schemas.SPEC_MODELS`);
- the limits of DESIGN.md on every count and size, read off the documents before the core
  builds anything from them (so a cluster of 10^8 devices or a plan of 10^18 microbatches is
  refused at once instead of tying up a worker), and no ``inf`` or ``nan`` anywhere;
- the use-case's own checks that need no cluster: documents, preset names, planner names
  and options, the objective, the model reference (its form only: a factory is never
  imported here, and an ``hf:`` model never built);
- a reference to code (``model``, ``example``, a train job's ``data`` and ``loss``:
  ``package.module:attr``) only where the setting ``allow_code`` (``PIPEPLAN_ALLOW_CODE``)
  is on;
- a train job's paths (``checkpoint_dir``, a ``resume_from`` path, ``imagefolder:PATH``
  and ``tokens:PATH`` data) absolute: the job runs in a working folder of Ray's own. A
  job id in ``resume_from``, and the default ``checkpoint_dir``, are the route's to
  resolve (:mod:`service.api.training`).

Every refusal is a :class:`~service.tasks.common.RequestError` (422) whose one-line message
names the field and the value, as the CLI prints it. :class:`BodyLimit` answers 413 to a
body over ``max_body_bytes``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeplan.agents.problem import Budget
from pipeplan.agents.registry import make_planner
from pipeplan.core.limits import (
    MAX_DEVICES_PER_NODE,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_NODES,
)
from pipeplan.core.model_refs import names_code
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.config import RunConfig, check_engine
from pipeplan.executor.data_spec import DataSpec
from pipeplan.executor.loss_spec import LossSpec
from pipeplan.models import zoo_names
from pipeplan.models.reference import check_input, reference_kind
from pipeplan.service.api.schemas import (
    EVENT_DATA,
    FIELD_BOUNDS,
    SPEC_MODELS,
    EventIn,
    JobCreate,
    JobKind,
)
from pipeplan.service.api.training import is_job_ref
from pipeplan.service.tasks.requests import (
    CompareRequest,
    ModelFields,
    PlanRequest,
    ProblemRequest,
    ProfileRequest,
    RequestError,
    Reward,
    RunRequest,
    TrainRequest,
    check_plan_fields,
    check_problem_fields,
    check_source,
    check_train_fields,
    cluster_spec,
    measured_budget,
    planner_names,
    planner_options,
    problem_of,
    train_config,
)
from pipeplan.service.tasks.simulate import SimulateRequest

# DESIGN.md's limits are core.limits', checked here on the raw documents before the core
# builds anything from them; the ranges of a request's own number fields are
# schemas.FIELD_BOUNDS (the OpenAPI document states them); below, the service's own bounds
# on the work a request may ask of it
MAX_SIMULATED_OPS = 2**16
"""Forward microbatches over all stages of one plan ``POST /v1/simulate`` costs: the estimate
runs in the request's worker, so this keeps it well under a second."""
MAX_DEVICES = 65_536
"""Devices in one cluster: within the per-node and node limits a cluster could still hold
2^24 devices, which takes the core tens of seconds to read."""


JOB_KINDS = frozenset(kind.value for kind in JobKind)
JOB_FIELDS = frozenset(JobCreate.model_fields)
"""A job request's fields: an error's path through them leaves out the union's tag."""


def one_line(errors: Sequence[Any]) -> str:
    """Pydantic's first error as the CLI prints it: ``field: why, got VALUE``. A job
    request's error names the field as the request spells it (``spec.batch``), without the
    kind pydantic puts first to say which model of the union it tried."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    if len(loc) > 1 and loc[0] in JOB_KINDS and loc[1] in JOB_FIELDS:
        loc = loc[1:]
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        return _bad_tag(first)
    where = ".".join(loc) or "request"
    return f"{where}: {first.get('msg', 'invalid')}, got {_short(first.get('input'))}"


def _bad_tag(error: Mapping[str, Any]) -> str:
    """A union's tag that is missing or names no model: ``kind`` (or the union's own tag
    field), and the values it may take."""
    ctx = error.get("ctx") or {}
    field = str(ctx.get("discriminator", "'kind'")).strip("'")
    body = error.get("input")
    if error.get("type") == "union_tag_not_found":
        return f"{field}: Field required, got {_short(body)}"
    tags = [repr(kind.value) for kind in JobKind] if field == "kind" else []
    expected = f"{', '.join(tags[:-1])} or {tags[-1]}" if tags else ctx.get("expected_tags")
    return f"{field}: Input should be {expected}, got {_short(ctx.get('tag'))}"


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _limit(where: str, value: Any, limit: int, what: str = "") -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value > limit:
        raise RequestError(f"{where}: {value}{what} is over the limit of {limit}")


def _at(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def check_finite(doc: Any, where: str = "") -> None:
    """No ``inf`` or ``nan`` anywhere in ``doc`` (JSON has neither; the core refuses them)."""
    stack = [(doc, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"{at or 'request'}: must be a finite number, got {value!r}")
        if isinstance(value, Mapping):
            stack.extend((v, _at(at, str(k))) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))


def check_cluster_limits(doc: Any, where: str = "cluster") -> None:
    """Nodes (a catalogue's ``count`` included) and devices per node within the limits."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("nodes"), list):
        return
    nodes = devices_in_all = 0
    for i, node in enumerate(doc["nodes"]):
        count = node.get("count", 1) if isinstance(node, Mapping) else 1
        count = count if isinstance(count, int) and not isinstance(count, bool) else 1
        nodes += count
        devices = node.get("devices") if isinstance(node, Mapping) else None
        if isinstance(devices, Mapping):
            total = sum(n for n in devices.values() if isinstance(n, int))
            _limit(f"{where}.nodes[{i}].devices", total, MAX_DEVICES_PER_NODE, " devices")
            devices_in_all += total * count
    _limit(f"{where}.nodes", nodes, MAX_NODES, " nodes")
    _limit(f"{where}.nodes", devices_in_all, MAX_DEVICES, " devices in all")


def check_profile_limits(doc: Any, where: str = "profile") -> None:
    if isinstance(doc, Mapping) and isinstance(doc.get("layers"), list):
        _limit(f"{where}.layers", len(doc["layers"]), MAX_LAYERS, " layers")


def check_plan_limits(doc: Any, where: str = "plan") -> None:
    """``global_batch`` and every stage's microbatch count within the limits."""
    if not isinstance(doc, Mapping):
        return
    batch = doc.get("global_batch")
    _limit(f"{where}.global_batch", batch, MAX_GLOBAL_BATCH)
    stages = doc.get("stages")
    if not isinstance(batch, int) or not isinstance(stages, list):
        return
    _limit(f"{where}.stages", len(stages), MAX_LAYERS, " stages")
    for i, stage in enumerate(stages):
        mb = stage.get("microbatch") if isinstance(stage, Mapping) else None
        if isinstance(mb, int) and not isinstance(mb, bool) and mb >= 1:
            _limit(f"{where}.stages[{i}].microbatch", batch // mb, MAX_MICROBATCHES,
                   f" microbatches (global_batch {batch} / microbatch {mb})")  # fmt: skip


def check_bounds(request: BaseModel, where: str = "") -> None:
    """Every number field of ``request`` (and of its nested requests, such as ``budget``)
    in its range of :data:`~service.api.schemas.FIELD_BOUNDS`."""
    for name, value in request.__dict__.items():
        at = _at(where, name)
        if isinstance(value, BaseModel):
            check_bounds(value, at)
            continue
        bound = FIELD_BOUNDS.get(name)
        if bound is None or not isinstance(value, int | float) or isinstance(value, bool):
            continue
        if bound.low is not None and bound.open_low and not value > bound.low:
            raise RequestError(f"{at}: must be > {bound.low}, got {value}")
        if bound.low is not None and not bound.open_low and not value >= bound.low:
            raise RequestError(f"{at}: must be >= {bound.low}, got {value}")
        if bound.high is not None and value > bound.high:
            raise RequestError(f"{at}: {value} is over the limit of {bound.high}")


def check_limits(request: BaseModel, where: str = "") -> None:
    """Every count and size of a request within its limit, before the core reads it."""
    check_finite(request.model_dump(mode="python"), where)
    fields = request.__dict__
    check_cluster_limits(fields.get("cluster"), _at(where, "cluster"))
    check_profile_limits(fields.get("profile"), _at(where, "profile"))
    check_plan_limits(fields.get("plan"), _at(where, "plan"))
    check_bounds(request, where)


CODE_FIELDS = ("model", "example", "data", "loss")
"""Request fields that may name code to import (``package.module:attr``)."""
PATH_DATA = ("imagefolder", "tokens")
"""The ``data`` forms ``KIND:PATH``: a path, not code, whatever the path looks like."""


def _names_code(name: str, value: str) -> bool:
    if name == "data" and value.partition(":")[0] in PATH_DATA:
        return False
    return names_code(value)


def check_code(request: BaseModel, allow_code: bool) -> None:
    """Refuse a reference to code unless the service allows it (``PIPEPLAN_ALLOW_CODE``)."""
    if allow_code:
        return
    for name in CODE_FIELDS:
        value = getattr(request, name, None)
        if isinstance(value, str) and _names_code(name, value):
            raise RequestError(
                f"{name}: {value!r} names code to import, which this service refuses "
                "(PIPEPLAN_ALLOW_CODE is off)"
            )


def check_model(model: str | None, input_size: int | None, fields: ModelFields) -> None:
    """A model reference's form and input fields; a zoo model's input size (with its
    default options: the job checks the options' values). A factory is not imported, an
    ``hf:`` model not built, a zoo model not built: the job does all three."""
    if model is None:
        return
    if model not in zoo_names.MODELS and not model.startswith("hf:") and ":" not in model:
        raise RequestError(f"model: unknown model {model!r} (one of {', '.join(zoo_names.MODELS)})")
    reference_kind(model)
    check_input(model, input_size, fields.input_shape, fields.input_dtype, fields.example)
    if model in zoo_names.MODELS and input_size is not None and not fields.model_options:
        zoo_names.check_size(model, input_size, {})


def _stand_in(name: str) -> ModelProfile:
    """A one-layer profile: :class:`Problem` checks only the batch, objective and budget
    against it, so a zoo model is not profiled just to validate a request."""
    layer = {"name": "x", "op": "other", "params_bytes": 0, "flops": 0, "activation_bytes": 0}
    return ModelProfile.from_dict({"name": name, "layers": [layer]})


def check_problem(request: ProblemRequest, default_budget: Budget | None = None) -> None:
    """What :func:`~service.tasks.common.build_problem` checks, without profiling."""
    check_problem_fields(request)
    spec = cluster_spec(request.cluster)
    check_model(request.model, request.input_size, request)
    if request.profile is not None:
        prof = ModelProfile.from_dict(request.profile)
    else:
        prof = _stand_in(request.model or "model")
    problem_of(request, prof, spec, request.budget.resolve(default_budget or Budget()))


def _check_plan(request: PlanRequest) -> None:
    check_plan_fields(request)
    measured = request.reward is Reward.MEASURED
    check_problem(request, measured_budget() if measured else None)
    make_planner(request.planner, **planner_options(request.options))


def _check_compare(request: CompareRequest) -> None:
    planner_names(request.planners)
    check_problem(request)


def _check_profile(request: ProfileRequest) -> None:
    check_model(request.model, request.input_size, request)
    if request.address is not None and not request.measure:
        raise RequestError("address: only applies with measure")
    if request.measure and request.device_type is not None:
        raise RequestError("device_type: not with measure (every type of the cluster is timed)")
    if request.cluster is not None:  # without one, a job times on the cluster it runs in
        cluster_spec(request.cluster)


def _check_run(request: RunRequest) -> None:
    plan = Plan.from_dict(request.plan)
    prof = ModelProfile.from_dict(request.profile) if request.profile is not None else None
    check_source(
        request.model,
        request.input_size,
        prof,
        options=request.model_options,
        input_shape=request.input_shape,
        input_dtype=request.input_dtype,
        example=request.example,
    )
    check_model(request.model, request.input_size, request)
    config = RunConfig(
        steps=request.steps,
        warmup=request.warmup,
        data=request.data.value,
        seed=request.seed,
        timeout_s=request.timeout_s,
        engine=request.engine.value,
        emulate=request.emulate,
    )
    spec = cluster_spec(request.cluster) if request.cluster is not None else None
    if spec is not None or prof is not None:
        plan.validate(prof, spec)
    check_engine(plan, spec, config)


def check_absolute(field: str, path: str) -> None:
    """``path`` is absolute (a job's working folder is Ray's, not the caller's)."""
    if not PurePath(path).is_absolute():
        raise RequestError(
            f"{field}: the service needs an absolute path (the job runs in a folder of "
            f"Ray's), got {path!r}"
        )


def _check_train_paths(request: TrainRequest) -> None:
    if request.checkpoint_dir is not None:
        check_absolute("checkpoint_dir", request.checkpoint_dir)
    if request.resume_from is not None and not is_job_ref(request.resume_from):
        check_absolute("resume_from", request.resume_from)
    data = DataSpec.parse(request.data)
    if data.path is not None:
        check_absolute("data", request.data.partition(":")[2])


def _check_train(request: TrainRequest) -> None:
    """A train job's own fields, its plan (or planner), data, loss and optimizer. Without
    ``checkpoint_dir`` the route gives the job its folder's, so ``checkpoint_every`` and
    ``resume_from`` are checked as they will run."""
    folder = request.checkpoint_dir or "job folder"
    check_train_fields(request.model_copy(update={"checkpoint_dir": folder}))
    _check_train_paths(request)
    LossSpec.parse(request.loss)
    if not request.timeout_s > 0:
        raise RequestError(f"timeout_s: must be > 0, got {request.timeout_s}")
    config = train_config(request, request.steps or 1, Path(folder), None)
    if request.planner is not None:
        fields = {f: getattr(request, f) for f in ProblemRequest.model_fields}
        _check_plan(PlanRequest(**fields, planner=request.planner, options=request.options))
    elif request.plan is not None:
        check_problem(request)
        plan = Plan.from_dict(request.plan)
        prof = ModelProfile.from_dict(request.profile) if request.profile is not None else None
        spec = cluster_spec(request.cluster)
        plan.validate(prof, spec)
        check_engine(plan, spec, config.run_config())


CHECKS: dict[JobKind, Callable[[Any], None]] = {
    JobKind.PROFILE: _check_profile,
    JobKind.PLAN: _check_plan,
    JobKind.COMPARE: _check_compare,
    JobKind.RUN: _check_run,
    JobKind.TRAIN: _check_train,
}


def validate_job(create: JobCreate, allow_code: bool = False) -> BaseModel:
    """The job's spec as its request model, checked completely; :class:`RequestError`
    (the field and the value) otherwise. ``allow_code``: the setting of that name."""
    if create.name is not None and "\x00" in create.name:
        raise RequestError(f"name: must not hold a NUL character, got {create.name!r}")
    try:
        request = SPEC_MODELS[create.kind].model_validate(create.spec)
    except ValidationError as e:
        errors = [{**err, "loc": ("spec", *err["loc"])} for err in e.errors()]
        raise RequestError(one_line(errors)) from None
    check_limits(request, "spec")
    check_code(request, allow_code)
    CHECKS[create.kind](request)
    return request


def validate_simulate(request: SimulateRequest) -> None:
    """The limits of a simulation, and a bound on its work, before the core reads it."""
    check_limits(request)
    if request.uniform is not None:
        u = request.uniform
        _limit("uniform.batch", u.batch, MAX_GLOBAL_BATCH)
        _limit("uniform.microbatches", u.microbatches, MAX_MICROBATCHES)
        _limit("uniform.devices", u.devices, MAX_DEVICES)
        ops = u.devices * u.microbatches
        _limit("uniform", ops, MAX_SIMULATED_OPS, " microbatches over all stages")
    plan = request.plan
    if isinstance(plan, Mapping) and isinstance(plan.get("stages"), list):
        batch = plan.get("global_batch")
        ops = sum(
            batch // s["microbatch"]
            for s in plan["stages"]
            if isinstance(s, Mapping)
            and isinstance(batch, int)
            and isinstance(s.get("microbatch"), int)
            and s["microbatch"] >= 1
        )
        _limit("plan.stages", ops, MAX_SIMULATED_OPS, " microbatches over all stages")


def check_event_data(events: Sequence[EventIn], batch: bool) -> None:
    """Each event's ``data`` as its type's model (:data:`~service.api.schemas.EVENT_DATA`),
    as the document states it; :class:`RequestError` naming the field and the value."""
    for i, event in enumerate(events):
        model = EVENT_DATA.get(event.type)
        if model is None:
            continue
        try:
            model.model_validate(event.data)
        except ValidationError as e:
            where = f"batch.{i}.data" if batch else "data"
            errors = [{**err, "loc": (where, *err["loc"])} for err in e.errors()]
            raise RequestError(one_line(errors)) from None


class BodyLimit:
    """413 for a request body over ``max_bytes``: by its ``Content-Length`` before it is
    read, and by what arrives while it streams."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self, size: int | str) -> bytes:
        detail = f"request body: {size} bytes is over the limit of {self.max_bytes} bytes"
        return json.dumps({"detail": detail}).encode()

    async def _refuse(self, send: Send, size: int | str) -> None:
        body = self._message(size)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, int(length))
            return
        received, started = 0, False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(received, self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge as e:
            if started:
                raise
            await self._refuse(send, f"more than {e.size}")


class _TooLarge(HTTPException):
    """Raised while a body streams in; the app's handler answers it (413)."""

    def __init__(self, size: int, max_bytes: int) -> None:
        detail = f"request body: more than {size} bytes is over the limit of {max_bytes} bytes"
        super().__init__(413, detail)
        self.size = size
