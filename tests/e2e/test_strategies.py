"""Robust aggregation through a real ``flare-airflow run``: 5 IID digits sites, one of them a real
trainer that sends its update sign-flipped and scaled x10 every round.

One DAG holds four jobs (a TaskGroup each, one ``airflow dags test``, one round to keep it short):
FedAvg collapses; the coordinate-wise median, the trimmed mean (beta = 0.2) and Krum (f = 1) keep
the published global model at >= 0.90 accuracy on the held-out digits. Every task instance must
succeed, each aggregation names its strategy, and Krum combines one site, never the attacker.
"""

from __future__ import annotations

import json
import pathlib
import re
import runpy
import textwrap

import pytest
import yaml
from safetensors.numpy import load_file

from flare_airflow.builder import AGGREGATE_TASK
from flare_airflow_testing.harness import REPO, TRAINERS, AirflowHome

pytestmark = pytest.mark.e2e

SITES = [f"site-{i}" for i in range(1, 6)]
ATTACKER = "site-5"
ROUNDS = 1
AGGREGATORS = {
    "fedavg": {"name": "fedavg"},
    "median": {"name": "median"},
    "trimmed": {"name": "trimmed_mean", "beta": 0.2},
    "krum": {"name": "krum", "f": 1},
}


def write_jobs(home: AirflowHome) -> pathlib.Path:
    folder = home.dags / "robust"
    folder.mkdir()
    for key, aggregator in AGGREGATORS.items():
        job = {
            "job": f"robust-{key}",
            "rounds": ROUNDS,
            "min_clients": 5,
            "initial_model": str(REPO / "examples" / "digits" / "initial_model.safetensors"),
            "trainer": {
                "script": str(TRAINERS / "digits_attacker.py"),
                # Dirichlet alpha 1000: an IID split; seeded, so the run is the same every time.
                "args": [ATTACKER, "--num-sites", "5", "--alpha", "1000", "--seed", "0"],
                "hparams": {"lr": 0.5, "local_epochs": 40, "batch_size": 16},
                "shutdown_timeout": 2,
            },
            "aggregator": aggregator,
            "evaluate": False,  # the test evaluates the published model itself
            "sites": {"@default": {"retries": 0}, **{s: {} for s in SITES}},
        }
        (folder / f"{key}.yaml").write_text(yaml.safe_dump(job))
    dag_file = folder / "dag.py"
    dag_file.write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            from airflow.sdk import DAG
            from flare_airflow.builder import federated_task_group
            with DAG("flare_robust", schedule=None, catchup=False) as dag:
                for key in {list(AGGREGATORS)!r}:
                    federated_task_group(Path(__file__).with_name(f"{{key}}.yaml"), group_id=key)
            """
        )
    )
    return dag_file


def test_robust_rules_survive_a_sign_flipping_site_where_fedavg_collapses(airflow_home: AirflowHome) -> None:
    result = airflow_home.run("flare_robust", write_jobs(airflow_home))
    tasks = result.tasks
    expected = {
        f"{key}.{task}"
        for key in AGGREGATORS
        for task in (
            "prepare",
            "publish",
            "verdict",
            *(f"round_{r}.{t}" for r in range(1, ROUNDS + 1) for t in (*SITES, AGGREGATE_TASK)),
        )
    }
    assert tasks == dict.fromkeys(expected, "success"), result.log[-5000:]

    trainer = runpy.run_path(str(REPO / "examples" / "digits" / "trainer.py"))
    _, x_test, _, y_test = trainer["load_split"](0)
    accuracy = {}
    for key, aggregator in AGGREGATORS.items():
        (final,) = airflow_home.store.glob(f"robust-{key}/*/final")
        report = json.loads((final / "metrics.json").read_text())
        assert [row["round"] for row in report["rounds"]] == list(range(1, ROUNDS + 1))
        assert all(row["sites_valid"] == 5 for row in report["rounds"]), report["rounds"]
        model = load_file(str(final / "model.safetensors"))
        accuracy[key] = trainer["loss_and_accuracy"](model["weight"], model["bias"], x_test, y_test)[1]
        counted = [line for line in result.log.splitlines() if f"sites counted {SITES} by {aggregator['name']}" in line]
        assert len(counted) == ROUNDS, (key, counted)
    assert accuracy["fedavg"] <= 0.2, accuracy  # the x10 sign flip wins the average: worse than chance
    for key in ("median", "trimmed", "krum"):
        assert accuracy[key] >= 0.90, accuracy
    # Krum combined one honest site each round: the attacker's update was never chosen.
    kept = re.findall(r"by krum \(combined \[([^]]*)\]\)", result.log)
    assert len(kept) == ROUNDS and all(k.count("site-") == 1 and ATTACKER not in k for k in kept), kept
