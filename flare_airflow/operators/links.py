"""Store links in the Airflow layer: the central side mints and seals them, a site task opens its own.

The task that publishes a round's input global model (``prepare`` for round 1, each round's
aggregation for the next) mints, per site, that round's links (:mod:`flare_airflow.core.store_links`)
with the store's credential -- which only the central side holds -- and seals each site's to that
site's box key in the registry. They travel in its XCom summary under ``links``: ciphertext, one
entry per site, each useless to any other site. A site task opens its own with its box key, checks
they are for this job, run, round and site and not expired, and stages through them.

A pod site's job runs beyond its worker: the worker stages through the links into a folder it
shares with the pod (:class:`SharedLinksStaging`, under the site's ``store_mount``), and the pod
holds no key and no link at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flare_airflow.core import envvars
from flare_airflow.core.config import JobConfig
from flare_airflow.core.store import (
    ModelStore,
    failure_path,
    path_from_uri,
    record_path,
    run_component,
    safe_component,
)
from flare_airflow.core.store_links import LinksError, SiteLinks, abort_unfinished_uploads, mint_site_links
from flare_airflow.core.trust import TrustError
from flare_airflow.core.trust.sealed import links_context, load_box_key, open_sealed, seal
from flare_airflow.operators.common import store_for
from flare_airflow.operators.staging import is_local, local_run, stage_in_through_links, stage_out_through_links
from flare_airflow.operators.trust import trust_settings
from flare_airflow.site_task.spec import SiteRun

#: The key of the sealed links in the XCom summary of the task that published the input global model.
LINKS_KEY = "links"
#: How long a round's links stay valid unless ``[flare] store_link_seconds`` says otherwise: long
#: enough for a round's site tasks to queue and train, short enough that a leaked link dies soon.
DEFAULT_LINK_SECONDS = 6 * 3600
# SigV4 presigned links live at most 7 days.
MAX_LINK_SECONDS = 7 * 24 * 3600
PRESIGNING_PROTOCOLS = ("s3", "s3a")


def link_seconds() -> int:
    """``$FLARE_STORE_LINK_SECONDS``, else ``[flare] store_link_seconds``, else 6 hours (at most 7 days)."""
    from airflow.configuration import conf

    text = os.environ.get(envvars.FLARE_STORE_LINK_SECONDS) or conf.get("flare", "store_link_seconds", fallback=None)
    try:
        seconds = int(text) if text else DEFAULT_LINK_SECONDS
    except ValueError:
        raise LinksError(f"[flare] store_link_seconds must be a whole number of seconds, got {text!r}") from None
    if not 60 <= seconds <= MAX_LINK_SECONDS:
        raise LinksError(f"[flare] store_link_seconds must be between 60 and {MAX_LINK_SECONDS}, got {seconds}")
    return seconds


def central_client(job: JobConfig, endpoint_url: str | None = None) -> Any:
    """An S3 client with the central side's store connection, signing links with SigV4 for
    ``endpoint_url`` (a site's own view of the store, its grant's ``store_endpoint``) or the connection's."""
    return central_clients(job)(endpoint_url)


def central_clients(job: JobConfig) -> Callable[[str | None], Any]:
    """:func:`central_client` for several endpoints: the connection read and one boto3 session made
    once, a client per endpoint asked. (A hook and session per client cost ~0.4 s of CPU each: a
    round minting links for sites that each see the store at an address of their own paid that
    per site.)"""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from botocore.config import Config

    hook = S3Hook(aws_conn_id=job.store_conn_id)
    session = hook.get_session()
    default_endpoint, region = hook.conn_config.endpoint_url, hook.conn_region_name

    def client(endpoint_url: str | None = None) -> Any:
        return session.client(
            "s3",
            endpoint_url=endpoint_url or default_endpoint,
            region_name=region,
            config=Config(signature_version="s3v4"),
        )

    return client


def presigns(store: ModelStore) -> bool:
    """Whether the store is one the central side mints links for (an S3 store)."""
    return not is_local(store) and getattr(store.root, "protocol", None) in PRESIGNING_PROTOCOLS


def mint_round_links(
    job: JobConfig, store: ModelStore, run_id: str, round_num: int, global_size: int, log: Any, client: Any = None
) -> dict[str, str] | None:
    """Site -> its sealed links for ``round_num``; None when the store is local (the embedded
    default: every task reads the store itself) or cannot presign, or without a key registry
    (one machine: no party to keep anything from). A site with no box key in the registry gets
    none and reaches the store with its own connection, as before (logged)."""
    settings = trust_settings()
    if not presigns(store) or not settings.strict:
        return None
    from flare_airflow.core.trust.grants import read_registry

    assert settings.registry_path is not None  # strict
    registry, grants = read_registry(Path(settings.registry_path))
    seconds = link_seconds()
    clients: dict[str | None, Any] = {} if client is None else {None: client}
    maker = functools.cache(lambda: central_clients(job))  # the connection read once, when first needed

    def client_for(endpoint: str | None) -> Any:
        if endpoint not in clients:
            clients[endpoint] = maker()(endpoint)
        return clients[endpoint]

    # Links minted again (this task retried, or cleared to replace expired links) replace the
    # round's earlier ones: an upload those opened is completed by no one.
    abort_site_uploads(job, run_id, log, store=store, round_num=round_num, client=client_for(None))
    sealed: dict[str, str] = {}
    for site in sorted(job.sites):
        try:
            box = registry.box_key(site)
        except TrustError as exc:
            log.warning(
                "round %d: no store links for site %s: %s; it needs its own store connection", round_num, site, exc
            )
            continue
        grant = grants.grant(site)
        endpoint = grant.store_endpoint if grant is not None else None
        links = mint_site_links(
            client_for(endpoint), store, job=job.job, run_id=run_id, round_num=round_num, site=site,
            expires_in=seconds, update_size=global_size,
        )  # fmt: skip
        context = links_context(job.job, run_id, round_num, site)
        sealed[site] = seal(box.public, box.kid, links.to_json().encode(), context=context)
    return sealed


def sealed_round_links(
    job: JobConfig, store: ModelStore, run_id: str, round_num: int, global_size: int, log: Any
) -> dict[str, str] | None:
    """:func:`mint_round_links` for a task: a failure fails it, saying what to fix (the global model
    is written and signed, but no site of a credential-free deployment could read it)."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        return mint_round_links(job, store, run_id, round_num, global_size, log)
    except (TrustError, LinksError) as exc:
        raise AirflowFailException(f"round {round_num}: the sites' store links cannot be minted: {exc}") from None
    except Exception as exc:  # botocore raises many types: a wrong central credential, an unknown bucket
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise AirflowFailException(
            f"round {round_num}: the sites' store links cannot be minted with the central store connection "
            f"{job.store_conn_id or 'aws_default'!r}: {type(exc).__name__}: {detail}; check it on the central side"
        ) from None


def abort_site_uploads(
    job: JobConfig,
    run_id: str,
    log: Any,
    *,
    store: ModelStore | None = None,
    round_num: int | None = None,
    client: Any = None,
) -> list[str]:
    """End the multipart uploads the sites left unfinished in ``run_id`` (round ``round_num``'s
    only when given): called by a round's aggregation once it read the round, and by the run's
    verdict for the whole run. Links are minted -- and uploads opened -- only for a presigning store
    in strict mode; elsewhere there is nothing of ours to end. Best effort: the round's or run's
    outcome does not depend on it, a failure is logged (the parts stay until a later call or the
    bucket's lifecycle rule, docs/model-store.md). ``store``: the job's by default."""
    where = f"round {round_num}" if round_num is not None else f"run {run_id}"
    try:
        store = store if store is not None else store_for(job)
        if not presigns(store) or not trust_settings().strict:
            return []
        aborted = abort_unfinished_uploads(
            client if client is not None else central_client(job), store,
            job=job.job, run_id=run_id, sites=job.sites, round_num=round_num,
        )  # fmt: skip
    except Exception as exc:  # botocore raises many types: a wrong central credential, a store away
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        log.warning(
            "%s: the sites' unfinished uploads were not aborted with the central store connection %r: %s: %s; "
            "their parts stay in the store until the run's end or the bucket's lifecycle rule removes them",
            where, job.store_conn_id or "aws_default", type(exc).__name__, detail,
        )  # fmt: skip
        return []
    if aborted:
        log.info("%s: aborted %d unfinished site upload(s): %s", where, len(aborted), aborted)
    return aborted


def open_site_links(
    summary: Any, *, job: str, run_id: str, round_num: int, site: str, key_dir: str | None = None
) -> SiteLinks | None:
    """This site's links from the XCom ``summary`` of the task that published its input global
    model, opened with its box key and checked; None when it holds none for this site.

    Raises :class:`TrustError` (sealed to another key, for another round, changed) or
    :class:`LinksError` (for another round or site, expired): the site must not fall back to
    anything else -- its trainer is not started."""
    sealed = summary.get(LINKS_KEY) if isinstance(summary, dict) else None
    if not isinstance(sealed, dict) or site not in sealed:
        return None
    what = f"site {site!r} round {round_num}: its store links"
    box = load_box_key(Path(key_dir or trust_settings().key_dir), site)
    plaintext = open_sealed(box, sealed[site], context=links_context(job, run_id, round_num, site), what=what)
    links = SiteLinks.from_json(plaintext, what)
    links.check(job=job, run_id=run_id, round_num=round_num, site=site)
    return links


def site_links(context: Any, job: JobConfig, site: str, round_num: int, global_task_id: str | None) -> SiteLinks | None:
    """:func:`open_site_links` for a site task: its links from the producer's XCom, or None; a
    refused one fails the task before anything is staged or launched (the reason in its XCom)."""
    from flare_airflow.operators.common import run_id_of
    from flare_airflow.operators.site_steps import site_failed

    ti = context.get("ti")
    if global_task_id is None or not hasattr(ti, "xcom_pull"):
        return None
    summary = ti.xcom_pull(task_ids=global_task_id)
    try:
        return open_site_links(summary, job=job.job, run_id=run_id_of(context), round_num=round_num, site=site)
    except (TrustError, LinksError) as exc:
        raise site_failed(context, site, round_num, f"{exc}; the trainer was not started [CONFIG_ERROR]") from None


#: The folder of a site's shared mount (a pod site's ``store_mount``) where its workers stage through links.
LINKS_STAGING_DIR = "links-staging"


def sweep_staging(mount: Path, job: str, run_id: str, site: str) -> list[Path]:
    """Remove what ``site``'s tries of ``run_id`` left in the shared folder under ``mount``: a try
    killed outright (kill -9: no ``on_kill``) keeps its folder -- a copy of the round's global model
    and perhaps an update -- until a later try of the same round clears it, and the last try has
    none. For the run's teardown, once no task of the run can resume. Returns the folders removed."""
    run_dir = mount / LINKS_STAGING_DIR / safe_component(job, "job name") / run_component(run_id)
    removed = [d for d in sorted(run_dir.glob(f"round-*/{safe_component(site, 'site')}")) if d.is_dir()]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    for emptied in [*sorted(run_dir.glob("round-*")), run_dir, run_dir.parent]:
        with contextlib.suppress(OSError):  # not empty: another site's or run's folder
            emptied.rmdir()
    return removed


def staging_folder(mount: Path, run: SiteRun, try_number: int) -> Path:
    """``<mount>/links-staging/<job>/<run>/round-NNNN/<site>/try-K``: derived from the site job's
    identity alone, so that a resumed task (a new process) finds what the deferred one staged."""
    return (
        mount / LINKS_STAGING_DIR / safe_component(run.job, "job name") / run_component(run.run_id)
        / f"round-{run.round:04d}" / safe_component(run.site, "site") / f"try-{try_number}"
    )  # fmt: skip


@dataclasses.dataclass
class SharedLinksStaging:
    """A site run staged through its links in a folder this worker shares with the site job (a
    pod's ``store_mount``), in two steps because the job outlives the process that launched it:
    :meth:`stage_in` when the task starts; the folder stays across a deferral, found again by the
    identity (:func:`staging_folder`) by the resumed task; :meth:`stage_out` when the task ends,
    whichever way -- the accepted update or the failure record through the links, then the folder
    removed. The job sees two read-only files and one writable folder: no key, no link.

    Checks, privacy filters and signing stay on the worker: :attr:`local` is the run they work on.
    """

    links: SiteLinks
    #: The shared mount as this worker sees it: the job's store root.
    mount: Path
    #: This try's folder under it.
    root: Path
    #: The run with its store paths in :attr:`root`.
    local: SiteRun

    @classmethod
    def of(cls, run: SiteRun, links: SiteLinks, mount: Path, try_number: int, *, resumed: bool) -> SharedLinksStaging:
        """``run`` staged under ``mount``; ``resumed``: the folder must exist already (it was staged
        in by the deferred task), else :class:`LinksError` says why it may not."""
        root = staging_folder(mount, run, try_number)
        if resumed and not root.is_dir():
            raise LinksError(
                f"site {run.site!r} round {run.round}: the folder it staged its store links into, {root}, is not on "
                "this worker: every worker serving the site's queue must see the same store_mount folder (a "
                "shared volume mounted at the same path), or run the site's pod tasks with deferrable=False"
            )
        return cls(links=links, mount=mount, root=root, local=local_run(run, root, create=False))

    def stage_in(self) -> None:
        """Clear earlier tries' folders (a try whose worker died left its own), then download the
        round's input global model and its record into this try's folder."""
        site_dir = self.root.parent
        if site_dir.is_dir():
            for other in site_dir.iterdir():
                if other.name.startswith("try-") and other != self.root:
                    shutil.rmtree(other, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)
        Path(self.local.output).parent.mkdir(parents=True)
        stage_in_through_links(self.local, self.links)

    @property
    def has_result(self) -> bool:
        """Whether the runner left a result to upload: an accepted update or a failure record."""
        output = path_from_uri(self.local.output)  # a local path: made so by of()
        return record_path(output).exists() or failure_path(output).exists()

    def stage_out(self) -> None:
        """Upload the result through the links, then remove the folder (and its emptied parents
        up to ``links-staging``). Done once: a second call finds nothing and does nothing."""
        if not self.root.is_dir():
            return
        try:
            stage_out_through_links(self.local, self.links)
        finally:
            self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        top = self.mount / LINKS_STAGING_DIR
        for parent in self.root.parents:
            if parent == top or top not in parent.parents:
                break
            with contextlib.suppress(OSError):  # not empty: another site job's folder
                parent.rmdir()
