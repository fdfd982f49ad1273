"""The demo job (dags/digits.yaml) through real Airflow: every task succeeds, the bar is met,
and two runs give bitwise-identical models."""

from __future__ import annotations

import hashlib
import json
import pathlib
import secrets

import pytest
import yaml
from safetensors.numpy import load_file

from flare_airflow_testing.harness import REPO, AirflowHome

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def demo_dag(airflow_home: AirflowHome) -> pathlib.Path:
    return airflow_home.copy_repo_dags("demo") / "digits_dag.py"


def test_demo_runs_every_task_and_reaches_the_accuracy_bar(airflow_home: AirflowHome, demo_dag: pathlib.Path) -> None:
    first = airflow_home.run("flare_digits", demo_dag)
    assert first.returncode == 0, first.log[-5000:]
    assert first.state["state"] == "success"
    expected = {"prepare", "publish", "verdict"} | {
        f"round_{r}.{t}" for r in range(1, 6) for t in ("site-1", "site-2", "site-3", "site-4", "global_model")
    }
    assert first.tasks == dict.fromkeys(expected, "success")

    report = first.metrics()
    assert [row["round"] for row in report["rounds"]] == [1, 2, 3, 4, 5]
    assert all(row["sites_valid"] == 4 for row in report["rounds"])
    accuracy = report["rounds"][-1]["evaluation"]["accuracy"]
    assert accuracy >= 0.90, report["rounds"]
    losses = [row["train_loss"] for row in report["rounds"]]
    assert losses == sorted(losses, reverse=True), "mean training loss should fall round after round"

    published = first.state["published"]
    model = pathlib.Path(published["final_model"].removeprefix("file://"))
    params = load_file(str(model))
    assert set(params) == {"weight", "bias"} and params["weight"].shape == (64, 10)
    assert hashlib.sha256(model.read_bytes()).hexdigest() == published["sha256"]
    plot = pathlib.Path(published["plot"].removeprefix("file://")).read_bytes()
    assert plot[:8] == b"\x89PNG\r\n\x1a\n" and len(plot) > 10_000
    # XCom carries references and metrics only: never weights.
    assert len(json.dumps(published)) < 2_000

    second = airflow_home.run("flare_digits", demo_dag)
    assert second.returncode == 0 and second.state["run_id"] != first.state["run_id"]
    assert second.state["published"]["sha256"] == published["sha256"], "same seed must give the same model"
    second_model = pathlib.Path(second.state["published"]["final_model"].removeprefix("file://"))
    assert second_model.read_bytes() == model.read_bytes()


def _privacy_docs_site_policy() -> dict:
    """The site's privacy block of docs/privacy.md, as written there (its first YAML block)."""
    text = (REPO / "docs" / "privacy.md").read_text()
    section = text.split("## The site's privacy block", 1)[1]
    return yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])


def test_the_privacy_docs_site_policy_runs_the_demo(airflow_home: AirflowHome, demo_dag: pathlib.Path) -> None:
    """Issue 37 #3: the docs' example, as a site policy on the demo, failed every update of the
    site (its trainer logs epoch_train_loss with flare.log_metric). One round, as written."""
    block = _privacy_docs_site_policy()["sites"]["site-1"]
    assert block["privacy"]["filters"][-1]["type"] == "gaussian"
    # Every site's admin writes the docs' block (one worker runs the four sites here).
    policy = {"sites": {f"site-{i}": block for i in range(1, 5)}}
    result = airflow_home.run(
        "flare_digits",
        demo_dag,
        conf={"rounds": 1},
        site_policy=policy,
        env={"AIRFLOW_VAR_FLARE_NOISE_SECRET": secrets.token_hex(32)},
    )
    assert result.returncode == 0, result.log[-5000:]
    assert result.state["state"] == "success"
    (row,) = result.metrics()["rounds"]
    assert row["sites_valid"] == 4
    assert set(row["site_metrics"]["site-1"]) == {"train_loss", "train_accuracy"}
