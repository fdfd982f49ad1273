"""Tries of one site job: a try claims its staging directory, and only the latest try publishes.

An update is published only while no later try of the same site job has started
(:func:`claim_try`, :func:`publish_current_try`): a killed try's runner that lived on never
replaces the update of the try that followed it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import WritablePath, path_from_uri, record_path


class Superseded(FlareAirflowError):
    """A later try of the same site job has started: this try's update is not published."""


def _try_number(path: Any) -> int | None:
    name = str(getattr(path, "name", ""))
    number = name.removeprefix("try-")
    return int(number) if name.startswith("try-") and number.isdigit() else None


@contextlib.contextmanager
def _tries_locked(site_dir: Any) -> Iterator[None]:
    """Serialise claims and publishes of one site job's tries (a local store: ``flock``; object
    stores have no lock, there the later try's claim and clear come first and a race stays)."""
    if not isinstance(site_dir, pathlib.Path):
        yield
        return
    site_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(site_dir / ".tries.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def claim_try(staging: str) -> None:
    """Mark this try as the site job's current one (its staging directory exists from now on):
    a try with a lower number will no longer publish (:func:`publish_current_try`)."""
    try_dir = path_from_uri(staging).parent
    with _tries_locked(try_dir.parent):
        try_dir.mkdir(parents=True, exist_ok=True)


def later_try(try_dir: Any) -> int | None:
    """The highest try number above ``try_dir``'s own among its site job's staging directories."""
    mine = _try_number(try_dir)
    if mine is None or not try_dir.parent.exists():
        return None
    return max((n for p in try_dir.parent.iterdir() if (n := _try_number(p)) is not None and n > mine), default=None)


def publish_current_try(staged: WritablePath, output: WritablePath) -> None:
    """:func:`publish` unless a later try of this site job has claimed its staging directory."""
    with _tries_locked(staged.parent.parent):
        later = later_try(staged.parent)
        if later is not None:
            raise Superseded(
                f"{staged.parent.name} of this site job was superseded by try-{later}: its update is not published"
            )
        publish(staged, output)


def publish(staged: WritablePath, output: WritablePath) -> None:
    """Move a checked update from its staging directory to its published place, record last.

    A rename on a local store; a copy then a delete elsewhere (object stores cannot rename).
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    for src, dst in ((staged, output), (record_path(staged), record_path(output))):
        if hasattr(src, "replace") and getattr(src, "protocol", "file") in ("file", "local", ""):
            src.replace(dst)
        else:
            with src.open("rb") as fi, dst.open("wb") as fo:
                while piece := fi.read(1 << 22):
                    fo.write(piece)
            src.unlink()
