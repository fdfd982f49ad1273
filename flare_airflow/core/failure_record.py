"""The failure record a site job leaves next to its update: why the site did not count.

The site task writes it (its runner, its lifecycle, the sensor); the aggregation and the sensor read
it back. It lives beside the update in the store (:func:`~flare_airflow.core.store.failure_path`).
"""

from __future__ import annotations

import json
import sys

from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import WritablePath, failure_path


def write_failure(output: WritablePath, rc: JobReturnCode, reason: str) -> None:
    """Leave the reason for the aggregation; best effort: a full or read-only store must not hide
    the reason, which also goes to this task's log and error. Written whole or not at all (a full
    store leaves no empty record), on a local store and an object store alike."""
    from flare_airflow.core.model import atomic_write  # numpy + safetensors: only when a record is written

    path = failure_path(output)
    try:
        atomic_write(path, json.dumps({"return_code": int(rc), "name": rc.name, "reason": reason}).encode())
    except OSError as exc:
        print(f"cannot write the failure record {path} ({exc.strerror or exc}): {reason}", file=sys.stderr, flush=True)


def read_failure(output: WritablePath) -> str | None:
    """The reason the site's failure record next to ``output`` gives, with its return code's name;
    None without a record."""
    path = failure_path(output)
    if not path.exists():
        return None
    try:
        with path.open("r") as fh:
            data = json.loads(fh.read(1 << 16))
        return f"{str(data.get('reason', 'failed'))[:2000]} [{data.get('name', '?')}]"
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        return f"the site's failure record {path} is unreadable ({type(exc).__name__})"
