"""operators/lifecycle.py against a fake backend (as cosmos tests its base class directly): the
steps in order around a backend's launch and watch, and where the job sees the model store.

The backend here is a fake named as such (its launcher records what it was handed and its jobs end
with the return code the test chooses); the job, the store (fsspec's in-memory filesystem standing
in for an object store, as in test_staging.py), the site run and the failure records are real.
"""

from __future__ import annotations

import logging
import pathlib
import re
from typing import Any, ClassVar

import numpy as np
import pytest
from upath import UPath

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import ModelStore, failure_path
from flare_airflow.operators import lifecycle, site_steps
from flare_airflow.operators.lifecycle import SiteTaskLifecycle
from flare_airflow.operators.site_steps import SiteJobFailed
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job


class FakeHandle:
    """A job of the fake backend: already ended with ``rc``."""

    def __init__(self, rc: JobReturnCode) -> None:
        self.rc = rc
        self.terminated = False

    def wait(self) -> JobReturnCode:
        return self.rc

    def terminate(self) -> None:
        self.terminated = True

    def where(self) -> str:
        return "fake"


class FakeLauncher:
    """The fake backend's launcher: records each site job it launches."""

    def __init__(self, rc: JobReturnCode) -> None:
        self.rc = rc
        self.launched: list[Any] = []

    def launch_job(self, job_meta: Any, fl_ctx: dict[str, Any]) -> FakeHandle:
        self.launched.append(job_meta)
        return FakeHandle(self.rc)

    def terminate_earlier_tries(self, identity: Any) -> list[str]:
        return []


def fake_operator(job: Any, launcher: FakeLauncher, *, stages: bool) -> SiteTaskLifecycle:
    class FakeSiteTask(SiteTaskLifecycle):
        stages_store: ClassVar[bool] = stages

        def argv(self) -> list[str]:
            return ["python", "train.py"]

        def launcher(self, *, try_number: int, secrets: Any) -> Any:
            return launcher

    task = FakeSiteTask()
    task.job, task.site, task.round_num, task.global_task_id = job, "site-1", 1, None
    task.log = logging.getLogger("fake-site-task")
    return task


@pytest.fixture
def object_store(request, monkeypatch, tmp_path) -> ModelStore:
    """The job's store is an in-memory object store (no connection needed for it here)."""
    name = re.sub(r"\W", "-", request.node.name)  # brackets in a URI's host read as IPv6
    store = ModelStore(UPath(f"memory://lifecycle-{name}"))
    write_artifact(store.global_model("unit", RUN_ID, 0), FLModel(params={"w": np.zeros(3, np.float32)}))
    for module in (lifecycle, site_steps):
        monkeypatch.setattr(module, "store_for", lambda job: store)
    monkeypatch.setattr(lifecycle, "check_connection", lambda store, conn_id: None)
    return store


@pytest.mark.parametrize("stages", [True, False], ids=["staged", "reaches_the_store"])
def test_the_job_sees_the_store_as_its_backend_says_and_its_failure_lands_there(
    stages: bool, object_store: ModelStore, tmp_path: pathlib.Path
) -> None:
    launcher = FakeLauncher(JobReturnCode.EXECUTION_ERROR)
    task = fake_operator(make_job(tmp_path), launcher, stages=stages)
    with pytest.raises(SiteJobFailed, match=r"site 'site-1' round 1 failed: EXECUTION_ERROR \[EXECUTION_ERROR\]"):
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
    from airflow.sdk.exceptions import AirflowSkipException

    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    task = fake_operator(make_job(tmp_path), launcher, stages=True)
    task.round_num = 2
    with pytest.raises(AirflowSkipException, match="round 2 skipped"):
        task.execute(context(FakeTI(), rounds=1))
    assert launcher.launched == []


def test_an_interrupted_wait_ends_the_job(object_store: ModelStore, tmp_path: pathlib.Path) -> None:
    class Interrupted(FakeHandle):
        def wait(self) -> JobReturnCode:
            raise KeyboardInterrupt

    launcher = FakeLauncher(JobReturnCode.SUCCESS)
    handle = Interrupted(JobReturnCode.SUCCESS)
    launcher.launch_job = lambda job_meta, fl_ctx: handle  # type: ignore[method-assign]
    task = fake_operator(make_job(tmp_path), launcher, stages=False)
    with pytest.raises(KeyboardInterrupt):
        task.execute(context(FakeTI()))
    assert handle.terminated
