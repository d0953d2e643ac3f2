"""The use-cases called directly with requests, as the REST API will call them: no typer,
no console; bad requests name the field and the value."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Sized
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from pipeplan.agents.problem import ProblemError
from pipeplan.agents.rewards import Population
from pipeplan.agents.search import Progress
from pipeplan.core.batch_eval import PlanBatch
from pipeplan.core.costmodel import simulate as cost_model
from pipeplan.core.errors import FormatError
from pipeplan.core.formats.pipedream import load_pipedream
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.service.cli.console import validation_message
from pipeplan.service.tasks.common import Document, RequestError, cluster_spec, presets
from pipeplan.service.tasks.compare import CompareRequest, compare
from pipeplan.service.tasks.plan import PlanRequest, plan
from pipeplan.service.tasks.progress import Reporter
from pipeplan.service.tasks.simulate import (
    Kind,
    SimulateRequest,
    UniformPlan,
    ValidateRequest,
    simulate,
    validate,
)
from tests.core.test_formats import CLUSTER, PLAN, PROFILE

ROOT = Path(__file__).resolve().parents[2]


def plans_of_any(plans: Population) -> Sized:
    return plans if not isinstance(plans, PlanBatch) else range(plans.size)


class Recorder(Reporter):
    """Keeps every report a use-case made."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.searches: list[tuple[str, int | None]] = []
        self.progress: list[tuple[int, float]] = []
        self.evaluations: list[float] = []

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        self.steps.append(text)
        yield

    @contextmanager
    def search(self, label: str, total: int | None) -> Iterator[Progress]:
        self.searches.append((label, total))
        yield lambda evaluations, best: self.progress.append((evaluations, best))

    def evaluated(
        self,
        plans: Population,
        values: np.ndarray,
        details: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        assert len(plans_of_any(plans)) == len(values)
        assert details is None or len(details) == len(values)
        self.evaluations.extend(values.tolist())


@pytest.fixture(scope="module")
def alexnet() -> Document:
    path = ROOT / "tests/data/pipedream/alexnet.graph.txt"
    return load_pipedream(path, 256, "v100").to_dict()


# --- plan ---------------------------------------------------------------------------------------


def test_plan_returns_the_document_plan_json_prints(alexnet: Document) -> None:
    recorder = Recorder()
    request = PlanRequest(profile=alexnet, cluster="cloud-mix", planner="greedy", batch=32)
    done = plan(request, recorder)
    doc = done.to_dict()
    keys = {"plan", "estimate", "planner", "evaluations", "wall_time_s"}
    assert set(doc) == keys | {"lower_bound_s", "ratio_to_bound", "bound"}
    assert doc["planner"] == "greedy" and doc["plan"]["global_batch"] == 32
    plan_ = Plan.from_dict(doc["plan"])
    est = cost_model(plan_, ModelProfile.from_dict(alexnet), cluster_spec("cloud-mix"))
    assert doc["estimate"]["batch_time_s"] == est.batch_time_s
    assert recorder.searches == [("greedy", 20_000)]
    assert recorder.progress and recorder.progress[-1][0] == doc["evaluations"]
    assert len(recorder.evaluations) == doc["evaluations"]
    assert min(recorder.evaluations) == done.result.value


def test_plan_request_from_json_with_options_and_budget(alexnet: Document) -> None:
    request = PlanRequest.model_validate(
        {
            "profile": alexnet,
            "cluster": "local-hetero",
            "planner": "brute",
            "objective": "time",
            "budget": {"evaluations": 50_000},
            "options": {"max_stages": 2, "max_replicas": 1},
        }
    )
    done = plan(request)
    assert done.problem.budget.evaluations == 50_000
    assert len(done.result.plan.stages) <= 2


@pytest.mark.parametrize(
    ("fields", "field", "value"),
    [
        ({"objective": "speed"}, "objective", "speed"),
        ({"batch": "many"}, "batch", "many"),
        ({"nosuch": 1}, "nosuch", 1),
        ({"budget": {"evaluations": "all"}}, "budget.evaluations", "all"),
    ],
)
def test_a_malformed_request_names_the_field_and_the_value(
    alexnet: Document, fields: dict[str, object], field: str, value: object
) -> None:
    with pytest.raises(ValidationError) as e:
        PlanRequest.model_validate({"cluster": "cloud-mix", "planner": "uniform", **fields})
    message = validation_message(e.value)
    assert message.startswith(f"{field}: ") and message.endswith(f"got {value!r}")


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"planner": "nosuch"}, RequestError, "planner: unknown planner 'nosuch'"),
        ({"cluster": "nosuch"}, RequestError, "cluster: unknown preset 'nosuch'"),
        ({"objective": "cost"}, RequestError, "min_throughput: required with objective cost"),
        ({"batch": 0}, ProblemError, "global_batch: must be an integer >= 1, got 0"),
        ({"budget": {"evaluations": 0}}, ProblemError, "budget.evaluations: must be >= 1, got 0"),
        ({"options": {"nosuch": 1}}, ProblemError, "planner 'uniform': bad options"),
        ({"reward": "measured"}, RequestError, "reward: measured applies to tapp and ppo"),
        ({"address": "auto"}, RequestError, "address: only applies where the search uses a Ray"),
        ({"workers": 2}, RequestError, "workers: goes with reward parallel (got workers 2, "),
        ({"reward": "parallel"}, RequestError, "workers: goes with reward parallel (got workers "),
        ({"reward": "parallel", "workers": 0}, RequestError, "workers: must be >= 1, got 0"),
        ({"profile": {"layers": []}}, FormatError, "profile.name"),
    ],
)
def test_a_bad_request_is_a_domain_error_naming_the_field(
    alexnet: Document, fields: dict[str, object], error: type[Exception], message: str
) -> None:
    base = {"profile": alexnet, "cluster": "cloud-mix", "planner": "uniform"}
    with pytest.raises(error, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
        plan(PlanRequest.model_validate({**base, **fields}))


def test_model_or_profile_exactly_one() -> None:
    with pytest.raises(RequestError, match="model, profile: give exactly one"):
        plan(PlanRequest(cluster="cloud-mix", planner="uniform"))


# --- compare ------------------------------------------------------------------------------------


def test_compare_rows_and_document(alexnet: Document) -> None:
    recorder = Recorder()
    request = CompareRequest(
        profile=alexnet, cluster="local-hetero", planners=["uniform", "greedy"], batch=16
    )
    done = compare(request, recorder)
    assert [r.planner for r in done.rows] == ["uniform", "greedy"]
    assert [label for label, _ in recorder.searches] == ["uniform", "greedy"]
    doc = done.to_dict()
    assert doc["exact_reference"] is None and doc["best"] in ("uniform", "greedy")
    assert all(r["ok"] and r["ratio_to_best"] >= 1.0 for r in doc["results"])


@pytest.mark.parametrize(
    ("planners", "message"),
    [(["uniform", "nosuch"], "planners: unknown planner 'nosuch'"), ([" "], "no planner named")],
)
def test_compare_refuses_unknown_planners(
    alexnet: Document, planners: list[str], message: str
) -> None:
    with pytest.raises(RequestError, match=message):
        compare(CompareRequest(profile=alexnet, cluster="cloud-mix", planners=planners))


# --- simulate and validate ------------------------------------------------------------------


def test_simulate_a_plan_document() -> None:
    done = simulate(SimulateRequest(profile=PROFILE, cluster=CLUSTER, plan=PLAN))
    est = cost_model(Plan.from_dict(PLAN), ModelProfile.from_dict(PROFILE), cluster_spec(CLUSTER))
    assert done.to_dict() == est.to_dict()


def test_simulate_a_uniform_plan_and_its_errors() -> None:
    uniform = UniformPlan(devices=3, batch=8, microbatches=2)
    done = simulate(SimulateRequest(profile=PROFILE, cluster=CLUSTER, uniform=uniform))
    assert [s.layers for s in done.plan.stages] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(RequestError, match=r"^uniform.devices: must be in \[1, 3\]"):
        simulate(SimulateRequest(profile=PROFILE, cluster=CLUSTER, uniform=UniformPlan(devices=9)))
    bad = UniformPlan(devices=1, batch=8, microbatches=3)
    with pytest.raises(RequestError, match="uniform.microbatches: 3 does not divide"):
        simulate(SimulateRequest(profile=PROFILE, cluster=CLUSTER, uniform=bad))
    with pytest.raises(RequestError, match="plan, uniform: give exactly one"):
        simulate(SimulateRequest(profile=PROFILE, cluster=CLUSTER))


@pytest.mark.parametrize(("doc", "kind"), [(PROFILE, Kind.PROFILE), (CLUSTER, Kind.CLUSTER),
                                           (PLAN, Kind.PLAN)])  # fmt: skip
def test_validate_tells_the_kind(doc: Document, kind: Kind) -> None:
    done = validate(ValidateRequest(document=doc))
    assert done.kind is kind and done.to_dict()["summary"].startswith(kind.value)


def test_validate_a_plan_against_a_cluster() -> None:
    bad = {**PLAN, "stages": [{"layers": [0, 3], "devices": ["n5/t4:0"], "microbatch": 8}]}
    with pytest.raises(Exception, match=r"stages\[0\].devices: unknown device 'n5/t4:0'"):
        validate(ValidateRequest(document=bad, cluster=CLUSTER))


def test_every_preset_is_a_valid_cluster() -> None:
    assert {"cloud-mix", "local-hetero", "tapp-paper"} <= set(presets())
    for name in presets():
        assert cluster_spec(name).name


def test_a_measured_search_builds_the_model_with_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan --reward measured`` with a factory: the runs build it with its options and
    input, not its name alone."""
    from pipeplan.service.tasks import search as search_module
    from pipeplan.service.tasks.plan import PlanRequest, plan

    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def capture(model: str | None, input_size: int | None, profile: Any, **kw: Any) -> Any:
        seen.update(model=model, **kw)
        raise Stop

    monkeypatch.setattr(search_module, "model_source", capture)
    request = PlanRequest(
        cluster="local-hetero", model="tests.models.factories:mlp", planner="tapp",
        reward="measured", model_options={"width": 6}, input_shape=[6],
    )  # fmt: skip
    with pytest.raises(Stop):
        plan(request)
    assert seen == {
        "model": "tests.models.factories:mlp",
        "options": {"width": 6},
        "input_shape": [6],
        "input_dtype": None,
        "example": None,
    }
