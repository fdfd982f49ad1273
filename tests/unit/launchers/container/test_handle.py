"""launchers/container/handle.py without an engine: a handle found again by its labels (another
process launched the container) reads the engine's answers through the one state table, keeps the
log and exit state once the end was seen, and leaves nothing of the job on the host.

The engine is a recorder named as such: it answers the calls a real podman answers (``inspect``'s
JSON state, ``logs``, ``rm``, ``stop``) with canned text; the real engine is tested in
tests/integration/containers/.
"""

from __future__ import annotations

import json
from typing import Any

from flare_airflow.core.spec import JobIdentity, JobReturnCode, JobState
from flare_airflow.launchers.container.engine import ContainerEngineError
from flare_airflow.launchers.container.handle import ContainerJobHandle


class RecordingEngine:
    """The launcher as the handle uses it: ``engine`` calls answered from ``states`` in turn."""

    def __init__(self, *states: dict[str, Any] | None) -> None:
        self.states = list(states)
        self.calls: list[tuple[str, ...]] = []
        self.sink_lines: list[str] = []
        self.sink = self.sink_lines.append
        self.resources = None

    def engine(self, *args: str, env: Any = None, timeout: float | None = None) -> str:
        self.calls.append(args)
        if args[0] == "inspect":
            state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            if state is None:
                raise ContainerEngineError("Error: no such container c1")
            return json.dumps(state)
        if args[0] == "logs":
            return "epoch 1\nsecret-token done\n"
        return ""

    def mask(self, text: str) -> str:
        return text.replace("secret-token", "***")


IDENTITY = JobIdentity("j", "manual__1", 2, "site-1", 1)


def found(engine: RecordingEngine) -> ContainerJobHandle:
    return ContainerJobHandle(engine, IDENTITY.site_job(7.0), IDENTITY, "c1")  # type: ignore[arg-type]


def test_a_found_container_is_followed_until_it_exits_then_removed_with_its_log_kept() -> None:
    engine = RecordingEngine({"Status": "running"}, {"Status": "exited", "ExitCode": 0})
    handle = found(engine)
    assert handle.poll() is JobReturnCode.UNKNOWN and handle.status.state is JobState.RUNNING
    assert handle.poll() is JobReturnCode.SUCCESS
    assert handle.logs() == "epoch 1\n*** done\n"  # masked, kept after the container is gone
    assert engine.sink_lines == ["[site-1 r2] epoch 1", "[site-1 r2] *** done"]
    assert ("rm", "--force", "c1") in engine.calls
    calls = len(engine.calls)
    assert handle.poll() is JobReturnCode.SUCCESS and len(engine.calls) == calls  # the end is kept


def test_a_failed_container_keeps_its_exit_code_and_peek_only_looks() -> None:
    engine = RecordingEngine({"Status": "exited", "ExitCode": 3})
    handle = found(engine)
    assert handle.peek().done and ("rm", "--force", "c1") not in engine.calls  # a watcher only looks
    assert handle.poll() is JobReturnCode.EXECUTION_ERROR and handle.state is JobState.FAILED
    assert "3" in handle.reason


def test_terminate_stops_with_the_jobs_shutdown_timeout_removes_and_reports_aborted() -> None:
    engine = RecordingEngine({"Status": "running"})
    handle = found(engine)
    handle.terminate()
    assert engine.calls[0] == ("stop", "--time", "7", "c1")
    assert ("rm", "--force", "c1") in engine.calls
    assert handle.poll() is JobReturnCode.ABORTED and handle.state is JobState.TERMINATED
    handle.terminate()  # a second terminate (on_kill after a failed watch) does nothing more
    assert engine.calls.count(("rm", "--force", "c1")) == 1
