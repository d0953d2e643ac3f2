"""Domain exceptions. Every message names the field and the offending value."""

from __future__ import annotations


class PipeplanError(ValueError):
    """Base class of every error pipeplan raises on bad input."""


class FormatError(PipeplanError):
    """A profile, cluster or plan document is malformed or inconsistent."""


class PlanError(PipeplanError):
    """A plan does not fit its profile or cluster (gap, overlap, unknown device...)."""
