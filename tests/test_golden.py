"""Results do not change when code moves: the cost model, the population evaluator, the MDP
and the seeded planners answer exactly what ``tests/data/golden.json`` holds (floats to
1e-9 relative, plans and counts exactly). See :mod:`tests.golden`."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests import golden


def _diff(path: str, want: Any, got: Any, out: list[str]) -> None:
    if isinstance(want, dict) and isinstance(got, dict):
        if set(want) != set(got):
            out.append(f"{path}: keys {sorted(set(want) ^ set(got))} differ")
        for k in set(want) & set(got):
            _diff(f"{path}.{k}", want[k], got[k], out)
    elif isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            out.append(f"{path}: length {len(got)} != {len(want)}")
        for i, (w, g) in enumerate(zip(want, got, strict=False)):
            _diff(f"{path}[{i}]", w, g, out)
    elif isinstance(want, float) or isinstance(got, float):
        if not (
            isinstance(got, int | float) and math.isclose(want, got, rel_tol=1e-9, abs_tol=1e-300)
        ):
            out.append(f"{path}: {got!r} != {want!r}")
    elif want != got:
        out.append(f"{path}: {got!r} != {want!r}")


@pytest.fixture(scope="module")
def stored() -> dict[str, Any]:
    return json.loads(golden.GOLDEN.read_text())


@pytest.mark.parametrize(
    "part", ["estimates", "episodes", pytest.param("planners", marks=pytest.mark.slow)]
)
def test_results_match_the_golden_snapshot(stored: dict[str, Any], part: str) -> None:
    got = json.loads(json.dumps(getattr(golden, part)()))
    problems: list[str] = []
    _diff(part, stored[part], got, problems)
    assert not problems, "\n".join(problems[:20])


def test_the_diff_catches_a_changed_value() -> None:
    out: list[str] = []
    _diff("x", {"a": [1.0, {"b": "p"}]}, {"a": [1.0 + 1e-6, {"b": "q"}]}, out)
    assert len(out) == 2
