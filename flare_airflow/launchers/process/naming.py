"""A process site job's identity: the mark its processes carry, wherever they move."""

from __future__ import annotations

import secrets

from flare_airflow.core.envvars import FLARE_PROCESS_TREE

# Inherited by everything the trainer starts: finds its processes after they left its session.
TREE_MARK_ENV = FLARE_PROCESS_TREE


def new_tree_mark() -> str:
    """A fresh, unguessable job mark (the value of ``FLARE_PROCESS_TREE`` for one launch)."""
    return secrets.token_hex(16)


def tree_mark_entry(mark: str) -> bytes:
    """The mark as it appears in a process's ``/proc/<pid>/environ``."""
    return f"{TREE_MARK_ENV}={mark}".encode()
