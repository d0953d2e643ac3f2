"""Each kind's result, as its use-case writes it, reads as the model the API's document
states for it (``service.api.schemas.RESULTS``): the fields a client relies on are there,
with their types. ``run`` and ``train`` results are checked where they are made on Ray
(``test_run_cli.py``, ``api/test_train_jobs.py``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeplan.service.api.schemas import (
    RESULTS,
    CompareJobResult,
    JobKind,
    PlanJobResult,
    ProfileJobResult,
)
from pipeplan.service.tasks.common import zoo_profile
from pipeplan.service.tasks.compare import CompareRequest, compare
from pipeplan.service.tasks.plan import PlanRequest, plan
from pipeplan.service.tasks.progress import QUIET

PROBLEM = {"model": "digits_cnn", "cluster": "local-hetero", "batch": 16}


def test_profile_plan_and_compare_results_read_as_their_models() -> None:
    profile = zoo_profile("digits_cnn", None, QUIET).to_dict()
    assert ProfileJobResult.model_validate(profile).model_extra == {}
    planned = plan(PlanRequest.model_validate(PROBLEM | {"planner": "dp"})).to_dict()
    assert PlanJobResult.model_validate(planned).evaluations == planned["evaluations"]
    costed = plan(
        PlanRequest.model_validate(
            PROBLEM | {"planner": "dp", "objective": "cost", "min_throughput": 1.0}
        )
    ).to_dict()
    assert PlanJobResult.model_validate(costed).rental is not None
    rows = compare(CompareRequest.model_validate(PROBLEM | {"planners": ["dp", "greedy"]}))
    doc = CompareJobResult.model_validate(rows.to_dict())
    assert [r["planner"] for r in doc.results] == ["dp", "greedy"]


def test_every_kind_has_a_result_model_that_refuses_another_kinds() -> None:
    assert set(RESULTS) == set(JobKind)
    profile = zoo_profile("digits_cnn", None, QUIET).to_dict()
    with pytest.raises(ValidationError, match="plan"):
        PlanJobResult.model_validate(profile)
    planned = plan(PlanRequest.model_validate(PROBLEM | {"planner": "dp"})).to_dict()
    for kind in (JobKind.PROFILE, JobKind.COMPARE, JobKind.RUN, JobKind.TRAIN):
        with pytest.raises(ValidationError):
            RESULTS[kind].model_validate(planned)
