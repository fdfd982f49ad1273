"""The held-out drill of issue 9 (0b) on the real thing: a pod site whose trainer runs for 75 s --
longer than the Kubernetes client's 60 s request timeout -- through Airflow's real scheduler,
LocalExecutor worker and triggerer (PostgreSQL), against the real control plane with the LOCAL
NODE AGENT test harness playing the kubelet. Before the fix the deferred task failed after ~60 s
with "Trigger failure" and its pod was left behind.

The same drill through the deferrable SitePodOperator alone (its trigger run in this process, default
settings) runs at the same time in a namespace of its own: one 75 s wait serves both paths."""

from __future__ import annotations

import pathlib
import re
import sys
import textwrap
import time

import pytest
import yaml
from kubernetes import client as k8s

from flare_airflow_testing.harness import tiny_model
from flare_airflow_testing.k8s.audit import AuditLog
from flare_airflow_testing.k8s.fixtures import fresh_namespace
from flare_airflow_testing.stack import AirflowStack, Postgres, scheduler_stack
from tests.integration.k8s.test_site_pod_operator import context_for, make_op, pods, run_deferred

TRAINER = pathlib.Path(__file__).parents[1] / "trainers" / "k8s_trainer.py"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: Postgres):
    # The drill is about the deferred path: pod tasks wait in the triggerer.
    env = {"AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True"}
    with scheduler_stack(tmp_path_factory.mktemp("pod-stack"), env, postgres=postgres, triggerer=True) as airflow:
        yield airflow


def test_a_pod_training_75_s_succeeds_through_scheduler_and_triggerer(
    stack: AirflowStack,
    control_plane,
    node_agent,
    namespace: str,
    core: k8s.CoreV1Api,
    audit: AuditLog,
    tmp_path: pathlib.Path,
) -> None:
    store = stack.home / "flare_store"
    store.mkdir(parents=True, exist_ok=True)
    folder = stack.dags / "long_pod"
    folder.mkdir()
    job = {
        "job": "long-pod",
        "rounds": 1,
        "min_clients": 2,
        "initial_model": str(tiny_model(folder / "init.safetensors")),
        "trainer": {"script": str(TRAINER), "args": ["--sleep", "75"], "shutdown_timeout": 2},
        "evaluate": False,
        "sites": {
            "@default": {"retries": 0},
            "site-1": {
                "launcher": "k8s",
                "launcher_spec": {
                    "k8s": {
                        "image": "registry.example/flare/trainer:1",
                        "namespace": namespace,
                        "config_file": str(control_plane.kubeconfig_path()),
                        "store_mount": {"host_path": str(store), "mount_path": "/flare-store"},
                        "trainer_command": [sys.executable],
                        "trainer_script": str(TRAINER),
                        "poll_interval": 1,
                    }
                },
            },
            "site-2": {},
        },
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "dag.py").write_text(
        textwrap.dedent(
            """
            from pathlib import Path
            from flare_airflow.builder import build_dag
            dag = build_dag(Path(__file__).with_name("job.yaml"))
            """
        )
    )
    with fresh_namespace(core, "direct-trigger-75s") as direct_namespace:
        mark = audit.mark()
        started = time.monotonic()
        run_id = stack.trigger("flare_long_pod")
        # While the scheduler's run trains, the operator and its trigger alone (no scheduler).
        direct_op, _ = make_op(tmp_path, direct_namespace, control_plane.kubeconfig, args=["--sleep", "75"])
        direct_started = time.monotonic()
        summary = run_deferred(direct_op, context_for(direct_op))
        direct_elapsed = time.monotonic() - direct_started
        state = stack.wait_for_run("flare_long_pod", run_id, timeout=420)
        elapsed = time.monotonic() - started
        direct_requests = audit.list_watch_requests(direct_namespace, mark)
        assert pods(core, direct_namespace) == []

    # The operator and trigger alone: one list and one watch that lasts for the whole run (a
    # Pending → Running re-watch at most).
    print(f"\nlist/watch requests while a {direct_elapsed:.0f} s pod ran (trigger alone): {direct_requests}")
    assert summary["num_samples"] == 7 and direct_elapsed >= 75
    assert direct_requests.count("list pods") <= 3, direct_requests
    assert len(direct_requests) <= 6, direct_requests

    tis = stack.task_instances("flare_long_pod", run_id)
    states = {t: ti["state"] for t, ti in tis.items()}
    assert state == "success", (states, (stack.root / "triggerer.log").read_text()[-3000:])
    assert set(states.values()) == {"success"}, states
    assert tis["round_1.site-1"]["try_number"] == 1, "no retry was needed"
    assert elapsed >= 75
    triggerer_log = (stack.root / "triggerer.log").read_text()
    # The pod was watched from the triggerer (a trigger's own log lines go to the task's log).
    assert re.search(r"\b[1-9][0-9]* triggers? currently running", triggerer_log), triggerer_log[-2000:]
    assert "Trigger failure" not in triggerer_log and "TimeoutError" not in triggerer_log
    assert core.list_namespaced_pod(namespace).items == [], "the pod is deleted when its task ends"
    watching = audit.list_watch_requests(namespace, mark)
    print(f"\n{elapsed:.0f} s run; list/watch requests while the pod ran: {watching}")
    # A handful per pod, not per minute of training: one list + one long watch (+ one re-watch).
    assert len(watching) <= 8, watching
