"""The model store: where global models, site updates and run outputs live.

Layout under the store root (one root per deployment)::

    <job>/<run>/round-0001/global.safetensors (+ .json)     global model after round 1
    <job>/<run>/round-0001/sites/<site>.safetensors          that site's accepted update for round 1
    <job>/<run>/round-0001/sites/<site>.failure.json         or why that site delivered none
    <job>/<run>/round-0001/staging/<site>/try-<n>/           where try n of its trainer wrote
    <job>/<run>/round-0000/global.safetensors                the initial (or warm-start) model
    <job>/<run>/final/...                                    published outputs of a successful run
    <job>/latest.json                                        pointer to the last successful run

The root is any path object with pathlib semantics: ``pathlib.Path`` here and in site images,
Airflow's ``ObjectStoragePath`` in the Airflow layer (file://, s3://, gs://, ...).
"""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import re
import stat
from typing import Any, Protocol
from urllib.parse import urlparse

from flare_airflow.core.errors import StoreError

_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_HASHED = re.compile(r"-[0-9a-f]{8}\Z")


class WritablePath(Protocol):
    """What the store needs of a path: ``pathlib.Path``, ``UPath`` or Airflow's ``ObjectStoragePath``."""

    def __truediv__(self, other: str) -> WritablePath: ...

    def open(self, mode: str = ...) -> Any: ...

    def exists(self) -> bool: ...

    def unlink(self, missing_ok: bool = ...) -> None: ...

    def mkdir(self, parents: bool = ..., exist_ok: bool = ...) -> None: ...

    @property
    def parent(self) -> Any: ...

    @property
    def name(self) -> str: ...


def local_file(path: Any) -> str | None:
    """The local filesystem path of a store path (``pathlib.Path``, or a file:// ``ObjectStoragePath``
    / ``UPath``), or ``None`` when the path lives elsewhere (s3://, gs://, memory://, ...)."""
    if isinstance(path, pathlib.PurePath):
        return str(path)
    protocol = getattr(path, "protocol", None)
    if isinstance(protocol, tuple | list):
        protocol = protocol[0] if protocol else None
    local = getattr(path, "path", None)
    return local if protocol in ("file", "local") and isinstance(local, str) and local.startswith("/") else None


def open_for_reading(path: WritablePath) -> Any:
    """An unbuffered binary file object for reading ``path``: a plain ``open()`` when it is a local file
    (fsspec's ``ObjectStoragePath.open`` costs ~0.8 ms per call, ``open()`` a few microseconds), its
    own ``open("rb")`` otherwise."""
    local = local_file(path)
    return open(local, "rb", buffering=0) if local is not None else path.open("rb")


def open_regular(path: pathlib.Path) -> Any:
    """``path`` opened for reading (binary), refused unless it is a regular file reached without a
    final symbolic link: a site job that shares a writable folder with its worker (a pod's staging
    folder) could leave a link there to any file the worker can read -- its private keys -- for the
    worker to send to the store as the job's result. A FIFO would block the reader: it is refused
    too (opened non-blocking, then checked). Raises ``OSError`` saying which."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP, f"is a symbolic link (to {os.readlink(path)!r}), not a file", str(path)
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "is not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# A record lists names, shapes and a few metrics: far below this. Records are input (a site, or a
# trainer bypassing the Client API, writes them): nothing reads more of one.
MAX_RECORD_BYTES = 16 << 20


def read_at_most(fh: Any, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the open file ``fh``, read in pieces: ``read(n)`` would allocate
    ``n`` bytes up front, and a caller refuses what is longer than ``limit``."""
    pieces, size = [], 0
    while size <= limit and (piece := fh.read(min(1 << 16, limit + 1 - size))):
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


def record_path(tensors_path: WritablePath) -> WritablePath:
    """Where an artifact's JSON record (checksum, tensors, metadata) sits: next to its tensors."""
    return tensors_path.parent / (tensors_path.name.removesuffix(".safetensors") + ".json")


def failure_path(tensors_path: WritablePath) -> WritablePath:
    """Where a site job that did not deliver ``tensors_path`` leaves its failure record (why, return
    code): next to the update it would have published, read by the aggregation."""
    return tensors_path.parent / (tensors_path.name.removesuffix(".safetensors") + ".failure.json")


def safe_component(value: str, what: str) -> str:
    """Return ``value`` if it is usable as one path component, else raise ``StoreError``."""
    if not _COMPONENT.match(value) or value in {".", ".."} or ".." in value:
        raise StoreError(
            f"{what} {value!r} cannot be a store path component: use letters, digits, '.', '_' and '-' "
            "(no '/', no '..', at most 128 characters)"
        )
    return value


def run_component(run_id: str) -> str:
    """Airflow run ids contain ':' and '+'; map one to a readable, unique path component."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip("._-")[:80] or "run"
    # Kept verbatim only if it cannot be mistaken for a hashed component ("<name>-<8 hex>"):
    # otherwise the run id "a_b-6783a31e" would share a directory with the run id "a:b".
    if cleaned == run_id and not _HASHED.search(run_id):
        return cleaned
    return f"{cleaned}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"


def path_from_uri(uri: str) -> Any:
    """A path object for a store URI without Airflow (site images): file paths, else universal-pathlib."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return pathlib.Path(parsed.path if parsed.scheme else uri)
    try:
        from upath import UPath
    except ImportError as exc:  # pragma: no cover - depends on the site image
        raise StoreError(
            f"store URI {uri!r} needs universal-pathlib (and the fsspec backend for {parsed.scheme!r}) "
            "installed in this environment"
        ) from exc
    return UPath(uri)


def _normalised(path: Any) -> str:
    if isinstance(path, pathlib.Path):
        return os.path.realpath(path)
    text = str(path)
    if text.startswith("file://"):
        return os.path.realpath(urlparse(text).path)
    parts = text.split("/")
    if ".." in parts:
        raise StoreError(f"path {text!r} contains '..'")
    return text.rstrip("/")


class ModelStore:
    """Computes artifact locations and refuses any path outside its root."""

    def __init__(self, root: Any) -> None:
        self.root = root

    @classmethod
    def from_uri(cls, uri: str) -> ModelStore:
        return cls(path_from_uri(uri))

    def __repr__(self) -> str:
        return f"ModelStore({self.root})"

    def contains(self, path: Any) -> bool:
        root = _normalised(self.root)
        target = _normalised(path)
        return target == root or target.startswith(root + "/")

    def checked(self, path: Any) -> Any:
        """Return ``path`` if it lies inside the store root; raise ``StoreError`` otherwise."""
        if not self.contains(path):
            raise StoreError(f"path {path} is outside the model store root {self.root}; refusing to read or write it")
        return path

    def resolve_uri(self, uri: str) -> Any:
        """A path for a URI received from elsewhere (XCom, a record), checked to lie in the store."""
        if isinstance(self.root, pathlib.Path):
            path: Any = path_from_uri(uri)
        else:
            path = type(self.root)(uri)
        return self.checked(path)

    def run_dir(self, job: str, run_id: str) -> WritablePath:
        return self.checked(self.root / safe_component(job, "job name") / run_component(run_id))

    def round_dir(self, job: str, run_id: str, round_num: int) -> WritablePath:
        if round_num < 0:
            raise StoreError(f"round must be >= 0, got {round_num}")
        return self.run_dir(job, run_id) / f"round-{round_num:04d}"

    def global_model(self, job: str, run_id: str, round_num: int) -> WritablePath:
        """The global model produced by ``round_num`` (round 0 = the initial model)."""
        return self.round_dir(job, run_id, round_num) / "global.safetensors"

    def server_state(self, job: str, run_id: str, round_num: int) -> WritablePath:
        """The aggregation strategy's server state after ``round_num`` (a server optimizer's moments)."""
        return self.round_dir(job, run_id, round_num) / "server_state.safetensors"

    def site_update(self, job: str, run_id: str, round_num: int, site: str) -> WritablePath:
        return self.round_dir(job, run_id, round_num) / "sites" / f"{safe_component(site, 'site')}.safetensors"

    def staging(self, job: str, run_id: str, round_num: int, site: str, try_number: int) -> WritablePath:
        """Where one try of a site job's trainer writes (``FLARE_OUTPUT``); the site task publishes
        the update at :meth:`site_update` only once it passed every check."""
        site_dir = self.round_dir(job, run_id, round_num) / "staging" / safe_component(site, "site")
        return site_dir / f"try-{int(try_number)}" / "update.safetensors"

    def evaluation(self, job: str, run_id: str, round_num: int) -> WritablePath:
        return self.round_dir(job, run_id, round_num) / "evaluation.safetensors"

    def final_dir(self, job: str, run_id: str) -> WritablePath:
        return self.run_dir(job, run_id) / "final"

    def latest_pointer(self, job: str) -> WritablePath:
        return self.checked(self.root / safe_component(job, "job name") / "latest.json")
