"""The federated result is trustworthy (issue 9): through real Airflow, only the updates that the
site tasks accepted count, an aggregate that is not finite is never published, and an audit of the
whole store (every run of this session's Airflow home so far) finds no published global model
that is non-finite or built from a failed site's update."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from safetensors.numpy import save_file

from flare_airflow.core.model import all_finite, read_artifact, read_record
from flare_airflow.core.trust import CENTRAL, generate_keys
from flare_airflow.core.trust.keys import party_dir
from flare_airflow_testing.harness import AirflowHome, RunResult, behave_job

pytestmark = pytest.mark.e2e


def audit_store(store: pathlib.Path, runs: dict[str, RunResult]) -> int:
    """Every global model in the store is finite and verifies; for the runs given (run dir ->
    result), each round's global model names only sites whose task succeeded. Returns the count."""
    checked = 0
    for glob in sorted(store.glob("*/*/round-*/global.safetensors")):
        params, record = read_artifact(glob)  # size and sha256 against the record
        assert all_finite(params) is None, f"{glob} holds NaN/inf"
        run_dir, round_dir = glob.parent.parent, glob.parent
        result = runs.get(str(run_dir))
        r = int(round_dir.name.removeprefix("round-"))
        if result is not None and r > 0:
            counted = record.meta["sites"]
            for site in counted:
                assert result.tasks[f"round_{r}.{site}"] == "success", (
                    f"{glob} counted {site}, whose task did not succeed"
                )
        checked += 1
    for final in store.glob("*/*/final/model.safetensors"):
        params, _ = read_artifact(final)
        assert all_finite(params) is None, f"{final} holds NaN/inf"
    return checked


def _run_dir(home: AirflowHome, job: str) -> pathlib.Path:
    (run_dir,) = [p for p in (home.store / job).iterdir() if p.is_dir()]
    return run_dir


def strict_registry(root: pathlib.Path, enrolled: list[str], not_enrolled: list[str]) -> dict[str, str]:
    """Keys for every party under ``root`` (as each would make them with keygen) and a registry that
    lists ``enrolled`` and the central key only; the environment of a strict-mode run."""
    keys = root / "keys"
    jwks = [generate_keys(p, party_dir(keys, p)).jwks for p in (*enrolled, *not_enrolled, CENTRAL)]
    listed = [k for j in jwks for k in j["keys"] if k["flare_party"] not in not_enrolled]
    (root / "registry.json").write_text(json.dumps({"keys": listed}))
    return {"FLARE_KEY_DIR": str(keys), "FLARE_SITE_KEYS": str(root / "registry.json")}


def test_only_updates_the_site_tasks_accepted_are_counted(airflow_home: AirflowHome, tmp_path: pathlib.Path) -> None:
    args = [
        "--send-then-fail", "site-2",  # sends, then exits 5
        "--send-twice", "site-3",  # the second send() raises
        "--nan-metric", "site-4",  # send() refuses a NaN metric
        "--clobber-output-late", "site-5",  # a leftover child rewrites its output after the job
    ]  # fmt: skip
    job = behave_job(airflow_home.root, "accepted-only", sites=6, rounds=2, min_clients=1, args=args)
    # Strict mode (issue 36): every record signed and verified against the registry through real
    # Airflow; site-6 trains and signs with a key the registry does not list (revoked).
    env = strict_registry(tmp_path, [f"site-{i}" for i in range(1, 6)], ["site-6"])
    result = airflow_home.run("flare_accepted_only", airflow_home.write_job("accepted_only", job), env=env)
    tasks = result.tasks
    assert result.state["state"] == "success", result.log[-4000:]
    for r in (1, 2):
        assert tasks[f"round_{r}.site-1"] == "success" and tasks[f"round_{r}.site-5"] == "success"
        assert {tasks[f"round_{r}.site-{i}"] for i in (2, 3, 4)} == {"failed"}
        assert tasks[f"round_{r}.site-6"] == "success"  # its task succeeded; the aggregation refused its record
        assert tasks[f"round_{r}.global_model"] == "success"
    report = result.metrics()
    assert [row["sites_valid"] for row in report["rounds"]] == [2, 2]
    for row in report["rounds"]:
        assert "never enrolled, or revoked" in row["rejected"]["site-6"], row["rejected"]
    rejected = report["rounds"][0]["rejected"]
    assert "exit code 5" in rejected["site-2"]
    assert "exit code" in rejected["site-3"] and "exit code" in rejected["site-4"]
    assert "send() called twice" in result.log
    assert "metrics must be finite numbers" in result.log
    run_dir = _run_dir(airflow_home, "accepted-only")
    for r in (1, 2):
        meta = read_record(run_dir / f"round-{r:04d}" / "global.safetensors").meta
        assert meta["sites"] == ["site-1", "site-5"], meta
        published = sorted(p.name for p in (run_dir / f"round-{r:04d}" / "sites").glob("*.safetensors"))
        assert published == ["site-1.safetensors", "site-5.safetensors", "site-6.safetensors"], (
            "failed sites never publish an update"
        )
    # site-1 and site-5 each sent global + 1: the model grows by exactly 1 a round
    final = read_artifact(pathlib.Path(report["final_model"].removeprefix("file://")))[0]
    np.testing.assert_array_equal(final["w"], np.full(4, 2.0, np.float32))
    assert audit_store(airflow_home.store, {str(run_dir): result}) >= 3


def test_an_aggregate_that_overflows_is_never_published(airflow_home: AirflowHome) -> None:
    job = behave_job(airflow_home.root, "overflow", sites=2, rounds=2, min_clients=1, args=["--diff-all", "60000"])
    init = airflow_home.root / "overflow-f16.safetensors"
    save_file({"w": np.full(4, 60000, np.float16), "b": np.zeros(2, np.float16)}, str(init))
    job["initial_model"] = str(init)
    job["evaluate"] = False
    result = airflow_home.run("flare_overflow", airflow_home.write_job("overflow", job))
    tasks = result.tasks
    assert result.returncode != 0 and result.state["state"] == "failed"
    assert tasks["round_1.site-1"] == "success" and tasks["round_1.site-2"] == "success"
    assert tasks["round_1.global_model"] == "failed"
    assert tasks["publish"] == "upstream_failed"
    assert "tensor 'w': its mean is not finite in float16 (overflow)" in result.log
    run_dir = _run_dir(airflow_home, "overflow")
    assert not (run_dir / "round-0001" / "global.safetensors").exists()
    assert not (run_dir / "final").exists()
    assert not (airflow_home.store / "overflow" / "latest.json").exists()
    audit_store(airflow_home.store, {})


def test_one_hostile_trainer_cannot_take_the_round_down(airflow_home: AirflowHome) -> None:
    """Issue 28: confined process trainers (the default) that try to escape fail, each with its
    reason, and the other sites of the round -- which read the same global model -- still count."""
    args = ["--escape", "site-2:outside", "--escape", "site-3:global", "--escape", "site-4:store",
            "--escape", "site-5:net"]  # fmt: skip
    job = behave_job(airflow_home.root, "hostile", sites=5, rounds=1, min_clients=1, args=args)
    policy = {"sites": {f"site-{i}": {"confinement": {"mode": "required"}} for i in range(1, 5)}}
    policy["sites"]["site-5"] = {"confinement": {"mode": "required", "network": False}}
    dag_file = airflow_home.write_job("hostile", job)
    result = airflow_home.run("flare_hostile", dag_file, site_policy=policy)
    assert result.state["state"] == "success", result.log[-4000:]
    tasks = result.tasks
    assert tasks["round_1.site-1"] == "success"
    assert {tasks[f"round_1.site-{i}"] for i in (2, 3, 4, 5)} == {"failed"}, tasks
    assert tasks["round_1.global_model"] == "success" and tasks["publish"] == "success", tasks
    rejected = result.metrics()["rounds"][0]["rejected"]
    assert "the trainer is confined: it may write only" in rejected["site-2"], rejected
    assert "its input global model is read-only" in rejected["site-3"], rejected
    assert "the trainer is confined: it may write only" in rejected["site-4"], rejected
    assert "confined without network" in rejected["site-5"], rejected
    run_dir = _run_dir(airflow_home, "hostile")
    read_artifact(run_dir / "round-0000" / "global.safetensors")  # intact: size and sha256 against its record
    assert read_record(run_dir / "round-0001" / "global.safetensors").meta["sites"] == ["site-1"]
    assert not (airflow_home.store / "pwned-store-root").exists()
    assert not list(dag_file.parent.glob("pwned-*")) and not list(airflow_home.root.glob("pwned-*"))
    final = read_artifact(pathlib.Path(result.metrics()["final_model"].removeprefix("file://")))[0]
    np.testing.assert_array_equal(final["w"], np.full(4, 1.0, np.float32))
