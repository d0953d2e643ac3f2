"""What several benchmarks share: the models they measure, the held-out calibrations judged
on their runs, and their tables and numbers. Where a run's results go is
:mod:`bench.record`'s.

- **Models** (:data:`MODELS`): the fidelity benchmark's models at small input sizes, with the
  global batch their plans train; ``bench.grad_accumulation``, ``bench.update_bandwidth``
  and ``bench.idle_slowdown`` measure the same ones.
- **Held-out calibrations** (:func:`held_out`): each measured plan predicted by the
  calibrations fitted without it (:data:`HELD_OUT`), as ``bench.fidelity`` and
  ``bench.tapp_table`` judge them; the splits are :mod:`core.held_out`'s and the fits
  :func:`executor.calibrate.fit_folds`'.
- **Tables** (:func:`table`): a rich table whose named columns are left-justified, the
  others right; :func:`fmt` writes a number or ``-``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from pipeplan.core import held_out as split
from pipeplan.core.cluster import ClusterSpec
from pipeplan.core.costmodel import simulate
from pipeplan.core.observations import Observation
from pipeplan.core.plan import Plan
from pipeplan.core.profile import ModelProfile
from pipeplan.executor.calibrate import fit_folds

if TYPE_CHECKING:
    from pipeplan.executor.model import ModelSource

# --- models -----------------------------------------------------------------------------------

GPT_OPTIONS = {"n_layer": 2, "d_model": 256, "n_head": 4, "n_ctx": 32, "vocab_size": 4096}


@dataclass(frozen=True)
class ModelCase:
    """A zoo model at an input size, and the global batch its plans train."""

    label: str
    model: str
    input_size: int
    batch: int
    options: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @cached_property
    def source(self) -> ModelSource:
        """How the executor builds it (torch is imported here, not with this module: the
        benchmarks that only read :data:`MODELS` or print tables stay without it)."""
        from pipeplan.executor.model import ModelSource

        return ModelSource(self.model, self.input_size, options=dict(self.options))


MODELS: dict[str, ModelCase] = {
    "alexnet": ModelCase("alexnet@64", "alexnet", 64, 32),
    "vgg16": ModelCase("vgg16@32", "vgg16", 32, 16),
    "resnet50": ModelCase("resnet50@32", "resnet50", 32, 32),
    # a small GPT: 2 blocks, width 256, 4096 tokens of vocabulary, sequences of 32
    "gpt": ModelCase("gpt-2L@32", "gpt", 32, 16, GPT_OPTIONS),
}


OUT_HELP = "the JSON to write (default: a new file under bench/results/<bench>/)"
"""``--out``'s help: without it a run writes :meth:`bench.record.BenchRun.path`."""


def model_args(doc: str, repeats: int) -> tuple[argparse.Namespace, list[str]]:
    """The command line of a benchmark that times :data:`MODELS` one by one (its module
    docstring ``doc``): ``--models``, ``--repeats`` (>= 1, default ``repeats``) and
    ``--out``; the options and the model keys."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--out", default=None, help=OUT_HELP)
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats: must be >= 1, got {a.repeats}")
    return a, model_keys(ap, a.models)


def model_keys(
    ap: argparse.ArgumentParser, option: str, known: Collection[str] = tuple(MODELS)
) -> list[str]:
    """``--models``: comma-separated keys of ``known`` (:data:`MODELS`'); an unknown one is a
    usage error naming it."""
    keys = option.split(",")
    unknown = [m for m in keys if m not in known]
    if unknown:
        ap.error(f"--models: unknown {unknown} (known: {', '.join(known)})")
    return keys


# --- held-out calibrations --------------------------------------------------------------------

HELD_OUT = ("held-out model", "held-out plan")
"""The calibrations judged on plans they did not see: fitted to every run of the *other*
models' plans (a cluster calibrated on other workloads), and to every run of every *other*
plan, this model's included (a cluster already used for this model, predicting a plan it has
not run: what the service's calibration from ``run`` jobs does)."""
PER_TYPE = " without model scale"
"""Suffix of a held-out calibration fitted without the models' own compute scales (rule 1c's
``model_scale``): the types' terms alone, as before 2026-11-27 evening."""
BLIND = " without 8u"
"""Suffix of a held-out calibration fitted blind to the measured updates (the spec's update
bandwidths kept): beside each :data:`HELD_OUT` one, what rule 8u's fitted bandwidth is worth."""


@dataclass(frozen=True)
class Observed:
    """One measured plan, as the held-out fits read it."""

    model: str
    plan: Plan
    profile: ModelProfile
    runs: tuple[Observation, ...]


def held_out(
    rows: Sequence[Observed], spec: ClusterSpec, per_model: bool = True
) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Each row's predicted batch time under each :data:`HELD_OUT` calibration, and the
    leave-one-model-out fits' terms by model (``per_model``: :func:`executor.calibrate.fit`'s;
    a held-out model has no runs in its fit, so no factor of its own either way)."""
    by_model = split.leave_group_out([r.model for r in rows])
    by_plan = split.leave_one_out(len(rows))
    folds = [*by_model.values(), *by_plan]
    kinds = [HELD_OUT[0]] * len(by_model) + [HELD_OUT[1]] * len(by_plan)
    records: list[dict[str, Any]] = [{"held_out_model": m} for m in by_model]
    records += [{"held_out_plan": j} for j in range(len(rows))]
    fitted = fit_folds(spec, [r.runs for r in rows], folds, per_model, records)
    predicted: list[dict[str, float]] = [{} for _ in rows]
    for fold, kind, cal in zip(folds, kinds, fitted, strict=True):
        if cal is None:  # nothing left to fit: a lone model
            continue
        calibrated = spec.calibrated(cal)
        for i in fold.test:
            predicted[i][kind] = simulate(rows[i].plan, rows[i].profile, calibrated).batch_time_s
    per_model_fits = zip(by_model, fitted[: len(by_model)], strict=True)
    fits = {m: cal.to_dict() for m, cal in per_model_fits if cal is not None}
    return predicted, fits


def without_updates(rows: Sequence[Observed]) -> list[Observed]:
    """``rows`` with their runs' measured updates dropped: a calibration fitted to them keeps
    the spec's update bandwidths (rule 8u unfitted), the ablation of that term."""
    return [
        dataclasses.replace(r, runs=tuple(dataclasses.replace(o, update_s=()) for o in r.runs))
        for r in rows
    ]


def verdict(errors: Sequence[float]) -> dict[str, Any]:
    """The median and the worst ``|error|`` of the plans measured, and how many."""
    return {"median": split.median_abs(errors), "max": split.max_abs(errors), "plans": len(errors)}


# --- tables and numbers -----------------------------------------------------------------------


def table(title: str, columns: Sequence[str], left: Collection[str] = ()) -> Table:
    """A table titled ``title`` (left), the columns named ``left`` left-justified and the
    others right; names are shown as written (no rich markup)."""
    t = Table(title=escape(title), title_justify="left")
    for col in columns:
        t.add_column(escape(col), justify="left" if col in left else "right")
    return t


def fmt(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    """``x`` formatted, ``-`` for None, NaN and infinity."""
    return "-" if x is None or not math.isfinite(x) else format(x, spec) + suffix


def ms(seconds: float | None) -> str:
    """``seconds`` in whole milliseconds, ``-`` for None, NaN and infinity."""
    return fmt(None if seconds is None else seconds * 1e3, ".0f")


def finite(x: float) -> float | None:
    """``x``, or None for NaN (JSON has no NaN)."""
    return None if math.isnan(x) else x
