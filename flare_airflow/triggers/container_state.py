"""Container job trigger: watches one container site job, found by its identity labels, until it ends.

The deferrable form of the sensor's watch of a container site (``watch: sensor``). Every read
finds the container again by its identity (:meth:`ContainerLauncher.find_job`: a triggerer restart
or a re-deferral needs no container id) and maps its state through the one state table
(:func:`flare_airflow.launchers.container.map_container`) without touching it: the sensor, back
in a worker, reads the final state and the log, publishes the update and removes the container.
It never raises: failures become ``error`` events. The engine must be reachable where the
triggerer runs (the site's host); a site whose triggerer is elsewhere watches in ``poke`` or
``reschedule`` mode instead.

Events (``TriggerEvent.payload``, :class:`~flare_airflow.core.spec.SiteJobEvent`)::

    {"status": "success" | "failed" | "error", "state", "return_code", "reason", "message"}

``failed``: the container ended without success, or is gone; ``error``: the engine could not be
asked (the job may still run).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from flare_airflow.core.config import ContainerLaunchSpec, ResourceSpec
from flare_airflow.core.spec import EventStatus, JobIdentity, JobReturnCode, JobState, JobStatus, SiteJobEvent
from flare_airflow.launchers.container import ContainerLauncher

# Engine calls failing in a row before the trigger gives up (an error event; the sensor decides).
_MAX_FAILURES = 8


class ContainerJobTrigger(BaseTrigger):
    """Wait for a container site job to end.

    :param spec: the site's ``launcher_spec.container`` block, as JSON data.
    :param identity: the job's identity (job, run, round, site, try) as :meth:`JobIdentity.to_dict` gives it.
    :param resources: the site's ``resource_spec`` as JSON data (the memory limit names an OOM kill).
    :param poll_interval: seconds between reads.
    """

    _FIELDS = ("spec", "identity", "resources", "poll_interval")

    def __init__(
        self,
        *,
        spec: dict[str, Any],
        identity: dict[str, Any],
        resources: dict[str, Any] | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.identity = identity
        self.resources = resources
        self.poll_interval = poll_interval

    @classmethod
    def for_site(cls, spec: ContainerLaunchSpec, resources: ResourceSpec, identity: JobIdentity) -> ContainerJobTrigger:
        """The trigger of the container launched under ``identity`` at a site with these blocks."""
        return cls(
            spec=spec.model_dump(mode="json"),
            identity=identity.to_dict(),
            resources=resources.model_dump(mode="json"),
            poll_interval=spec.poll_interval,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {f: getattr(self, f) for f in self._FIELDS}

    def _event(self, kind: EventStatus, status: JobStatus) -> TriggerEvent:
        label = JobIdentity.from_dict(self.identity).label
        event: SiteJobEvent = {
            "status": kind,
            "state": status.state.value,
            "return_code": int(status.return_code),
            "reason": status.reason,
            "message": f"container of site job {label}: {status.reason or status.state.value}",
        }
        return TriggerEvent(event)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            identity = JobIdentity.from_dict(self.identity)
            launcher = ContainerLauncher(
                ContainerLaunchSpec.model_validate(self.spec),
                ResourceSpec.model_validate(self.resources or {}),
                try_number=identity.try_number,
            )
        except Exception as exc:  # a trigger that raises leaves the sensor no event to decide on
            yield self._event(
                "error", JobStatus(JobState.UNKNOWN, JobReturnCode.INFRASTRUCTURE_ERROR, str(exc), done=False)
            )
            return
        failures = 0
        while True:
            try:
                handle = await asyncio.to_thread(launcher.find_job, identity)
                status = None if handle is None else await asyncio.to_thread(handle.peek)
            except Exception as exc:  # the engine's CLI failed or timed out: count, retry, then give up
                failures += 1
                if failures >= _MAX_FAILURES:
                    reason = f"the container engine could not be asked {failures} times: {exc}"
                    yield self._event(
                        "error", JobStatus(JobState.UNKNOWN, JobReturnCode.INFRASTRUCTURE_ERROR, reason, done=False)
                    )
                    return
                await asyncio.sleep(self.poll_interval)
                continue
            failures = 0
            if status is None:
                gone = JobStatus(JobState.UNKNOWN, JobReturnCode.UNKNOWN, "the container is gone", done=True)
                yield self._event("failed", gone)
                return
            if status.done:
                yield self._event("success" if status.state is JobState.SUCCEEDED else "failed", status)
                return
            await asyncio.sleep(self.poll_interval)
