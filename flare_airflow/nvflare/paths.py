"""Paths of an NVFlare job folder, which is untrusted input (downloaded, shared by a collaborator).

Every file the importer reads or copies lies inside the job folder once its symlinks are resolved:
an app name, a script path, a config file or a link in ``custom/`` that leads outside the folder
(or loops) is refused by name, never followed. Copying ``custom/`` keeps links that stay inside it
as relative links and copies regular files only.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from flare_airflow.nvflare.errors import NvflareJobError


def resolved(path: Path, what: str) -> Path:
    """``path`` with every symlink resolved; a loop is refused (ELOOP), not followed forever."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # Python 3.11 raises RuntimeError on a loop, 3.13 OSError (ELOOP)
        raise NvflareJobError(f"{path}: {what} is a symlink loop ({exc}); remove the link") from None


def inside(root: Path, path: Path, what: str) -> Path:
    """``path`` resolved, refused unless it lies within ``root`` (already resolved)."""
    real = resolved(path, what)
    if real != root and not real.is_relative_to(root):
        raise NvflareJobError(
            f"{path}: {what} leads outside the job folder {root} (to {real}); an imported job reads only its own "
            "folder: copy the file into the job folder instead of linking to it"
        )
    return real


def plain_name(name: str) -> bool:
    """One path component: not empty, not ``.`` or ``..``, no separator, no NUL."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def relative_inside(path: str) -> bool:
    """A relative path that never climbs (``custom/train.py``, not ``../../x`` or ``/etc/x``)."""
    pure = PurePosixPath(path)
    return bool(path) and "\0" not in path and not pure.is_absolute() and ".." not in pure.parts


def copy_custom(source: Path, target: Path, root: Path) -> None:
    """Copy the client app's ``custom/`` folder; refuse links leading out of it, loops and special files.

    ``os.walk`` does not follow directory links, so a link to ``/`` or to an ancestor is seen as a
    link (and checked), never walked.
    """
    top = inside(root, source, "the client app's custom/ folder")
    target.mkdir()
    for folder, dirs, files in os.walk(top, followlinks=False):
        here = Path(folder)
        to = target / here.relative_to(top)
        for name in sorted(dirs + files):
            entry = here / name
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                real = resolved(entry, "a link in custom/")
                if real != top and not real.is_relative_to(top):
                    raise NvflareJobError(
                        f"{entry}: a link in custom/ leads outside it (to {real}); an imported job carries only its "
                        "own files: copy the file into custom/ instead of linking to it"
                    )
                if real.is_dir() and here.is_relative_to(real):
                    raise NvflareJobError(
                        f"{entry}: a link in custom/ to its own folder or a parent of it (a loop for whoever copies "
                        "the folder); remove the link"
                    )
                (to / name).symlink_to(os.path.relpath(real, here))
            elif stat.S_ISDIR(mode):
                (to / name).mkdir()
            elif stat.S_ISREG(mode):
                shutil.copyfile(entry, to / name, follow_symlinks=False)
            else:
                raise NvflareJobError(f"{entry}: not a regular file or folder (a device, socket or pipe); remove it")
        dirs[:] = [d for d in dirs if not (here / d).is_symlink()]
