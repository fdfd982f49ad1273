"""Object-store models for trainers that read and write local files.

A site job's trainer, and the site runner that checks its result, work on local files: a trainer
image needs neither Airflow nor an object-store client, and the store's credentials stay with the
site task (an Airflow connection on the site's worker). On a local store nothing is staged. On
an object store (``s3://`` ...) the site task downloads the round's input global model and its
record into a private temporary directory, runs the job there, then uploads what the runner left
-- the accepted update, then its record (an artifact without a record is never read), or the
failure record -- to the site's place in the store, and removes the directory.

With store links (docs/model-store.md, "No store credential at the sites") the same happens
through the round's presigned links the central side sealed to this site: the site task needs no
store connection at all, and can reach nothing but the global model and its own slot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from flare_airflow.core.errors import StoreError
from flare_airflow.core.store import ModelStore, failure_path, record_path
from flare_airflow.core.store_links import SiteLinks, Upload, download, open_to_send, send
from flare_airflow.core.store_resume import resumable_upload
from flare_airflow.site_task.checks import clear_outputs
from flare_airflow.site_task.spec import SiteRun

CHUNK = 8 << 20


def is_local(store: ModelStore) -> bool:
    return isinstance(store.root, pathlib.Path) or getattr(store.root, "protocol", "file") in ("file", "local", "")


def check_connection(store: ModelStore, conn_id: str | None) -> None:
    """An object store's connection must exist where the task runs: without it the provider falls
    back to whatever credentials and endpoint the machine has (the environment, an instance role,
    the public AWS endpoint). Raises :class:`StoreError` naming the connection and what to do."""
    if is_local(store):
        return
    if conn_id is None:
        raise StoreError(
            f"the model store {store.root} is an object store but the job names no connection for it: set "
            "store_conn_id in the job (or in this site's policy) and define that connection on this worker"
        )
    from airflow.sdk import Connection

    try:
        Connection.get(conn_id)
    except Exception as exc:  # the Task SDK raises several types for "not found"
        raise StoreError(
            f"the model store {store.root}: connection {conn_id!r} is not defined on this worker "
            f"({type(exc).__name__}); define it (AIRFLOW_CONN_{conn_id.upper()}, a secrets backend or the CLI) "
            "with this side's own credentials and the store's endpoint"
        ) from None


def unusable_store(store: ModelStore, exc: Exception, *, through_links: bool, conn_id: str | None) -> str:
    """Why staging -- reading the global model or uploading the update -- could not use the object
    store from this worker (a wrong or missing credential, a bucket that is not there, the endpoint
    unreachable) and what to do, as the site's failure reason (INFRASTRUCTURE_ERROR)."""
    detail = " ".join(str(exc).split())[:400] or type(exc).__name__
    via = "its store links" if through_links else f"connection {conn_id or 'default'!r}"
    fix = (
        "check the store's endpoint is reachable from this worker; refused links: clear the task that "
        "published this round's global model to mint new ones"
        if through_links
        else "check the connection's credentials and endpoint on the site's worker"
    )
    return (
        f"the model store {store.root} could not be used from this worker ({via}): "
        f"{type(exc).__name__}: {detail}; {fix} [INFRASTRUCTURE_ERROR]"
    )


def _copy(src: Any, dst: Any) -> int:
    """Stream ``src`` to ``dst`` (either side a local or store path); returns the bytes copied."""
    copied = 0
    with src.open("rb") as fi, dst.open("wb") as fo:
        while chunk := fi.read(CHUNK):
            fo.write(chunk)
            copied += len(chunk)
    return copied


def _download(store: ModelStore, uri: str, local: Any) -> None:
    """The artifact at ``uri`` and its record, as local files; a missing one is left missing (the
    runner's input check says what is wrong, as on a local store)."""
    remote = store.resolve_uri(uri)
    local.parent.mkdir(parents=True, exist_ok=True)
    for src, dst in ((record_path(remote), record_path(local)), (remote, local)):
        try:
            _copy(src, dst)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreError(f"cannot read {src} from the model store: {exc}") from exc


def upload_result(local_output: Any, remote_output: Any) -> None:
    """What the runner left at ``local_output`` to the store: tensors, then record, or the failure record."""
    if record_path(local_output).exists() and local_output.exists():
        remote_output.parent.mkdir(parents=True, exist_ok=True)
        # A large update on S3 goes up resumably, the upload's id kept at the site (core/store_resume.py).
        if resumable_upload(pathlib.Path(local_output), remote_output) is None:
            _copy(local_output, remote_output)
        _copy(record_path(local_output), record_path(remote_output))  # last: the artifact is complete
    if failure_path(local_output).exists():
        _copy(failure_path(local_output), failure_path(remote_output))


def _beside(where: Any, local: pathlib.Path) -> pathlib.Path:
    """``record_path`` / ``failure_path`` of a local file, as a local path."""
    return pathlib.Path(str(where(local)))


def upload_through_links(local_output: pathlib.Path, links: SiteLinks) -> None:
    """What the runner left at ``local_output``, through the site's write links (as :func:`upload_result`)."""
    what = f"site {links.site!r} round {links.round}"
    record, failure = _beside(record_path, local_output), _beside(failure_path, local_output)
    sends: list[tuple[Upload, pathlib.Path, str]] = []
    if record.exists() and local_output.exists():
        sends += [
            (links.update, local_output, f"{what}: the update"),
            (Upload(url=links.update_record), record, f"{what}: the update's record"),
        ]  # last: the update is complete
    if failure.exists():
        sends.append((Upload(url=links.failure), failure, f"{what}: the failure record"))
    with contextlib.ExitStack() as opened:
        # Every file is checked before any byte leaves (a link or a FIFO where a result should be
        # refuses the whole result): a job sharing the folder cannot have the worker send its files.
        files = [(link, opened.enter_context(open_to_send(path, label)), label) for link, path, label in sends]
        for link, fh, label in files:
            send(link, fh, label)


def local_run(run: SiteRun, root: pathlib.Path, *, create: bool = True) -> SiteRun:
    """``run`` with its store paths in the local folder ``root`` (created if missing and ``create``):
    the input global model under ``global/``, the update under ``out/``, the try's staging under ``staging/``."""
    local_global = root / "global" / pathlib.PurePosixPath(run.global_model).name
    local_output = root / "out" / pathlib.PurePosixPath(run.output).name
    if create:
        local_output.parent.mkdir(parents=True, exist_ok=True)
    local_staging = None
    if run.staging:
        parts = pathlib.PurePosixPath(run.staging).parts
        local_staging = str(root.joinpath("staging", *parts[-3:]))  # <site>/try-<n>/update.safetensors
    return dataclasses.replace(run, global_model=str(local_global), output=str(local_output), staging=local_staging)


def stage_in_through_links(local: SiteRun, links: SiteLinks) -> None:
    """The round's input global model and its record, through ``links``, to ``local``'s paths (a
    missing object is left missing: the runner's input check says what is wrong)."""
    what = f"site {links.site!r} round {links.round}: the input global model"
    model = pathlib.Path(local.global_model)
    download(links.global_record, _beside(record_path, model), f"{what}'s record")
    download(links.global_model, model, what)


def stage_out_through_links(local: SiteRun, links: SiteLinks) -> None:
    """What the runner left at ``local``'s output (accepted update and record, or failure record), through ``links``."""
    upload_through_links(pathlib.Path(local.output), links)


@contextlib.contextmanager
def staged_through_links(run: SiteRun, links: SiteLinks) -> Iterator[SiteRun]:
    """``run`` with local paths, its input read and its result written through ``links``.

    Nothing is cleared first (the links cannot delete): the aggregation counts only the update
    whose digests this site task signed and returned, so a slot's earlier content never counts.
    A job that outlives this process (a deferred pod) stages in and out in two steps instead
    (:class:`flare_airflow.operators.links.SharedLinksStaging`).
    """
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"flare-{run.site}-r{run.round}-"))
    local = local_run(run, root)
    try:
        stage_in_through_links(local, links)
        yield local
        stage_out_through_links(local, links)
    except BaseException:
        with contextlib.suppress(Exception):
            stage_out_through_links(local, links)
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def staged(run: SiteRun, store: ModelStore, links: SiteLinks | None = None) -> Iterator[SiteRun]:
    """``run`` with local paths when the store is an object store (else ``run`` itself); through
    ``links`` when the central side gave this site the round's links.

    On exit, whatever happened, the runner's result goes to the store and the local copy is removed.
    """
    if links is not None:
        with staged_through_links(run, links) as local:
            yield local
        return
    if is_local(store):
        yield run
        return
    remote_output = store.resolve_uri(run.output)
    try:
        clear_outputs(remote_output)  # a re-run overwrites this site's round and nothing else
    except OSError as exc:
        raise StoreError(f"cannot prepare {remote_output} in the model store: {exc}") from exc
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"flare-{run.site}-r{run.round}-"))
    try:
        local = local_run(run, root)
        _download(store, run.global_model, pathlib.Path(local.global_model))
        yield local
        upload_result(pathlib.Path(local.output), remote_output)
    except BaseException:
        with contextlib.suppress(Exception):
            upload_result(root / "out" / pathlib.PurePosixPath(run.output).name, remote_output)
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
