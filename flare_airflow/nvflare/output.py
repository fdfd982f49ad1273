"""Writing an import into ``--out``: all of it or nothing, never over a hand-written file unasked.

Everything is staged in a temporary folder inside ``--out`` (same file system, so each move is a
rename), checked there, then moved into place; an error on the way puts back what was there.
An existing ``<job>_dag.py`` or ``<job>.site-policy.yaml`` may be hand-written or reviewed: it is
replaced only with ``--force``, and never through a symlink.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from flare_airflow.nvflare.errors import NvflareJobError


def check_targets(out_dir: Path, names: Sequence[str], *, force: bool) -> None:
    """Refuse to replace what is there without ``force``, and anything reached through a symlink."""
    there = [name for name in names if os.path.lexists(out_dir / name)]
    if there and not force:
        raise NvflareJobError(
            f"{out_dir}: {', '.join(there)} already there (a DAG file or site policy may have been edited by hand "
            "since); nothing was written: pass --force to replace them, or choose another --out"
        )
    links = [name for name in there if (out_dir / name).is_symlink()]
    if links:
        raise NvflareJobError(
            f"{out_dir}: {', '.join(links)} is a symlink; --force replaces files in --out, never through a link: "
            "remove the link, or choose another --out; nothing was written"
        )


@contextmanager
def staging_folder(out_dir: Path, job_name: str) -> Iterator[Path]:
    """A fresh folder inside ``out_dir`` for the import's files; removed afterwards, whatever happens
    (and ``out_dir`` too when this import created it and failed)."""
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{job_name}.importing-", dir=out_dir))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def move_into_place(staging: Path, out_dir: Path, names: Sequence[str]) -> None:
    """Move ``staging/<name>`` to ``out_dir/<name>`` for every name, all or none.

    What a name replaces is first moved aside into ``staging`` (so a folder can replace a folder);
    when a move fails, the names moved so far go back and what they replaced is restored.
    """
    aside = staging / ".replaced"
    aside.mkdir()
    replaced: list[str] = []
    placed: list[str] = []
    try:
        for name in names:
            target = out_dir / name
            if os.path.lexists(target):
                os.rename(target, aside / name)
                replaced.append(name)
            os.rename(staging / name, target)
            placed.append(name)
    except OSError as exc:
        for name in reversed(placed):
            os.rename(out_dir / name, staging / name)
        for name in reversed(replaced):
            os.rename(aside / name, out_dir / name)
        raise NvflareJobError(
            f"{out_dir}: cannot move the imported files into place ({exc.strerror or exc}); nothing was changed"
        ) from None
