"""SlurmJobTrigger: serialize() keeps every field, and run() never raises (failures are events)."""

from __future__ import annotations

import asyncio
import importlib
import inspect

from flare_airflow.triggers.slurm_state import SlurmJobTrigger

NON_DEFAULTS = {
    "job_id": "42",
    "name": "fl-demo-site-1-r1-0123abcd-t2",
    "output": "/scratch/out/fl-demo-site-1-r1-0123abcd-t2.out",
    "submitted_at": 1_800_000_000.5,
    "connection": "ssh:hpc_login",
    "pending_timeout": 12.5,
    "startup_timeout": 7.0,
    "poll_interval": 0.25,
    "execution_deadline": 1_900_000_000.0,
    "offset": 1234,
    "prefix": "[site-1 r1] ",
    "secret_refs": {"HF_TOKEN": {"conn_id": "hf", "field": "password"}, "DB": {"variable": "db"}},
    "cancel_on_kill": False,
}


def test_the_test_covers_every_constructor_argument() -> None:
    params = inspect.signature(SlurmJobTrigger.__init__).parameters
    assert set(params) - {"self"} == set(NON_DEFAULTS)
    for name, value in NON_DEFAULTS.items():
        assert params[name].default != value, name


def test_serialize_round_trip_keeps_every_field() -> None:
    path, kwargs = SlurmJobTrigger(**NON_DEFAULTS).serialize()
    assert kwargs == NON_DEFAULTS
    module, _, name = path.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.serialize() == (path, kwargs)


def first_event(trigger: SlurmJobTrigger) -> dict:
    async def run() -> dict:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("no event")

    return asyncio.run(run())


def test_slurm_commands_missing_is_a_failed_event_not_an_exception(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    trigger = SlurmJobTrigger(job_id="7", name="n", output="/nonexistent/n.out", submitted_at=0, poll_interval=0.01)
    event = first_event(trigger)
    assert event["status"] == "failed"
    assert event["return_code"] == 104
    assert "cannot read the job's state" in event["reason"] and "scontrol" in event["reason"]


def test_an_unreachable_connection_is_an_error_event(monkeypatch) -> None:
    trigger = SlurmJobTrigger(job_id="7", name="n", output="/o", submitted_at=0, connection="ssh:", poll_interval=0.01)
    event = first_event(trigger)
    assert event["status"] == "error"
    assert "cannot watch SLURM job 7" in event["reason"]
