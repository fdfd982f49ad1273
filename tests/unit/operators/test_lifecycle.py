"""operators/lifecycle.py against a fake backend and a fake host (as cosmos tests its base class
directly against a fake execution mode): the steps in order around a backend's launch and watch --
launch, wait, defer and resume, watch in the worker, finish, fail, on_kill -- and where the job
sees the model store.

The backend here is a fake named as such (its launcher records what it was handed, its jobs end
with the return code the test chooses and, when they succeed, send a real update as a trainer
would); the host is a fake operator with exactly what :class:`SiteTaskHost` asks. The job, the
store (fsspec's in-memory filesystem standing in for an object store, as in test_staging.py), the
site run, the update's checks and the failure records are real.
"""

from __future__ import annotations

import logging
import pathlib
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, NoReturn

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowSkipException, TaskDeferred
from airflow.triggers.base import BaseTrigger, TriggerEvent
from upath import UPath

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobHandleSpec, JobReturnCode, JobState, SiteJob
from flare_airflow.core.store import ModelStore, failure_path, path_from_uri, record_path
from flare_airflow.operators import lifecycle, site_steps
from flare_airflow.operators.lifecycle import SiteTaskHost, SiteTaskLifecycle
from flare_airflow.operators.site_steps import SiteJobFailed
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job
from tests.unit.site_task import parity_trainer


class PushingTI(FakeTI):
    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[("self", key)] = value


class FakeHandle(JobHandleSpec):
    """A job of the fake backend: it has ended with ``rc`` (after sending an update, on success)."""

    def __init__(self, rc: JobReturnCode) -> None:
        self.rc = rc
        self.terminated = False

    @property
    def state(self) -> JobState:
        if self.terminated:
            return JobState.TERMINATED
        return JobState.SUCCEEDED if self.rc is JobReturnCode.SUCCESS else JobState.FAILED

    @property
    def reason(self) -> str:
        return "" if self.rc is JobReturnCode.SUCCESS else "the fake trainer exited 1"

    def poll(self) -> JobReturnCode:
        return self.rc

    def wait(self, timeout: float | None = None) -> JobReturnCode:
        return self.rc

    def terminate(self) -> None:
        self.terminated = True

    def logs(self) -> str:
        return "epoch 1\nTraceback: boom\n"

    def where(self) -> dict[str, Any]:
        return {"backend": "fake"}


class FakeLauncher:
    """The fake backend's launcher: records each site job it launches; a job that will succeed
    sends a real update where the trainer is told to (its FLARE_OUTPUT)."""

    def __init__(self, rc: JobReturnCode) -> None:
        self.rc = rc
        self.launched: list[SiteJob] = []
        self.handles: list[FakeHandle] = []

    def launch_job(self, job_meta: SiteJob, fl_ctx: dict[str, Any]) -> FakeHandle:
        self.launched.append(job_meta)
        if self.rc is JobReturnCode.SUCCESS:
            out = path_from_uri(job_meta.env["FLARE_OUTPUT"])
            out.parent.mkdir(parents=True, exist_ok=True)
            parity_trainer.write_update("good", out, path_from_uri(job_meta.env["FLARE_GLOBAL_MODEL"]))
        self.handles.append(FakeHandle(self.rc))
        return self.handles[-1]

    def terminate_earlier_tries(self, identity: Any) -> list[str]:
        return []


class FakeTrigger(BaseTrigger):
    """A trigger that saw the job end with ``payload`` (the backend's real triggers are tested
    against their control planes)."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__()
        self.payload = payload

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.FakeTrigger", {"payload": self.payload}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(self.payload)


class FakeHost:
    """The operator a site task is mixed into, with only what :class:`SiteTaskHost` asks."""

    def __init__(self, *, task_id: str = "site-1-r1", execution_timeout: timedelta | None = None, **kwargs: Any):
        self.task_id = task_id
        self.execution_timeout = execution_timeout
        self.operator_kwargs = kwargs  # what the operator's own base class would receive
        self.log = logging.getLogger("fake-site-task")

    def defer(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: timedelta | int | float | None = None,
    ) -> NoReturn:
        raise TaskDeferred(trigger=trigger, method_name=method_name, kwargs=kwargs, timeout=timeout)


class FakeSiteTask(SiteTaskLifecycle[FakeHandle], FakeHost):
    """The fake backend's site task; ``event``: its job is watched by a trigger ending so."""

    stages_store: ClassVar[bool] = True

    def __init__(self, *, fake_launcher: FakeLauncher, event: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.fake_launcher = fake_launcher
        self.event = event
        self.ended: list[FakeHandle] = []
        self.ended_by_event: list[dict[str, Any]] = []

    def argv(self) -> list[str]:
        return ["python", "train.py"]

    def launcher(self, *, try_number: int, secrets: Any) -> Any:
        return self.fake_launcher

    def trigger(self, *, context: Any, run: Any, handle: FakeHandle) -> BaseTrigger | None:
        return None if self.event is None else FakeTrigger(self.event)

    def end_job(self, handle: FakeHandle) -> None:
        self.ended.append(handle)
        super().end_job(handle)

    def end_watched_job(self, event: dict[str, Any]) -> None:
        self.ended_by_event.append(event)


def fake_task(job: Any, launcher: FakeLauncher, *, stages: bool = True, **kwargs: Any) -> FakeSiteTask:
    cls = type("FakeSiteTask", (FakeSiteTask,), {"stages_store": stages})
    task: FakeSiteTask = cls(job=job, site="site-1", round_num=1, fake_launcher=launcher, **kwargs)
    return task


@pytest.fixture
def object_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModelStore:
    """The job's store is an in-memory object store (no connection needed for it here)."""
    name = re.sub(r"\W", "-", request.node.name)  # brackets in a URI's host read as IPv6
    store = ModelStore(UPath(f"memory://lifecycle-{name}"))
    write_artifact(store.global_model("unit", RUN_ID, 0), FLModel(params={"w": np.zeros(3, np.float32)}))
    for module in (lifecycle, site_steps):
        monkeypatch.setattr(module, "store_for", lambda job: store)
    monkeypatch.setattr(lifecycle, "check_connection", lambda store, conn_id: None)
    return store


@pytest.fixture
def file_store(tmp_path: pathlib.Path) -> ModelStore:
    """The job's own store (files under the test's directory), with round 1's global model."""
    store = ModelStore(UPath(tmp_path / "store"))
    write_artifact(store.global_model("unit", RUN_ID, 0), FLModel(params={"w": np.zeros(3, np.float32)}))
    return store


# ---------------------------------------------------------------------------- constructor


def test_the_constructor_sets_the_site_job_and_gives_the_operator_the_sites_defaults(tmp_path: pathlib.Path) -> None:
    job = make_job(tmp_path, sites={"site-1": {"retries": 3}, "site-2": {}})
    task = fake_task(job, FakeLauncher(JobReturnCode.SUCCESS), task_id="t")
    assert (task.job_name, task.site, task.round_num, task.global_task_id) == ("unit", "site-1", 1, None)
    assert task.operator_kwargs["retries"] == 3  # the site's defaults reach the operator's base class
    assert isinstance(task, SiteTaskHost)


def test_a_lifecycle_without_an_operator_is_refused_when_built(tmp_path: pathlib.Path) -> None:
    class NoHost(SiteTaskLifecycle[FakeHandle]):
        def argv(self) -> list[str]:
            return []

        def __init__(self, **kwargs: Any) -> None:  # what an operator base would take, dropped
            super().__init__(**{k: v for k, v in kwargs.items() if k in ("job", "site", "round_num")})

    with pytest.raises(TypeError, match="without an operator"):
        NoHost(job=make_job(tmp_path), site="site-1", round_num=1)


# ---------------------------------------------------------------------------- launch, wait, finish


def test_launch_then_wait_then_finish_publishes_the_update(file_store: ModelStore, tmp_path: pathlib.Path) -> None:
    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    task = fake_task(make_job(tmp_path), launcher)
    ti = PushingTI()
    summary = task.execute(context(ti))
    (job,) = launcher.launched
    assert list(job.argv) == ["python", "train.py"] and job.site == "site-1" and job.round == 1
    assert summary["site"] == "site-1" and summary["num_samples"] == 1
    assert str(path_from_uri(summary["uri"])) == str(file_store.site_update("unit", RUN_ID, 1, "site-1"))
    assert record_path(path_from_uri(summary["uri"])).exists()  # published in the store
    assert ti.xcoms[("self", "return_value")] == summary
    assert task.ended == []  # a job that ended on its own is not ended again


def test_a_replaced_input_global_model_is_refused_before_any_job_is_launched(
    file_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    """A backend whose job runs the trainer itself (not the site's runner) has the worker check the
    staged global model first: a replaced one never reaches a trainer."""
    model = pathlib.Path(str(file_store.global_model("unit", RUN_ID, 0)))
    write_artifact(tmp_path / "other.safetensors", FLModel(params={"w": np.full(3, -10.0, np.float32)}))
    model.write_bytes((tmp_path / "other.safetensors").read_bytes())  # its record still the genuine one's
    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    with pytest.raises(SiteJobFailed, match=r"\[INFRASTRUCTURE_ERROR\]"):
        fake_task(make_job(tmp_path), launcher).execute(context(PushingTI()))
    assert launcher.launched == []
    # A backend whose runner checks it itself is not checked twice (the runner hashes it once).
    runner_task = type("RunnerChecks", (FakeSiteTask,), {"runner_checks_input": True})(
        job=make_job(tmp_path), site="site-1", round_num=1, fake_launcher=launcher
    )
    runner_task.check_input(context(PushingTI()), runner_task.site_run(context(PushingTI())))


def test_a_failed_job_fails_with_its_return_code_reason_and_last_lines(
    file_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    task = fake_task(make_job(tmp_path), FakeLauncher(JobReturnCode.EXECUTION_ERROR))
    ti = PushingTI()
    with pytest.raises(SiteJobFailed) as failed:
        task.execute(context(ti))
    message = str(failed.value)
    assert "the fake trainer exited 1; its last log lines: epoch 1 | Traceback: boom [EXECUTION_ERROR]" in message
    record = failure_path(file_store.site_update("unit", RUN_ID, 1, "site-1")).read_text()
    assert "EXECUTION_ERROR" in record and "Traceback: boom" in record  # where the aggregation reads it
    assert "Traceback: boom" in ti.xcoms[("self", "failure")]


@pytest.mark.parametrize("stages", [True, False], ids=["staged", "reaches_the_store"])
def test_the_job_sees_the_store_as_its_backend_says_and_its_failure_lands_there(
    stages: bool, object_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    launcher = FakeLauncher(JobReturnCode.EXECUTION_ERROR)
    task = fake_task(make_job(tmp_path), launcher, stages=stages)
    with pytest.raises(SiteJobFailed, match=r"site 'site-1' round 1 failed: the fake trainer exited 1"):
        task.execute(context(FakeTI()))
    (job,) = launcher.launched
    paths = (job.env["FLARE_GLOBAL_MODEL"], job.env["FLARE_OUTPUT"])  # what the trainer is told
    if stages:  # a process or container job: files of this worker, removed when the task ends
        assert all(not p.startswith("memory://") for p in paths), paths
        assert not pathlib.Path(paths[0]).exists()
    else:  # a pod or SLURM job reaches the store itself: never a path that exists only on this worker
        assert all(p.startswith("memory://") for p in paths), paths
    # Either way the failure record is in the store, where the aggregation reads it.
    remote = object_store.site_update("unit", RUN_ID, 1, "site-1")
    assert "EXECUTION_ERROR" in failure_path(remote).read_text()


def test_a_site_task_of_a_round_beyond_the_run_is_skipped_before_anything_launches(
    object_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    task = fake_task(make_job(tmp_path), launcher)
    task.round_num = 2
    with pytest.raises(AirflowSkipException, match="round 2 skipped"):
        task.execute(context(FakeTI(), rounds=1))
    assert launcher.launched == []


# ---------------------------------------------------------------------------- watch by a trigger


def test_a_deferrable_watch_defers_to_resume_and_the_resumed_task_publishes(
    file_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    task = fake_task(make_job(tmp_path), launcher, event={"status": "success"}, execution_timeout=timedelta(hours=1))
    task.deferrable = True
    ti = PushingTI()
    ti.start_date = datetime.now(tz=UTC)  # type: ignore[attr-defined]  # FakeTI has no start date
    with pytest.raises(TaskDeferred) as deferred:
        task.execute(context(ti))
    assert deferred.value.method_name == "resume"
    assert timedelta(minutes=60) < deferred.value.timeout <= timedelta(minutes=61)  # deadline + a minute
    assert task.ended == [] and ti.xcoms.get(("self", "return_value")) is None  # the job runs on
    # The triggerer's event reaches a new task process (a fresh operator from the parsed DAG).
    resumed = fake_task(make_job(tmp_path), launcher, event={"status": "success"})
    summary = getattr(resumed, deferred.value.method_name)(context(ti), {"status": "success"})
    assert summary["site"] == "site-1" and record_path(path_from_uri(summary["uri"])).exists()


def test_a_resumed_failure_ends_what_the_event_names_and_fails_with_its_return_code(
    file_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    task = fake_task(make_job(tmp_path), FakeLauncher(JobReturnCode.SUCCESS))
    event = {"status": "timeout", "return_code": int(JobReturnCode.ABORTED), "reason": "pending for 600 s"}
    with pytest.raises(SiteJobFailed, match=r"pending for 600 s \[ABORTED\]"):
        task.resume(context(PushingTI()), event)
    assert task.ended_by_event == [event]  # it may still run: it must not outlive the task


def test_a_watch_in_the_worker_runs_the_same_trigger_and_a_lost_watch_ends_the_job(
    file_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    ok = fake_task(make_job(tmp_path), FakeLauncher(JobReturnCode.SUCCESS), event={"status": "success"})
    assert ok.execute(context(PushingTI()))["site"] == "site-1"
    lost = {"status": "error", "return_code": int(JobReturnCode.INFRASTRUCTURE_ERROR), "reason": "API gone"}
    task = fake_task(make_job(tmp_path), FakeLauncher(JobReturnCode.SUCCESS), event=lost)
    with pytest.raises(SiteJobFailed, match=r"API gone \[INFRASTRUCTURE_ERROR\]"):
        task.execute(context(PushingTI()))
    # No triggerer to hand the watch back to: the error becomes a timeout and the job is ended.
    assert [e["status"] for e in task.ended_by_event] == ["timeout"]


def test_a_refused_deferral_ends_the_job(file_store: ModelStore, tmp_path: pathlib.Path) -> None:
    class Refusing(FakeSiteTask):
        def defer(self, **kwargs: Any) -> NoReturn:
            raise RuntimeError("the trigger cannot be serialised")

    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    task = Refusing(
        job=make_job(tmp_path), site="site-1", round_num=1, fake_launcher=launcher, event={"status": "success"}
    )
    task.deferrable = True
    with pytest.raises(RuntimeError, match="serialised"):
        task.execute(context(PushingTI()))
    assert task.ended == launcher.handles and launcher.handles[0].terminated


# ---------------------------------------------------------------------------- ending the job


def test_an_interrupted_wait_ends_the_job(object_store: ModelStore, tmp_path: pathlib.Path) -> None:
    class Interrupted(FakeHandle):
        def wait(self, timeout: float | None = None) -> JobReturnCode:
            raise KeyboardInterrupt

    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    handle = Interrupted(JobReturnCode.SUCCESS)
    launcher.launch_job = lambda job_meta, fl_ctx: handle  # type: ignore[method-assign]
    task = fake_task(make_job(tmp_path), launcher, stages=False)
    with pytest.raises(KeyboardInterrupt):
        task.execute(context(FakeTI()))
    assert handle.terminated


def test_on_kill_ends_the_running_job_and_nothing_before_a_launch(
    file_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    task = fake_task(make_job(tmp_path), launcher, event={"status": "success"})
    task.on_kill()  # killed before anything was launched
    assert task.ended == []
    task.deferrable = True
    with pytest.raises(TaskDeferred):
        task.execute(context(PushingTI()))
    task.on_kill()  # Airflow's SIGTERM while the task held the job
    assert task.ended == launcher.handles and launcher.handles[0].terminated


# ---------------------------------------------------------------------------- links in a shared folder


class FakeLinks:
    """The fake backend's round links: stage-in copies the global model out of the store, stage-out
    records what went up (the real links are tested on the S3 emulator and the control plane)."""

    def __init__(self, store: ModelStore) -> None:
        self.store = store
        self.uploads: list[str] = []


@pytest.fixture
def shared_links(object_store: ModelStore, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> FakeLinks:
    from flare_airflow.operators import links as links_module

    fake = FakeLinks(object_store)

    def stage_in(local: Any, links: FakeLinks) -> None:
        src = links.store.global_model("unit", RUN_ID, 0)
        model = pathlib.Path(local.global_model)
        for src_path, dst in ((src, model), (record_path(src), pathlib.Path(str(record_path(model))))):
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src_path.read_bytes())

    def stage_out(local: Any, links: FakeLinks) -> None:
        out = pathlib.Path(local.output)
        for what, path in (("update", record_path(out)), ("failure", failure_path(out))):
            if pathlib.Path(str(path)).exists():
                links.uploads.append(f"{what}: {pathlib.Path(str(path)).read_text()}")

    monkeypatch.setattr(links_module, "stage_in_through_links", stage_in)
    monkeypatch.setattr(links_module, "stage_out_through_links", stage_out)
    monkeypatch.setattr(lifecycle, "site_links", lambda *a: fake)
    return fake


def shared_task(tmp_path: pathlib.Path, launcher: FakeLauncher, **kwargs: Any) -> FakeSiteTask:
    """A backend whose job runs beyond the worker but shares ``tmp_path/mount`` with it (as a pod)."""
    mount = tmp_path / "mount"
    cls = type(
        "FakeSharedSiteTask",
        (FakeSiteTask,),
        {"stages_store": False, "stages_links_in_shared_folder": True, "links_folder": lambda self: mount},
    )
    task: FakeSiteTask = cls(job=make_job(tmp_path), site="site-1", round_num=1, fake_launcher=launcher, **kwargs)
    return task


def test_links_staged_in_a_shared_folder_outlive_a_deferral_and_go_out_once_on_resume(
    shared_links: FakeLinks, tmp_path: pathlib.Path
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
    assert shared_links.uploads == []  # the job runs on: nothing goes out, the folder stays
    resumed = shared_task(tmp_path, launcher, event={"status": "success"})  # a new process
    summary = getattr(resumed, deferred.value.method_name)(context(ti), {"status": "success"})
    assert [u.split(":")[0] for u in shared_links.uploads] == ["update"]
    assert summary["uri"] == str(shared_links.store.site_update("unit", RUN_ID, 1, "site-1"))
    assert ti.xcoms[("self", "return_value")]["uri"] == summary["uri"]  # the store's slot, not the folder
    assert list((tmp_path / "mount" / "links-staging").iterdir()) == [], (
        "the folder and its emptied parents are removed"
    )


@pytest.mark.parametrize("how", ["failed_job", "killed", "resumed_elsewhere"])
def test_every_failure_of_a_shared_staging_sends_its_failure_record_and_removes_the_folder(
    how: str, shared_links: FakeLinks, tmp_path: pathlib.Path
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
    (upload,) = shared_links.uploads
    expected = {"failed_job": "EXECUTION_ERROR", "killed": "ABORTED", "resumed_elsewhere": "CONFIG_ERROR"}[how]
    assert upload.startswith("failure:") and expected in upload, upload
    assert not any((tmp_path / "mount").rglob("*.json")), "nothing left in the shared folder"
