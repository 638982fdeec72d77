"""The planner's error type: every bad input ends in one line that names the value and a way out."""
from __future__ import annotations


class PlannerError(ValueError):
    """Bad planner input (model, cluster, batch, profile); the message is one line for the user."""


class ProfileError(PlannerError):
    """A profile cannot be built, read or imported (e.g. a branchy PipeDream graph)."""


class DoesNotFitError(PlannerError):
    """No configuration fits in device memory (the cluster planner reads it as: cannot run there);
    ``smallest``, where the search knows it, is the configuration that came closest (a Candidate)."""

    def __init__(self, message: str, smallest=None):
        super().__init__(message)
        self.smallest = smallest
