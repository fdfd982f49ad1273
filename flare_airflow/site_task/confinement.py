"""How the site runner confines its trainer: the site policy's ``confinement`` against this host.

``auto`` (the default, also without a site policy) confines with bubblewrap where this worker can
and says so in the log; where it cannot (no ``bwrap``, no user namespaces) the trainer runs
unconfined and the log says why, on every site job. ``required`` refuses to run unconfined: the
site job fails with the reason, before the trainer starts. ``off`` runs it as the worker's user.
See ``docs/confinement.md``.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any, cast

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import path_from_uri, record_path
from flare_airflow.launchers.process.sandbox import Confinement, ConfinementUnavailable, Sandbox, find_bwrap
from flare_airflow.site_task.spec import SiteRun


class ConfinementRefused(FlareAirflowError):
    """The trainer cannot be confined as the site policy asks: it is not started."""


def _local(uri: str) -> pathlib.Path | None:
    path = path_from_uri(uri)
    return path if isinstance(path, pathlib.Path) else None


def site_sandbox(run: SiteRun, say: Callable[[str], None] = print) -> Sandbox | None:
    """The sandbox of ``run``'s trainer, or ``None`` to run it unconfined (``off``, or ``auto`` on a
    host that cannot confine). Makes the trainer's output directory (bwrap binds existing paths).

    Raises :class:`ConfinementRefused` for ``required`` on a host that cannot confine.
    """
    confinement = Confinement.from_dict(run.confinement)
    where = f"site {run.site} round {run.round}"
    if not confinement.wanted:
        return None
    try:
        bwrap = find_bwrap(os.environ.get("PATH", os.defpath))
    except ConfinementUnavailable as exc:
        if confinement.mode == "required":
            raise ConfinementRefused(
                f"{where}: the site policy requires confined trainers (confinement.mode: required) but this worker "
                f"cannot confine them: {exc}; install bubblewrap on the worker, or set sites.{run.site}.confinement"
                ".mode to auto or off in the site policy"
            ) from None
        say(
            f"WARNING: {where}: the trainer is NOT confined: {exc}; it can write wherever uid {os.getuid()} can. "
            f"Install bubblewrap on this worker, or set sites.{run.site}.confinement.mode: off in the site policy "
            "to run unconfined on purpose (required: refuse instead)",
        )
        return None
    out = _local(run.staging or run.output)
    writable: list[str] = []
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        writable.append(os.path.realpath(out.parent))
    model = _local(run.global_model)
    read_only = [os.path.realpath(str(p)) for p in (model, record_path(cast(Any, model)))] if model is not None else []
    for path in confinement.writable:
        if not os.path.isdir(path):
            raise ConfinementRefused(
                f"{where}: confinement.writable names {path!r}, which is not a directory on this worker; "
                f"create it or fix sites.{run.site}.confinement.writable in the site policy"
            )
    say(
        f"{where}: trainer confined (bubblewrap): read-only file system but {', '.join(writable) or 'nothing'}"
        f"{''.join(', ' + p for p in confinement.writable)} and a private /tmp; "
        f"network {'allowed' if confinement.network else 'none (loopback only)'}; "
        "as nobody in its own user namespace, without capabilities or ptrace",
    )
    return Sandbox(bwrap=bwrap, confinement=confinement, writable=tuple(writable), read_only=tuple(read_only))


_READ_ONLY = "Read-only file system"
_NO_NETWORK = ("Network is unreachable", "Temporary failure in name resolution", "Name or service not known")


def confinement_hint(sandbox: Sandbox, failure: str) -> str:
    """What a confined trainer's failure means, when it hit its confinement (else ``""``)."""
    if _READ_ONLY in failure:
        tail = failure.split(_READ_ONLY, 1)[1]
        if any(path in tail for path in sandbox.read_only):
            return "; the trainer is confined and its input global model is read-only (the other sites read it too)"
        where = ", ".join([*sandbox.writable, *sandbox.confinement.writable])
        return (
            f"; the trainer is confined: it may write only {where or 'nothing'} (FLARE_OUTPUT's directory) and its "
            "private /tmp -- the site admin may add directories in the site policy's confinement.writable"
        )
    if not sandbox.confinement.network and any(text in failure for text in _NO_NETWORK):
        return "; the trainer is confined without network (the site policy's confinement.network: false)"
    return ""
