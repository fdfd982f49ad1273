"""operators/shared_links.py: the lifecycle's steps for a job that runs beyond its worker but
shares a folder with it (a pod site in strict mode), driven against the lifecycle's fake backend
(fake_site_task.py) and fake round links (conftest.py's ``fake_links``: its uploads recorded, its
store reachable or ``down``). The folder, the site run, the update's checks and the failure records
are real; the real links are tested on the S3 emulator and the Kubernetes control plane.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from flare_airflow.core.errors import ConfigError
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.operators.links import SharedLinksStaging
from flare_airflow.operators.site_steps import SiteJobFailed
from tests.unit.airflow_layer import RUN_ID, context, make_job
from tests.unit.operators.fake_site_task import FakeLauncher, FakeLinks, FakeSiteTask, PushingTI, fake_task, shared_task


def left_in_the_folder(tmp_path: pathlib.Path) -> list[pathlib.Path]:
    """What the site task left in the folder it shares with its job (files: empty parents are fine)."""
    return [p for p in (tmp_path / "mount").rglob("*") if p.is_file()]


def staged_in_shared_folder(tmp_path: pathlib.Path) -> tuple[Any, FakeSiteTask, Any, SharedLinksStaging]:
    """A shared-folder task of round 1 whose global model was staged through its links."""
    ctx = context(PushingTI())
    task = shared_task(tmp_path, FakeLauncher(JobReturnCode.SUCCESS))
    run = task.site_run(ctx)
    shared = task.shared_staging(ctx, run, resumed=False)
    assert shared is not None
    return ctx, task, run, shared


# ---------------------------------------------------------------------------- which tasks stage so


def test_only_a_backend_sharing_a_folder_with_links_stages_there_once_per_process(
    fake_links: FakeLinks, tmp_path: pathlib.Path
) -> None:
    ctx = context(PushingTI())
    elsewhere = fake_task(make_job(tmp_path), FakeLauncher(JobReturnCode.SUCCESS), stages=False)
    assert elsewhere.shared_staging(ctx, elsewhere.site_run(ctx), resumed=False) is None  # reaches the store
    task = shared_task(tmp_path, FakeLauncher(JobReturnCode.SUCCESS))
    run = task.site_run(ctx)
    shared = task.shared_staging(ctx, run, resumed=False)
    assert shared is not None and pathlib.Path(shared.local.global_model).is_file()
    assert task.shared_staging(ctx, run, resumed=True) is shared  # the resumed decision finds the same one


def test_a_site_without_links_is_not_staged_in_the_shared_folder(tmp_path: pathlib.Path) -> None:
    """No links in the producer's XCom (a site with its own store connection): the job reaches the
    store itself, and nothing is written to the shared folder."""
    task = shared_task(tmp_path, FakeLauncher(JobReturnCode.SUCCESS))
    task.global_task_id = "prepare"  # whose XCom has no links
    ctx = context(PushingTI())
    assert task.shared_staging(ctx, task.site_run(ctx), resumed=False) is None
    assert not (tmp_path / "mount").exists()


# ---------------------------------------------------------------------------- refused before the launch


def test_a_site_with_links_and_no_shared_folder_fails_through_its_links_before_launching(
    fake_links: FakeLinks, tmp_path: pathlib.Path
) -> None:
    def no_folder(self: Any) -> pathlib.Path:
        raise ConfigError("site 'site-1': set launcher_spec.k8s.store_mount")

    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    task = shared_task(tmp_path, launcher)
    type(task).links_folder = no_folder  # type: ignore[method-assign]  # a class of this test's own
    ti = PushingTI()
    with pytest.raises(SiteJobFailed, match=r"set launcher_spec\.k8s\.store_mount \[CONFIG_ERROR\]"):
        task.execute(context(ti))
    assert launcher.launched == []
    (upload,) = fake_links.uploads  # the record went out from a temporary folder, which is gone
    assert upload.startswith("failure:") and "CONFIG_ERROR" in upload and "store_mount" in upload
    assert "store_mount" in ti.xcoms[("self", "failure")]


def test_a_global_model_the_links_cannot_read_fails_the_site_and_leaves_nothing_behind(
    fake_links: FakeLinks, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake_links.down = True
    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    ti = PushingTI()
    with caplog.at_level(logging.WARNING), pytest.raises(SiteJobFailed) as failed:
        shared_task(tmp_path, launcher).execute(context(ti))
    assert "could not be read through its store links" in str(failed.value)
    assert str(failed.value).endswith("[INFRASTRUCTURE_ERROR]")
    assert launcher.launched == []
    # The store is away both ways: the record could not go out, the task still fails with its reason.
    assert fake_links.uploads == [] and "the failure record was not uploaded" in caplog.text
    assert "could not be read through its store links" in ti.xcoms[("self", "failure")]
    assert left_in_the_folder(tmp_path) == []


# ---------------------------------------------------------------------------- ended after the launch


def test_an_update_the_links_cannot_upload_fails_the_site_and_removes_the_folder(
    fake_links: FakeLinks, tmp_path: pathlib.Path
) -> None:
    ctx, task, run, shared = staged_in_shared_folder(tmp_path)

    def launch_then_lose_the_store() -> Any:
        summary = task.run_site_job(ctx, shared.local)
        fake_links.down = True
        return summary

    with pytest.raises(SiteJobFailed, match=r"could not be uploaded through its store links.*\[INFRASTRUCTURE_ERROR\]"):
        task.through_shared(ctx, run, shared, launch_then_lose_the_store)
    assert fake_links.uploads == [] and left_in_the_folder(tmp_path) == []


def test_an_interrupted_step_sends_an_aborted_record_and_is_raised_again(
    fake_links: FakeLinks, tmp_path: pathlib.Path
) -> None:
    ctx, task, run, shared = staged_in_shared_folder(tmp_path)

    def interrupted() -> Any:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        task.through_shared(ctx, run, shared, interrupted)
    (upload,) = fake_links.uploads
    assert upload.startswith("failure:") and "ABORTED" in upload and "KeyboardInterrupt" in upload
    assert left_in_the_folder(tmp_path) == []


def test_a_deferral_keeps_the_folder_and_sends_nothing(fake_links: FakeLinks, tmp_path: pathlib.Path) -> None:
    ctx, task, run, shared = staged_in_shared_folder(tmp_path)

    def deferred() -> Any:
        raise TaskDeferred(trigger=None, method_name="resume")  # type: ignore[arg-type]  # never run here

    with pytest.raises(TaskDeferred):
        task.through_shared(ctx, run, shared, deferred)
    assert fake_links.uploads == [] and shared.root.is_dir()


def test_a_killed_task_that_staged_nothing_sends_nothing(fake_links: FakeLinks, tmp_path: pathlib.Path) -> None:
    task = shared_task(tmp_path, FakeLauncher(JobReturnCode.SUCCESS))
    task.end_shared_on_kill()
    assert fake_links.uploads == []


# ---------------------------------------------------------------------------- through the lifecycle


def test_links_staged_in_a_shared_folder_outlive_a_deferral_and_go_out_once_on_resume(
    fake_links: FakeLinks, tmp_path: pathlib.Path
) -> None:
    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    task = shared_task(tmp_path, launcher, event={"status": "success"})
    task.deferrable = True
    ti = PushingTI()
    with pytest.raises(TaskDeferred) as deferred:
        task.execute(context(ti))
    (job,) = launcher.launched
    folder = tmp_path / "mount" / "links-staging" / "unit"
    assert (
        job.env["FLARE_GLOBAL_MODEL"].startswith(str(folder)) and pathlib.Path(job.env["FLARE_GLOBAL_MODEL"]).exists()
    )
    assert fake_links.uploads == []  # the job runs on: nothing goes out, the folder stays
    resumed = shared_task(tmp_path, launcher, event={"status": "success"})  # a new process
    summary = getattr(resumed, deferred.value.method_name)(context(ti), {"status": "success"})
    assert [u.split(":")[0] for u in fake_links.uploads] == ["update"]
    assert summary["uri"] == str(fake_links.store.site_update("unit", RUN_ID, 1, "site-1"))
    assert ti.xcoms[("self", "return_value")]["uri"] == summary["uri"]  # the store's slot, not the folder
    assert list((tmp_path / "mount" / "links-staging").iterdir()) == [], (
        "the folder and its emptied parents are removed"
    )


@pytest.mark.parametrize("how", ["failed_job", "killed", "resumed_elsewhere"])
def test_every_failure_of_a_shared_staging_sends_its_failure_record_and_removes_the_folder(
    how: str, fake_links: FakeLinks, tmp_path: pathlib.Path
) -> None:
    rc = JobReturnCode.EXECUTION_ERROR if how == "failed_job" else JobReturnCode.SUCCESS
    event = None if how == "failed_job" else {"status": "success"}  # a failed job: watched by its handle
    task = shared_task(tmp_path, FakeLauncher(rc), event=event)
    if how == "failed_job":
        with pytest.raises(SiteJobFailed, match=r"\[EXECUTION_ERROR\]"):
            task.execute(context(PushingTI()))
    elif how == "killed":
        task.deferrable = True
        with pytest.raises(TaskDeferred):
            task.execute(context(PushingTI()))
        task.on_kill()
    else:  # the deferred task's folder is not on the worker that resumes it
        with pytest.raises(SiteJobFailed, match=r"same store_mount folder.*\[CONFIG_ERROR\]"):
            task.resume(context(PushingTI()), {"status": "success"})
        assert task.ended_by_event == [{"status": "success"}], "the job the event names is ended"
    (upload,) = fake_links.uploads
    expected = {"failed_job": "EXECUTION_ERROR", "killed": "ABORTED", "resumed_elsewhere": "CONFIG_ERROR"}[how]
    assert upload.startswith("failure:") and expected in upload, upload
    assert not any((tmp_path / "mount").rglob("*.json")), "nothing left in the shared folder"
