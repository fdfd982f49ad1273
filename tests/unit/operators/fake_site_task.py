"""The lifecycle's fake backend and fake host, shared by its tests (test_lifecycle.py,
test_shared_links.py) and the store-links integration test; the fixtures that give them a store
and round links are in this folder's conftest.py.

The backend here is a fake named as such (its launcher records what it was handed, its jobs end
with the return code the test chooses and, when they succeed, send a real update as a trainer
would); the host is a fake operator with exactly what :class:`SiteTaskHost` asks.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any, ClassVar, NoReturn

from airflow.sdk.exceptions import TaskDeferred
from airflow.triggers.base import BaseTrigger, TriggerEvent

from flare_airflow.core.spec import JobHandleSpec, JobReturnCode, JobState, SiteJob
from flare_airflow.core.store import ModelStore, failure_path, path_from_uri, record_path
from flare_airflow.operators.lifecycle import SiteTaskLifecycle
from tests.unit.airflow_layer import RUN_ID, FakeTI, make_job
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


class FakeLinks:
    """The fake backend's round links: stage-in copies the global model out of the store, stage-out
    records what went up (the real links are tested on the S3 emulator and the control plane).
    ``down``: the store cannot be reached through them (both ways)."""

    def __init__(self, store: ModelStore) -> None:
        self.store = store
        self.uploads: list[str] = []
        self.down = False


def stage_in_through_fake_links(local: Any, links: FakeLinks) -> None:
    """``operators.links.stage_in_through_links`` for :class:`FakeLinks`."""
    if links.down:
        raise OSError("the store's endpoint refused the connection")
    src = links.store.global_model("unit", RUN_ID, 0)
    model = pathlib.Path(local.global_model)
    for src_path, dst in ((src, model), (record_path(src), pathlib.Path(str(record_path(model))))):
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src_path.read_bytes())


def stage_out_through_fake_links(local: Any, links: FakeLinks) -> None:
    """``operators.links.stage_out_through_links`` for :class:`FakeLinks`: records each upload."""
    if links.down:
        raise OSError("the store's endpoint refused the connection")
    out = pathlib.Path(local.output)
    for what, path in (("update", record_path(out)), ("failure", failure_path(out))):
        if pathlib.Path(str(path)).exists():
            links.uploads.append(f"{what}: {pathlib.Path(str(path)).read_text()}")


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
