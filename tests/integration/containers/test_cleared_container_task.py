"""A cleared container site task, through the site task itself on real podman.

Airflow's Clear gives the task instance its next try. While the earlier try still runs (its worker
busy or gone), the new try must end that try's container (found by its labels) before it starts its
own, and its update must be the one published; a Clear after the task finished must overwrite the
published update. Nothing of either try is left on the engine.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from flare_airflow.core.config import apply_site_policy, job_from_dict, site_policy_from_dict
from flare_airflow.core.model import FLModel, read_record, write_artifact
from flare_airflow.core.store import ModelStore
from flare_airflow.operators.container import SiteContainerOperator
from flare_airflow.operators.site import SiteJobFailed
from flare_airflow_testing.containers import engine
from flare_airflow_testing.harness import tiny_model

RUN_ID = "manual__2026-12-02T00:00:00+00:00"

# The trainer adds the number in /opt/code/value to the global model; while /opt/code/hold exists it
# waits (ignoring SIGTERM, as a busy trainer may) -- the test decides from outside what each try does.
TRAINER = """
import pathlib, signal, time
import flare_airflow.client as flare
signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = pathlib.Path("/opt/code")
model = flare.receive()
print("received", flush=True)
while (code / "hold").exists():
    time.sleep(0.1)
value = float((code / "value").read_text())
flare.send(flare.FLModel(params={k: v + value for k, v in model.params.items()}, meta={"num_samples": 1}))
"""


def site_task(tmp_path: Path, image: str) -> tuple[SiteContainerOperator, ModelStore, Path]:
    store, code = tmp_path / "store", tmp_path / "code"
    store.mkdir()
    code.mkdir()
    (code / "trainer.py").write_text(TRAINER)
    container = {
        "image": image,
        "pull": "never",
        "trainer_script": "/opt/code/trainer.py",
    }
    # Host directories are the site admin's to grant (a job file cannot): the site policy mounts the code.
    granted = {"allowed_host_paths": [str(tmp_path)], "volumes": [{"host_path": str(code), "mount_path": "/opt/code"}]}
    job = job_from_dict(
        {
            "job": "cleared",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(tiny_model(tmp_path / "init.safetensors")),
            "store": f"file://{store}",
            "trainer": {"script": "trainer.py", "shutdown_timeout": 1},
            "sites": {"site-1": {"launcher": "container", "launcher_spec": {"container": container}}},
        }
    )
    policy = {"sites": {"site-1": {"launcher": "container", "launcher_spec": {"container": {**container, **granted}}}}}
    job = apply_site_policy(job, "site-1", site_policy_from_dict(policy, source="site.yaml"))
    models = ModelStore(store)
    write_artifact(
        models.global_model("cleared", RUN_ID, 0),
        FLModel(params={"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}),
    )
    return SiteContainerOperator(task_id="site-1", job=job, site="site-1", round_num=1), models, code


def context(op: SiteContainerOperator, try_number: int) -> dict[str, Any]:
    ti = SimpleNamespace(
        dag_id="cleared_dag",
        task_id=op.task_id,
        map_index=-1,
        try_number=try_number,
        start_date=datetime.now(UTC),
        xcom_push=lambda *a, **k: None,
    )
    return {"ti": ti, "task_instance": ti, "run_id": RUN_ID, "dag": SimpleNamespace(dag_id="cleared_dag"), "params": {}}


def containers() -> dict[str, str]:
    """name -> try label of every container of this job on the engine (any state)."""
    import subprocess

    out = subprocess.run(
        [engine(), "ps", "-a", "--format", '{{.Names}} {{index .Labels "flare-airflow.try"}}',
         "--filter", "label=flare-airflow.job=cleared", "--filter", f"label=flare-airflow.run-id={RUN_ID}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return dict(line.split() for line in out.splitlines() if line.strip())


def start_held_try_1(op: SiteContainerOperator, code: Path) -> tuple[threading.Thread, dict[str, Any]]:
    """Try 1 of the task in a thread, its trainer held (as a busy, stuck or abandoned worker would
    leave it), once its container runs: the thread and what the try returned or raised."""
    assert containers() == {}, "a container of an earlier test run is still there"
    (code / "hold").touch()
    (code / "value").write_text("1")
    outcome: dict[str, Any] = {}

    def try_1() -> None:
        try:
            outcome["result"] = op.execute(context(op, 1))
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=try_1, daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while set(containers().values()) != {"1"}:
        assert time.monotonic() < deadline and worker.is_alive(), f"try 1's container did not start: {outcome}"
        time.sleep(0.2)
    return worker, outcome


def test_a_cleared_container_task_ends_the_earlier_try_and_overwrites_the_update(
    tmp_path: Path, trainer_image: str
) -> None:
    op, models, code = site_task(tmp_path, trainer_image)
    worker, first = start_held_try_1(op, code)

    # Clear while running: try 2 ends try 1's container (SIGTERM ignored: stopped after the shutdown
    # timeout), then trains with value 2. Try 1 fails: its job was ended under it.
    (code / "hold").unlink()
    (code / "value").write_text("2")
    second = SiteContainerOperator(task_id="site-1", job=op.job, site="site-1", round_num=1)
    summary = second.execute(context(second, 2))
    worker.join(60)
    assert not worker.is_alive()
    assert isinstance(first.get("error"), SiteJobFailed), first
    update = models.site_update("cleared", RUN_ID, 1, "site-1")
    assert read_record(update).sha256 == summary["sha256"]
    np.testing.assert_array_equal(load_file(str(update))["w"], np.full(4, 2, np.float32))
    assert containers() == {}, "nothing of try 1 or try 2 is left"

    # Clear after it finished: try 3 runs again and its update replaces try 2's.
    (code / "value").write_text("3")
    third = SiteContainerOperator(task_id="site-1", job=op.job, site="site-1", round_num=1)
    again = third.execute(context(third, 3))
    assert again["sha256"] != summary["sha256"] and read_record(update).sha256 == again["sha256"]
    np.testing.assert_array_equal(load_file(str(update))["w"], np.full(4, 3, np.float32))
    assert containers() == {}


@pytest.fixture(autouse=True)
def _no_container_left() -> Any:
    """A failing test must not leave this job's containers behind for the next run."""
    yield
    import subprocess

    left = list(containers())
    if left:
        subprocess.run([engine(), "rm", "--force", *left], capture_output=True, check=False)


def test_the_sweep_on_the_sites_worker_removes_what_an_abandoned_try_left(
    tmp_path: Path, trainer_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from flare_airflow.operators.container import SweepContainersOperator
    from flare_airflow.operators.site_steps import SITE_CONFIG_ENV

    op, _, code = site_task(tmp_path, trainer_image)
    # The last try, abandoned (its worker gone): its container holds on, and no later try comes.
    worker, abandoned = start_held_try_1(op, code)
    # The run's teardown on the site's worker, as the builder routes it: only its sites, and the
    # worker's site policy (which names the engine) applied.
    block = op.job.sites["site-1"].launcher_spec.container.model_dump(mode="json", exclude_defaults=True)
    policy = tmp_path / "site.yaml"
    policy.write_text(
        json.dumps({"sites": {"site-1": {"launcher": "container", "launcher_spec": {"container": block}}}})
    )
    monkeypatch.setenv(SITE_CONFIG_ENV, str(policy))
    sweep = SweepContainersOperator(task_id="sweep_containers_q", job=op.job, sites=["site-1"])
    removed = sweep.execute(context(op, 1))  # type: ignore[arg-type]
    assert len(removed) == 1 and removed[0].endswith("-t1"), removed
    assert containers() == {}, "the sweep removed the abandoned try's container"
    worker.join(60)
    assert not worker.is_alive() and isinstance(abandoned.get("error"), SiteJobFailed), abandoned
