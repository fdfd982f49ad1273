"""The site-task lifecycle's steps for a job that runs beyond its worker but shares a folder with it.

A pod site in strict mode holds no store credential: its worker opens the round's store links
and stages through them into the site's ``store_mount``, a folder it shares with the pod, which
then holds no key and no link (:class:`~flare_airflow.operators.links.SharedLinksStaging`, the
folder itself). :class:`SharedLinksSteps` is what the lifecycle does around that folder: stage in
before the launch, find it again in a resumed task, and, when the task ends whichever way, send
the accepted update or the failure record out through the links and remove the folder.

:class:`~flare_airflow.operators.lifecycle.SiteTaskLifecycle` mixes it in; a backend's operator
opts in with :attr:`SharedLinksSteps.stages_links_in_shared_folder` and fills
:meth:`~SharedLinksSteps.links_folder`. ``tests/unit/operators/test_shared_links.py`` drives the
steps against the lifecycle's fake backend.
"""

from __future__ import annotations

import abc
import contextlib
import pathlib
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from airflow.sdk import Context
from airflow.sdk.exceptions import TaskDeferred

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.failure_record import write_failure
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import path_from_uri
from flare_airflow.core.store_links import LinksError, SiteLinks
from flare_airflow.operators.links import SharedLinksStaging, site_links
from flare_airflow.operators.site_outputs import Summary
from flare_airflow.operators.site_steps import SiteJobFailed, site_failed, try_number_of
from flare_airflow.operators.staging import local_run
from flare_airflow.site_task.spec import SiteRun

if TYPE_CHECKING:
    from flare_airflow.operators.lifecycle import SiteTaskHost


class SharedLinksSteps(abc.ABC):
    """Staging through the round's store links in a folder shared with the job; mixed into the
    lifecycle, whose site job (:attr:`job`, :attr:`site`, :attr:`round_num`,
    :attr:`global_task_id`), :attr:`host` and :meth:`fail` it uses."""

    #: The job runs beyond this worker (a pod) but shares a folder with it (:meth:`links_folder`):
    #: with the round's store links, the worker stages through them there, the job holds no link.
    stages_links_in_shared_folder: ClassVar[bool] = False

    # This task's run staged through its links in the folder shared with its job (this process's).
    _shared: SharedLinksStaging | None = None

    # The lifecycle's site job (set in its constructor).
    job: JobConfig
    site: str
    round_num: int
    global_task_id: str | None

    @property
    @abc.abstractmethod
    def host(self) -> SiteTaskHost:
        """The operator the lifecycle is mixed into."""

    @abc.abstractmethod
    def fail(self, context: Context, run: SiteRun, rc: JobReturnCode, reason: str) -> SiteJobFailed:
        """The site's failure: in its failure record, in XCom and in the returned exception."""

    def links_folder(self) -> pathlib.Path:
        """Where this worker sees the folder it shares with the job (with
        :attr:`stages_links_in_shared_folder`); raises :class:`ConfigError` saying what to set
        when the site has none."""
        raise NotImplementedError(f"{type(self).__name__} stages links in a shared folder: it fills links_folder")

    def shared_staging(self, context: Context, run: SiteRun, *, resumed: bool) -> SharedLinksStaging | None:
        """This run staged through the round's links in the folder shared with the job -- staged
        in now, or found again by a ``resumed`` task -- or ``None`` when the job reaches the store
        itself (a backend that does not stage links so, or no links for this site). Once per process.

        Refused (the failure record through the links, a CONFIG_ERROR): a site with links whose
        jobs share no folder with the worker; a resumed task that does not find the folder.
        """
        if self._shared is not None:
            return self._shared
        if not self.stages_links_in_shared_folder:
            return None
        links = site_links(context, self.job, self.site, self.round_num, self.global_task_id)
        if links is None:
            return None
        try:
            shared = SharedLinksStaging.of(run, links, self.links_folder(), try_number_of(context), resumed=resumed)
        except (ConfigError, LinksError) as exc:
            raise self.fail_through_links(context, run, links, JobReturnCode.CONFIG_ERROR, str(exc)) from None
        if not resumed:
            try:
                shared.stage_in()
            except Exception as exc:
                self._shared = shared
                reason = (
                    f"the round's input global model could not be read through its store links: {exc}; check the "
                    "store's endpoint is reachable from this worker; refused links: clear the task that published "
                    "this round's global model to mint new ones"
                )
                raise self.end_shared(context, shared, JobReturnCode.INFRASTRUCTURE_ERROR, reason) from None
        self._shared = shared
        return shared

    def through_shared(
        self, context: Context, run: SiteRun, shared: SharedLinksStaging, step: Callable[[], Summary]
    ) -> Summary:
        """``step`` (the launch and watch, or the resumed decision) on the shared staged run. The
        folder outlives a deferral (the job still runs); when the task ends here, whichever way,
        its result goes out through the links and the folder is removed."""
        try:
            summary = step()
        except TaskDeferred:
            raise
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self.end_shared(context, shared, JobReturnCode.ABORTED, f"the site task ended: {type(exc).__name__}")
            raise
        try:
            shared.stage_out()
        except Exception as exc:
            detail = " ".join(str(exc).split())[:400] or type(exc).__name__
            raise site_failed(
                context, self.site, self.round_num,
                f"the accepted update could not be uploaded through its store links: {detail}; check the store's "
                "endpoint is reachable from this worker [INFRASTRUCTURE_ERROR]",
            ) from None  # fmt: skip
        if isinstance(summary, dict) and "uri" in summary:
            # The update's place in the store, not the shared folder's (accept_update pushed that).
            summary["uri"] = run.output
            context["ti"].xcom_push(key="return_value", value=summary)
        return summary

    def end_shared(self, context: Context, shared: SharedLinksStaging, rc: JobReturnCode, reason: str) -> Exception:
        """End a shared staging that did not reach :meth:`through_shared`'s success: the failure
        record (``reason``, unless the job's own is there) through the links, then the folder removed.
        Returns the site's failure to raise."""
        failed: Exception = site_failed(context, self.site, self.round_num, f"{reason} [{rc.name}]")
        if not shared.has_result and shared.root.is_dir():
            failed = self.fail(context, shared.local, rc, reason)
        self.send_failure_out(shared)
        return failed

    def send_failure_out(self, shared: SharedLinksStaging) -> None:
        """Best effort: the task fails with its reason (in its log and XCom) even when the store is away."""
        try:
            shared.stage_out()
        except Exception as exc:
            self.host.log.warning(
                "site %s round %d: the failure record was not uploaded: %s", self.site, self.round_num, exc
            )

    def fail_through_links(
        self, context: Context, run: SiteRun, links: SiteLinks, rc: JobReturnCode, reason: str
    ) -> Exception:
        """The site's failure before anything was staged: its record through ``links`` (from a
        temporary folder), so that the aggregation reads the reason."""
        with tempfile.TemporaryDirectory(prefix=f"flare-{self.site}-r{self.round_num}-") as tmp:
            root = pathlib.Path(tmp)
            shared = SharedLinksStaging(links=links, mount=root, root=root, local=local_run(run, root))
            return self.end_shared(context, shared, rc, reason)

    def end_shared_on_kill(self) -> None:
        """A killed task's shared staging: its failure record (ABORTED) through the links, the folder removed."""
        shared = self._shared
        if shared is None or not shared.root.is_dir():
            return
        if not shared.has_result:
            write_failure(path_from_uri(shared.local.output), JobReturnCode.ABORTED, "the site task was killed")
        self.send_failure_out(shared)
