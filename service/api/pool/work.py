"""What the planner pool's workers run besides jobs: imported in the workers only.

The pool names these functions (:data:`~service.api.pool.planner_pool.PLAN_TARGET`), so the
API process never imports them, nor the torch and planners they import.
"""

from __future__ import annotations

from typing import Any

from pipeplan.service.tasks.common import zoo_profile
from pipeplan.service.tasks.plan import PlanRequest, plan
from pipeplan.service.tasks.progress import QUIET


def plan_document(spec: dict[str, Any]) -> dict[str, Any]:
    """The result document a ``plan`` job of ``spec`` ends with (``pipeplan plan --json``):
    the same use-case, with nothing to report to."""
    doc: dict[str, Any] = plan(PlanRequest.model_validate(spec)).to_dict()
    return doc


def zoo_profile_document(model: str, input_size: int | None) -> dict[str, Any]:
    """A zoo model's analytic profile (``profile.json``), as a plan job of ``model`` takes it
    (:func:`service.tasks.common.zoo_profile`): the dashboard's plan panel costs the job's
    plan with it."""
    doc: dict[str, Any] = zoo_profile(model, input_size, QUIET).to_dict()
    return doc
