"""operators/lifecycle.py against a fake backend and a fake host (as cosmos tests its base class
directly against a fake execution mode): the steps in order around a backend's launch and watch --
launch, wait, defer and resume, watch in the worker, finish, fail, on_kill -- and where the job
sees the model store.

The fake backend and host are in fake_site_task.py, the store fixtures in conftest.py; the job,
the store (fsspec's in-memory filesystem standing in for an object store, as in test_staging.py),
the site run, the update's checks and the failure records are real. The steps for a job that
shares a folder with its worker are tested in test_shared_links.py.
"""

from __future__ import annotations

import pathlib
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowSkipException, TaskDeferred

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import ModelStore, failure_path, path_from_uri, record_path
from flare_airflow.operators import lifecycle, staging
from flare_airflow.operators.lifecycle import SiteTaskHost, SiteTaskLifecycle
from flare_airflow.operators.site_steps import SiteJobFailed, make_site_run
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job
from tests.unit.operators.fake_site_task import FakeHandle, FakeLauncher, FakeSiteTask, PushingTI, fake_task

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


def test_an_object_store_this_worker_cannot_use_fails_the_site_naming_the_connection(
    object_store: ModelStore, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staging on the worker could not read the global model (the store refused this worker's
    credential): the site fails saying through what and what to check, before any launch."""

    def refused(store: Any, uri: str, local: Any) -> None:
        raise PermissionError("AccessDenied: 403")

    monkeypatch.setattr(staging, "_download", refused)
    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    ti = PushingTI()
    with pytest.raises(SiteJobFailed) as failed:
        fake_task(make_job(tmp_path), launcher).execute(context(ti))
    reason = str(failed.value)
    assert "memory://" in reason and "could not be used from this worker (connection 'default')" in reason
    assert "PermissionError: AccessDenied: 403" in reason
    assert "check the connection's credentials" in reason and reason.endswith("[INFRASTRUCTURE_ERROR]")
    assert launcher.launched == [] and "could not be used" in ti.xcoms[("self", "failure")]


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


def test_a_watch_in_the_worker_decides_on_the_run_it_launched(
    file_store: ModelStore, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The site run is made once per process: the launch and the resumed decision share it (the pod
    task's group and trigger too), instead of verifying the global model's digest again."""
    made = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs["argv"])
        return make_site_run(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "make_site_run", counted)
    task = fake_task(make_job(tmp_path), FakeLauncher(JobReturnCode.SUCCESS), event={"status": "success"})
    assert task.execute(context(PushingTI()))["site"] == "site-1"
    assert made == [["python", "train.py"]]


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
