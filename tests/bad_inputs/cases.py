"""One row of the bad-input battery (see ``tests/bad_inputs/__init__.py``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

CATEGORIES = {
    "job_file": "Job file",
    "trigger_conf": "Trigger conf",
    "trainer": "Trainer behaviour",
    "update_file": "Update file",
    "site_env": "Site environment",
    "kubernetes": "Kubernetes spec",
    "slurm": "SLURM spec",
    "container": "Container spec",
    "cli": "CLI",
    "privacy": "Privacy (docs/privacy.md)",
    "tracking": "Experiment tracking (docs/tracking.md)",
}

_ID = re.compile(r"^[a-z0-9][a-z0-9-]*[a-z0-9]$")


@dataclass(frozen=True)
class Case:
    """A bad input and what the user is told.

    :param id: unique across the battery, kebab-case (the pytest id and the table's key).
    :param category: a key of :data:`CATEGORIES`.
    :param bad_input: what the user (or trainer, or site) did, in words.
    :param error: text the user sees; the case's test asserts the message contains it.
    """

    id: str
    category: str
    bad_input: str
    error: str

    def __post_init__(self) -> None:
        if not _ID.match(self.id):
            raise ValueError(f"case id {self.id!r} is not kebab-case")
        if self.category not in CATEGORIES:
            raise ValueError(f"case {self.id}: unknown category {self.category!r}")


def assert_clear(case: Case, message: str) -> None:
    """The message names the problem (contains ``case.error``) and is not a bare traceback."""
    assert case.error in message, f"{case.id}: expected {case.error!r} in:\n{message[-3000:]}"
    assert "Traceback (most recent call last)" not in message, f"{case.id}: traceback shown:\n{message[-3000:]}"
