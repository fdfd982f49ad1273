"""SiteJobLaunchOperator's refusals that need no cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from flare_airflow.builder import build_dag
from flare_airflow.core.errors import ConfigError
from flare_airflow.operators.site_job import SiteJobLaunchOperator
from tests.unit.airflow_layer import RUN_ID, FakeTI, context, make_job

K8S_SENSOR = {
    "launcher": "k8s",
    "watch": "sensor",
    "launcher_spec": {"k8s": {"image": "registry.example/t:1", "namespace": "fl"}},
}


@dataclass
class StatesTI(FakeTI):
    """The Task SDK's ``get_task_states`` answered from ``states``."""

    states: dict[str, str] | None = None
    task_id: str = "round_1.site-1_launch"

    def get_task_states(self, dag_id: str, task_ids: list[str], run_ids: list[str]) -> dict[str, Any]:
        return {RUN_ID: {t: s for t, s in (self.states or {}).items() if t in task_ids}}


def test_a_launch_cleared_without_its_finished_watch_refuses_saying_what_to_clear(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": K8S_SENSOR, "site-2": {}})
    launch = build_dag(job).task_dict["round_1.site-1_launch"]
    ctx = {**context(StatesTI(states={"round_1.site-1": "success"})), "task": launch}
    with pytest.raises(
        AirflowFailException, match=r"not launched: its watch round_1.site-1 already finished \(success\)"
    ):
        launch.execute(ctx)


def test_a_round_beyond_the_run_is_skipped_before_anything_is_launched(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": K8S_SENSOR, "site-2": {}})
    launch = build_dag(job).task_dict["round_2.site-1_launch"]
    with pytest.raises(AirflowSkipException, match="round 2 skipped"):
        launch.execute({**context(StatesTI(), rounds=1), "task": launch})


def test_a_process_site_cannot_be_launched_for_a_sensor(tmp_path) -> None:
    job = make_job(tmp_path)
    with pytest.raises(ConfigError, match="ends with the task that launched it"):
        SiteJobLaunchOperator(task_id="l", job=job, site="site-1", round_num=1)
