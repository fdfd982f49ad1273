"""Resumable writes of a large update through a site's own store connection (s3fs).

A site task on an object store stages its job on local files and then uploads the update
(``operators/staging.py``). Through the round's links the upload id is the central side's and a
retry resumes it (:mod:`flare_airflow.core.store_links`); through the site's own connection the
site opens the multipart upload itself and keeps its id **at the site** -- a small state file in a
directory of the site's worker (``FLARE_UPLOAD_STATE_DIR``, default under the temporary directory,
0700), named by the object's URI. A writer cut off midway (killed worker, lost network) leaves the
upload open; the retry finds the id, lists the parts that arrived and sends only the others. A
listed part counts only if its ETag is the MD5 of the part the retry holds now, so a retry that
trained again and wrote other bytes sends what changed. Memory: one part at a time.

``file://`` stores need nothing of this: the update is written by the trainer into its staging
directory (a temporary sibling renamed into place) and published by a rename, so there is no copy
to resume -- a retried site job retrains, which writes the bytes anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from flare_airflow.core import envvars
from flare_airflow.core.errors import StoreError
from flare_airflow.core.store import open_regular
from flare_airflow.core.store_links import PART_SIZE, SINGLE_PUT_LIMIT, bucket_key, part_size_for, send_parts

STATE_DIR_ENV = envvars.FLARE_UPLOAD_STATE_DIR


def default_state_dir() -> Path:
    """Where this worker keeps the ids of its open uploads (``FLARE_UPLOAD_STATE_DIR``)."""
    chosen = os.environ.get(STATE_DIR_ENV)
    return Path(chosen) if chosen else Path(tempfile.gettempdir()) / f"flare-airflow-uploads-{os.getuid()}"


def is_s3(fs: Any) -> bool:
    protocol = getattr(fs, "protocol", ())
    return bool({"s3", "s3a"} & set((protocol,) if isinstance(protocol, str) else protocol))


def own_directory(path: Path) -> Path:
    """``path`` made if missing (0700), and refused unless it is a directory of this user's that no one
    else can write: the default lies in the shared temporary directory under a predictable name,
    where another local user could have made it first -- and plant links for this worker to write
    through, or notes naming uploads of theirs. Raises :class:`StoreError` saying what to set."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise StoreError(
            f"the site's upload state directory {path} is not a directory of this user (uid {os.getuid()}) that "
            f"only it can write (found uid {info.st_uid}, mode {stat.filemode(info.st_mode)}); remove it, or set "
            f"{STATE_DIR_ENV} on this worker to a directory of its own"
        )
    return path


class _UploadState:
    """The site's note of one open multipart upload: which object, which id, which part size."""

    def __init__(self, state_dir: Path, uri: str) -> None:
        self.path = own_directory(state_dir) / f"{hashlib.sha256(uri.encode()).hexdigest()[:32]}.json"
        self.uri = uri

    def read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("uri") == self.uri else None

    def write(self, upload_id: str, part_size: int) -> None:
        # A fresh temporary file (O_EXCL: never a name someone could have planted), then renamed.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".note-", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps({"uri": self.uri, "upload_id": upload_id, "part_size": part_size}))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def _arrived(fs: Any, bucket: str, key: str, upload_id: str) -> dict[int, tuple[str, int]] | None:
    """Part number -> (ETag, size) of what the store holds of the upload; None when it is gone."""
    arrived: dict[int, tuple[str, int]] = {}
    marker = 0
    while True:
        try:
            page = fs.call_s3(
                "list_parts", Bucket=bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker, MaxParts=1000
            )
        except OSError:
            return None  # completed, aborted or expired: start again
        for part in page.get("Parts", []):
            arrived[int(part["PartNumber"])] = (str(part["ETag"]), int(part["Size"]))
        if not page.get("IsTruncated"):
            return arrived
        marker = int(page["NextPartNumberMarker"])


def _upload_part(fs: Any, bucket: str, key: str, upload_id: str, number: int, piece: bytes) -> str:
    return str(
        fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=piece)["ETag"]
    )


def resumable_upload(
    local: Path,
    dst: Any,
    *,
    state_dir: Path | None = None,
    part_size: int = PART_SIZE,
    single_put_limit: int = SINGLE_PUT_LIMIT,
) -> int | None:
    """Upload ``local`` to ``dst`` (an ``ObjectStoragePath`` on S3) resumably; returns the bytes
    sent, or None when ``dst`` is not on S3 or ``local`` fits one PUT (the caller copies it).

    Raises :class:`StoreError` naming the object when the store refuses or cannot be reached."""
    fs = getattr(dst, "fs", None)
    size = local.stat().st_size
    if fs is None or not is_s3(fs) or size <= single_put_limit:
        return None
    bucket, key = bucket_key(dst)
    uri = f"s3://{bucket}/{key}"
    state = _UploadState(state_dir or default_state_dir(), uri)
    try:
        return _upload(fs, bucket, key, local, size, state, part_size_for(size, part_size))
    except StoreError:
        raise
    except (OSError, KeyError, ValueError) as exc:
        raise StoreError(
            f"the update could not be written to {uri}: {type(exc).__name__}: {exc}; the upload stays open and a "
            "retry of this site task sends only the parts that did not arrive"
        ) from exc


def _upload(fs: Any, bucket: str, key: str, local: Path, size: int, state: _UploadState, part_size: int) -> int:
    noted = state.read()
    arrived = None
    if noted is not None and int(noted["part_size"]) == part_size:
        arrived = _arrived(fs, bucket, key, str(noted["upload_id"]))
    if noted is None or arrived is None:
        if noted is not None:  # another part size: its parts cannot be reused, and an open upload is billed
            with contextlib.suppress(Exception):
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=str(noted["upload_id"]))
        upload_id = str(fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"])
        state.write(upload_id, part_size)  # before the first part: a writer cut off after it resumes
        arrived = {}
    else:
        upload_id = str(noted["upload_id"])
    with open_regular(local) as fh:
        etags, sent = send_parts(
            fh, -(-size // part_size), part_size, arrived,
            lambda number, piece: _upload_part(fs, bucket, key, upload_id, number, piece),
        )  # fmt: skip
    parts = [{"PartNumber": number, "ETag": etag} for number, etag in etags]
    fs.call_s3(
        "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    state.clear()
    with contextlib.suppress(Exception):  # s3fs caches listings: the new object must be seen by what follows
        fs.invalidate_cache(f"{bucket}/{key}")
    return sent


__all__ = ["STATE_DIR_ENV", "default_state_dir", "resumable_upload"]
