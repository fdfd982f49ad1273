"""build_dag: the task graph, trigger rules, pools and the XCom wiring between rounds, without a scheduler."""

from __future__ import annotations

import pytest

from flare_airflow.builder import AGGREGATE_TASK, build_dag
from flare_airflow.operators.aggregate import AggregateOperator
from flare_airflow.operators.prepare import PrepareRunOperator
from flare_airflow.operators.publish import PublishOperator
from flare_airflow.operators.site import SiteTrainOperator
from flare_airflow.operators.verdict import RunVerdictOperator
from tests.unit.airflow_layer import make_job

GPU_SITE = {"resource_spec": {"num_of_gpus": 2}, "resource_manager": {"type": "gpu", "num_of_gpus": 4}}


@pytest.fixture
def dag(tmp_path):
    job = make_job(
        tmp_path,
        sites={"site-1": GPU_SITE, "site-2": {}},
        trainer={"script": "train.py", "hparams": {"lr": 0.1, "epochs": 2}},
    )
    return build_dag(job)


def test_task_ids_and_classes(dag) -> None:
    assert dag.dag_id == "flare_unit"
    assert sorted(dag.task_dict) == [
        "prepare",
        "publish",
        "round_1.global_model",
        "round_1.site-1",
        "round_1.site-2",
        "round_2.global_model",
        "round_2.site-1",
        "round_2.site-2",
        "verdict",
    ]
    assert isinstance(dag.task_dict["prepare"], PrepareRunOperator)
    assert isinstance(dag.task_dict["publish"], PublishOperator)
    assert isinstance(dag.task_dict["round_1.site-1"], SiteTrainOperator)
    assert isinstance(dag.task_dict[f"round_2.{AGGREGATE_TASK}"], AggregateOperator)


def test_dependencies_and_trigger_rules(dag) -> None:
    t = dag.task_dict
    assert t["prepare"].downstream_task_ids == {"round_1.site-1", "round_1.site-2"}
    assert t["round_1.site-1"].downstream_task_ids == {"round_1.global_model"}
    assert t["round_1.global_model"].downstream_task_ids == {"round_2.site-1", "round_2.site-2", "publish"}
    assert t["round_2.global_model"].downstream_task_ids == {"publish"}
    # The aggregation runs whatever its sites' outcome: a failed site does not count, it does not block.
    assert t["round_1.global_model"].trigger_rule == "all_done"
    assert t["round_1.site-1"].trigger_rule == "all_success"


def test_gpu_sites_take_one_pool_slot_per_gpu(dag) -> None:
    gpu, plain = dag.task_dict["round_1.site-1"], dag.task_dict["round_1.site-2"]
    assert (gpu.pool, gpu.pool_slots) == ("flare_gpu_site-1", 2)
    assert (plain.pool, plain.pool_slots) == ("default_pool", 1)


def test_global_model_wiring(dag) -> None:
    t = dag.task_dict
    assert t["round_1.site-1"].global_task_id == "prepare"
    assert t["round_2.site-2"].global_task_id == "round_1.global_model"
    assert t["round_1.global_model"].global_task_id == "prepare"
    assert t["round_2.global_model"].global_task_id == "round_1.global_model"
    assert t["round_2.global_model"].site_task_ids == {"site-1": "round_2.site-1", "site-2": "round_2.site-2"}
    assert t["publish"].aggregate_task_ids == ["round_1.global_model", "round_2.global_model"]


def test_trigger_form(dag) -> None:
    params = dag.params
    assert {key: params[key] for key in params} == {
        "rounds": 2,
        "min_clients": 2,
        "warm_start": False,
        "hp_lr": 0.1,
        "hp_epochs": 2,
    }
    schema = {key: params.get_param(key).schema for key in params}
    assert schema["rounds"]["maximum"] == 2
    assert schema["min_clients"]["maximum"] == 2
    # A float's field is Airflow's one-line text input (its number field reads 1e-3 as 13; a
    # multi-type param without examples gets a JSON box that turned a typed 0.001 into 001),
    # a number through the REST API. The browser test types into it key by key.
    assert schema["hp_lr"]["type"] == ["string", "number"] and schema["hp_lr"]["examples"] == ["0.1"]
    assert "pattern" not in schema["hp_lr"]  # prepare refuses with a sentence, not a schema dump
    assert schema["hp_epochs"]["type"] == "integer"
    assert schema["warm_start"]["type"] == "boolean"


def test_the_form_states_the_allowed_range(dag) -> None:
    # Airflow 3.3's form moves an out-of-range number to the nearest bound on blur, silently:
    # the field's description is where the user reads the range.
    described = {key: dag.params.get_param(key).description for key in ("rounds", "min_clients")}
    for key, text in described.items():
        schema = dag.params.get_param(key).schema
        assert f"{schema['minimum']} to {schema['maximum']}" in text, (key, text)
        assert "moves other values into this range" in text


def test_ranges_are_written_in_the_hparams_type(tmp_path) -> None:
    from flare_airflow.builder import job_params
    from flare_airflow.core.config import job_from_dict

    (tmp_path / "t.py").write_text("")
    (tmp_path / "m.safetensors").write_bytes(b"")
    spec = {
        "job": "ranges",
        "rounds": 1,
        "min_clients": 1,
        "initial_model": "m.safetensors",
        "trainer": {
            "script": "t.py",
            "hparams": {"lr": 0.01, "local_epochs": 5},
            "hparam_ranges": {"lr": {"min": 0, "max": 1}, "local_epochs": {"min": 1, "max": 50}},
        },
        "sites": {"a": {}},
    }
    params = job_params(job_from_dict(spec, base_dir=str(tmp_path)))
    assert "allowed: 1 <= local_epochs <= 50." in params["hp_local_epochs"].description
    assert "allowed: 0.0 <= lr <= 1.0." in params["hp_lr"].description


def test_the_dag_list_and_docs_say_what_the_dag_runs(dag) -> None:
    assert dag.description == "Federated job unit: 2 rounds of FedAvg over 2 sites, quorum 2"
    assert "over 2 sites (site-1, site-2)" in dag.doc_md


def test_a_dag_built_from_a_job_file_shows_the_file(tmp_path) -> None:
    import pathlib

    repo = pathlib.Path(__file__).resolve().parents[2]
    dag = build_dag(repo / "dags" / "digits.yaml")
    assert "Job file `digits.yaml`:" in dag.doc_md
    assert "```yaml\n" in dag.doc_md and "min_clients: 3" in dag.doc_md
    assert dag.description.startswith("Federated job digits: 5 rounds of FedAvg over 4 sites")


def test_without_site_queues_every_task_keeps_airflow_defaults(dag) -> None:
    # The one-machine deployment: no queue, no executor set by flare-airflow anywhere.
    assert {t.queue for t in dag.tasks} == {"default"}
    assert {t.executor for t in dag.tasks} == {None}


def test_site_queues_send_each_site_to_its_queue_and_keep_the_rest_central(tmp_path) -> None:
    job = make_job(
        tmp_path,
        site_queues=True,
        sites={
            "@default": {"executor": "EdgeExecutor"},
            "site-1": {},
            "site-2": {"queue": "hospital-b.gpu"},
        },
    )
    dag = build_dag(job)
    for r in (1, 2):
        assert dag.task_dict[f"round_{r}.site-1"].queue == "site-1"
        assert dag.task_dict[f"round_{r}.site-2"].queue == "hospital-b.gpu"
        assert dag.task_dict[f"round_{r}.site-1"].executor == "EdgeExecutor"
    central = [t for t in dag.tasks if not isinstance(t, SiteTrainOperator)]
    assert {t.task_id for t in central} == {
        "prepare",
        "publish",
        "verdict",
        "round_1.global_model",
        "round_2.global_model",
    }
    assert {(t.queue, t.executor) for t in central} == {("default", None)}


def test_a_site_queue_alone_moves_only_that_site(tmp_path) -> None:
    dag = build_dag(make_job(tmp_path, sites={"site-1": {"queue": "edge-a"}, "site-2": {}}))
    assert dag.task_dict["round_1.site-1"].queue == "edge-a"
    assert dag.task_dict["round_1.site-2"].queue == "default"


K8S_SITE = {"launcher": "k8s", "launcher_spec": {"k8s": {"image": "registry.example/t:1", "namespace": "fl"}}}
SLURM_SITE = {"launcher": "slurm", "retries": 2}


def test_watch_sensor_makes_each_round_of_a_site_launch_then_watch(tmp_path) -> None:
    from flare_airflow.operators.site_job import SiteJobLaunchOperator
    from flare_airflow.sensors.site_job import SiteJobSensor

    job = make_job(
        tmp_path,
        sites={"site-1": {**K8S_SITE, "watch": "sensor"}, "site-2": {**SLURM_SITE, "watch": "sensor"}, "site-3": {}},
    )
    t = build_dag(job).task_dict
    launch, watch = t["round_1.site-1_launch"], t["round_1.site-1"]
    assert isinstance(launch, SiteJobLaunchOperator) and isinstance(watch, SiteJobSensor)
    assert isinstance(t["round_1.site-3"], SiteTrainOperator) and "round_1.site-3_launch" not in t
    assert t["prepare"].downstream_task_ids == {"round_1.site-1_launch", "round_1.site-2_launch", "round_1.site-3"}
    assert launch.downstream_task_ids == {"round_1.site-1"}
    assert watch.downstream_task_ids == {"round_1.global_model"}
    # The aggregation counts the sensor's summary: the watch task has the site's task id.
    assert t["round_1.global_model"].site_task_ids == {"site-1": "round_1.site-1", "site-2": "round_1.site-2",
                                                       "site-3": "round_1.site-3"}  # fmt: skip
    assert watch.launch_task_id == "round_1.site-1_launch"
    assert launch.global_task_id == "prepare" and t["round_2.site-1_launch"].global_task_id == "round_1.global_model"
    # The site's retries on both: a lost launch launches again, a lost watch re-attaches.
    assert (t["round_1.site-2_launch"].retries, t["round_1.site-2"].retries) == (2, 2)
    assert watch.poke_interval == 2.0 and watch.mode == "poke"


def test_watch_sensor_on_a_process_site_is_refused_saying_why(tmp_path) -> None:
    from flare_airflow.core.errors import ConfigError

    with pytest.raises(ConfigError, match="process site's job ends with its task"):
        make_job(tmp_path, sites={"site-1": {"watch": "sensor"}}, min_clients=1)


def test_a_sensor_needs_exactly_one_source_of_the_identity(tmp_path) -> None:
    from flare_airflow.core.errors import ConfigError
    from flare_airflow.sensors.site_job import SiteJobSensor

    job = make_job(tmp_path, sites={"site-1": K8S_SITE}, min_clients=1)
    with pytest.raises(ConfigError, match="either launch_task_id or identity"):
        SiteJobSensor(task_id="w", job=job, site="site-1", round_num=1)
    with pytest.raises(ConfigError, match="is not a site of job"):
        SiteJobSensor(task_id="w", job=job, site="site-9", round_num=1, launch_task_id="l")


def test_resume_clears_a_sensor_watched_site_with_its_launch(tmp_path) -> None:
    """flare-airflow resume clears site tasks: for watch: sensor, the launch too, or the cleared
    sensor would only watch the same finished job again."""
    from flare_airflow.cli.resume import JobTasks

    job = make_job(tmp_path, sites={"site-1": {**K8S_SITE, "watch": "sensor"}, "site-2": {}})
    tasks = JobTasks.of(build_dag(job))
    assert tasks.rounds[0] == ("round_1.global_model", ["round_1.site-1", "round_1.site-2"])
    assert tasks.launches == {"round_1.site-1": "round_1.site-1_launch", "round_2.site-1": "round_2.site-1_launch"}
    assert tasks.with_launches(["round_2.site-1", "round_2.site-2"]) == [
        "round_2.site-1_launch",
        "round_2.site-1",
        "round_2.site-2",
    ]


def _parsing_for(monkeypatch, dag_id: str, task_id: str) -> None:
    """What Airflow's task runner sets while it parses the DAG file to run ``task_id``."""
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_DAG_ID", dag_id)
    monkeypatch.setenv("_AIRFLOW_PARSING_CONTEXT_TASK_ID", task_id)


def test_a_site_tasks_process_builds_that_site_and_the_runs_own_tasks_only(tmp_path, monkeypatch) -> None:
    job = make_job(tmp_path, sites={"site-1": {}, "site-2": {}, "site-3": {}})
    _parsing_for(monkeypatch, "flare_unit", "round_2.site-2")
    t = build_dag(job).task_dict
    assert sorted(t) == ["prepare", "publish", "round_1.global_model", "round_1.site-2", "round_2.global_model",
                         "round_2.site-2", "verdict"]  # fmt: skip
    assert t["round_2.site-2"].downstream_task_ids == {"round_2.global_model"}
    assert t["round_2.site-2"].global_task_id == "round_1.global_model"
    # Another DAG's task, or one of this run's own tasks: the whole DAG.
    for dag_id, task_id in (("another_dag", "round_2.site-2"), ("flare_unit", "round_2.global_model")):
        _parsing_for(monkeypatch, dag_id, task_id)
        assert len(build_dag(job).task_dict) == 2 * 3 + 2 + 3  # + prepare, publish, verdict


def test_a_site_tasks_process_finds_its_site_in_a_task_group_and_behind_a_launch_task(tmp_path, monkeypatch) -> None:
    from airflow.sdk import DAG

    from flare_airflow.builder import federated_task_group

    job = make_job(
        tmp_path, sites={"site-1": {**K8S_SITE, "watch": "sensor"}, "site-2": {**K8S_SITE, "watch": "sensor"}}
    )
    _parsing_for(monkeypatch, "mine", "fl.round_1.site-2_launch")
    with DAG(dag_id="mine", schedule=None) as dag:
        federated_task_group(job, group_id="fl")
    assert sorted(t for t in dag.task_dict if ".round_" in t) == [
        "fl.round_1.global_model", "fl.round_1.site-2", "fl.round_1.site-2_launch",
        "fl.round_2.global_model", "fl.round_2.site-2", "fl.round_2.site-2_launch",
    ]  # fmt: skip


def test_the_builder_leaves_the_garbage_collector_as_it_found_it(tmp_path) -> None:
    import gc

    job = make_job(tmp_path)
    build_dag(job)
    assert gc.isenabled()
    gc.disable()
    try:
        build_dag(job)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_form_lives_on_the_dag_and_every_task_sees_it_at_run_time(dag) -> None:
    # Tasks carry no copy of the form: Airflow would serialise (and schema-check) it once per task.
    from airflow.sdk.definitions.param import process_params
    from airflow.serialization.serialized_objects import DagSerialization

    serialized = DagSerialization.to_dict(dag)["dag"]
    assert [key for key, _ in serialized["params"]] == ["rounds", "min_clients", "warm_start", "hp_lr", "hp_epochs"]
    assert all("params" not in task["__var"] for task in serialized["tasks"])
    for task_id in ("prepare", "round_1.site-1", "round_2.global_model", "publish"):
        task = dag.task_dict[task_id]
        assert not task.params
        seen = process_params(dag, task, {"rounds": 1, "hp_lr": 0.5}, suppress_exception=False)
        assert seen == {"rounds": 1, "min_clients": 2, "warm_start": False, "hp_lr": 0.5, "hp_epochs": 2}


def test_params_given_to_build_dag_join_the_form(tmp_path) -> None:
    job = make_job(tmp_path, sites={"site-1": {}, "site-2": {}})
    dag = build_dag(job, params={"note": "x"}, default_args={"params": {"owner_note": "y"}, "owner": "fl"})
    assert {key: dag.params[key] for key in ("note", "owner_note", "rounds")} == {
        "note": "x",
        "owner_note": "y",
        "rounds": 2,
    }
    assert dag.default_args == {"owner": "fl"}
    assert dag.task_dict["round_1.site-1"].owner == "fl"


def test_every_task_records_a_failure_reason_and_the_authors_callbacks_stay(tmp_path) -> None:
    """A failure before ``execute`` (Airflow's own checks) still leaves a reason: every task the builder
    makes has :func:`record_failure` once, after the callbacks of the DAG's ``default_args``."""
    from flare_airflow.operators.common import record_failure

    def page_someone(context) -> None: ...

    job = make_job(tmp_path, sites={"site-1": {**K8S_SITE, "watch": "sensor"}, "site-2": {}})
    dag = build_dag(job, default_args={"on_failure_callback": page_someone})
    callbacks = {t.task_id: t.on_failure_callback for t in dag.tasks}
    assert callbacks == {task_id: [page_someone, record_failure] for task_id in dag.task_dict}


def test_the_verdict_is_a_teardown_that_decides_the_runs_state(dag) -> None:
    """Issue 28 #7: Airflow counts a skipped leaf as success; the verdict is the only effective
    leaf, not skipped by 'Mark run as failed', and fails the run when publish did not publish."""
    verdict = dag.task_dict["verdict"]
    assert isinstance(verdict, RunVerdictOperator)
    assert verdict.is_teardown and verdict.on_failure_fail_dagrun
    assert verdict.upstream_task_ids == {"publish"}
    assert [t.task_id for t in dag.leaves] == ["verdict"]
    assert verdict.aggregate_task_ids == ["round_1.global_model", "round_2.global_model"]
