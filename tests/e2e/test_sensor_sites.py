"""``watch: sensor`` through real Airflow (``airflow dags test``): Kubernetes sites on the real
control plane (the LOCAL NODE AGENT test harness plays the kubelet) and SLURM sites on real
daemons run each round as ``<site>_launch >> <site>`` (SiteJobLaunchOperator, SiteJobSensor);
the federated result must equal the process-sites run bitwise, as the fused tasks' does."""

from __future__ import annotations

import copy
import pathlib
import shutil

import pytest
import yaml

from flare_airflow_testing.harness import AirflowHome
from flare_airflow_testing.slurm.cluster import SlurmCluster
from tests.e2e.test_kubernetes_sites import k8s_block
from tests.e2e.test_slurm_sites import digits_job, slurm_block

pytestmark = pytest.mark.e2e
SITES = ("site-1", "site-2", "site-3", "site-4")


def test_sensor_watched_kubernetes_and_slurm_sites_match_the_process_run_bitwise(
    airflow_home: AirflowHome, slurm: SlurmCluster, control_plane, node_agent, namespace: str, tmp_path: pathlib.Path
) -> None:
    saved = dict(airflow_home.env)
    airflow_home.env.update(slurm.env)
    try:
        dag_file = digits_job(airflow_home, "digits-sensor", [], slurm_block(tmp_path))
        job = yaml.safe_load((dag_file.parent / "job.yaml").read_text())
        k8s = {
            "launcher": "k8s",
            "launcher_spec": {"k8s": k8s_block(airflow_home, namespace, control_plane.kubeconfig_path())},
        }
        slurm_site = {"launcher": "slurm", "launcher_spec": {"slurm": slurm_block(tmp_path)}}
        job["sites"]["site-2"] = {**copy.deepcopy(k8s), "watch": "sensor"}
        job["sites"]["site-3"] = {**copy.deepcopy(slurm_site), "watch": "sensor"}
        job["sites"]["site-4"] = copy.deepcopy(k8s)  # fused, in the same run
        (dag_file.parent / "job.yaml").write_text(yaml.safe_dump(job))
        # Deferrable: the sensors wait in the (in-process) triggerer; poke and reschedule mode run
        # under the real scheduler in tests/integration/sensors/test_sensor_on_the_scheduler.py.
        airflow_home.env["AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE"] = "True"
        result = airflow_home.run("flare_digits_sensor", dag_file, conf={"rounds": 2})
        airflow_home.env.pop("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE")
        reference = airflow_home.run(
            "flare_digits_sensor_ref", digits_job(airflow_home, "digits-sensor-ref", [], {}), conf={"rounds": 2}
        )
    finally:
        airflow_home.env.clear()
        airflow_home.env.update(saved)
    assert result.returncode == 0, result.log[-6000:]
    expected = {
        "prepare": "success",
        "publish": "success",
        "verdict": "success",
        "sweep_pods": "success",
        "sweep_slurm_jobs": "success",
    }
    for r in range(1, 6):
        state = "success" if r <= 2 else "skipped"
        expected[f"round_{r}.global_model"] = state
        for site in SITES:
            expected[f"round_{r}.{site}"] = state
        for site in ("site-2", "site-3"):  # launch and watch, each in the grid
            expected[f"round_{r}.{site}_launch"] = state
    assert result.tasks == expected, result.log[-4000:]
    assert "site job digits-sensor/site-2/r1/t1 launched: {'backend': 'k8s'" in result.log
    assert "site job digits-sensor/site-3/r2/t1 launched: {'backend': 'slurm'" in result.log
    # A sensor whose job still ran at its first check waited in the triggerer and resumed on its
    # event; one whose job had already ended decided at that first check. Which one depends on the
    # order `dags test` runs the tasks in and on the trainers' speed: both paths are driven one by
    # one in tests/integration/sensors/. Here each sensor must have taken one of them, whole.
    for r in (1, 2):
        for site in ("site-2", "site-3"):
            runs = result.log.count(f"[DAG TEST] running task <TaskInstance: flare_digits_sensor.round_{r}.{site} ")
            resumed = f"site {site} round {r}: trigger event success" in result.log
            assert (runs, resumed) in ((1, False), (2, True)), (site, r, runs, resumed)
    assert reference.returncode == 0, reference.log[-4000:]
    assert result.state["published"]["sha256"] == reference.state["published"]["sha256"]
    assert slurm.jobs() == []
    shutil.rmtree(dag_file.parent)
