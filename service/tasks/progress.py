"""How a use-case reports while it works: :class:`Reporter`, handed to every use-case.

A use-case never prints. It announces a long step (profiling, starting a cluster, running a
plan), a note for people (what was measured, what is EMULATED), a search's progress
(evaluations and the best value so far) and every population the search valued (its plans
and their values, simulated or measured); the face decides what to do with them: the CLI
draws spinners and progress bars on stderr, a job posts events to the control endpoint.
The base class ignores everything, so a caller overrides only what it shows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeplan.agents.rewards import Population
from pipeplan.agents.search import Progress

if TYPE_CHECKING:  # the executor imports torch; a reporter does not need it
    from pipeplan.executor.elastic import Replanned
    from pipeplan.executor.train import TrainStep


def _ignore(evaluations: int, best: float) -> None:
    """A search progress callback that drops the report."""


class Reporter:
    """Receives a use-case's reports; every method does nothing here."""

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        """A long step runs inside the ``with`` body (``text`` says what it is)."""
        yield

    def note(self, text: str) -> None:
        """One line for people: what was done, what a number means."""

    @contextmanager
    def search(self, label: str, total: int | None) -> Iterator[Progress]:
        """A search runs inside the ``with`` body and calls the yielded callback with
        (evaluations so far, best objective value so far); ``total`` is its budget."""
        yield _ignore

    def evaluated(
        self,
        plans: Population,
        values: np.ndarray,
        details: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """A search valued ``plans`` (a ``PlanBatch`` or a list of plans; turn a batch into
        plans with :func:`agents.rewards.plans_of`): ``values`` by the problem's objective,
        lower is better, ``inf`` for an infeasible plan. ``details``, one per plan where
        the search has them: what else it knows of each (a measured plan's
        ``batch_time_s`` and the cost model's ``predicted_batch_time_s``)."""

    def trained(self, step: TrainStep) -> None:
        """A training run finished one step: its loss and time."""

    def checkpointed(self, step: int, path: Path) -> None:
        """A training run wrote a checkpoint after ``step`` steps into ``path``."""

    def replanned(self, event: Replanned) -> None:
        """Elastic training planned again: after a lost node or actor (it goes on with
        the new plan), or a joined node (switched or not, and why)."""


QUIET = Reporter()
"""The reporter of a caller that shows nothing."""
