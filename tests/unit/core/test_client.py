"""The Client API trainers use: receive() / send(), hparams, and running without Airflow installed."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import textwrap

import numpy as np
import pytest

import flare_airflow.client as flare
from flare_airflow.core import client
from flare_airflow.core.errors import ClientAPIError
from flare_airflow.core.model import FLModel, ParamsType, read_artifact

REQUIRED = [name for name in client.ENV_VARS if name != "FLARE_HPARAMS"]


@pytest.fixture
def fresh_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts like a new trainer process: no FLARE_* variables, nothing received."""
    for name in (*client.ENV_VARS, "FLARE_HANDSHAKE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(client, "_session", client._Session())


def flare_env(tmp_path: pathlib.Path, global_model: pathlib.Path, task: str = "train") -> dict[str, str]:
    return {
        "FLARE_JOB": "demo",
        "FLARE_RUN_ID": "manual__2024-01-01T00:00:00+00:00",
        "FLARE_SITE": "site-2",
        "FLARE_ROUND": "3",
        "FLARE_TOTAL_ROUNDS": "5",
        "FLARE_TASK": task,
        "FLARE_GLOBAL_MODEL": str(global_model),
        "FLARE_OUTPUT": str(tmp_path / "out" / "site-2.safetensors"),
        "FLARE_HPARAMS": json.dumps({"lr": 0.1, "epochs": 3, "optimizer": "sgd"}),
    }


@pytest.fixture
def env(tmp_path, global_model, fresh_session, monkeypatch) -> dict[str, str]:
    values = flare_env(tmp_path, global_model)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


def test_short_import_path_is_the_client_api() -> None:
    assert flare.receive is client.receive
    assert flare.send is client.send
    assert flare.FLModel is FLModel
    assert set(client.__all__) <= set(dir(flare))


@pytest.mark.usefixtures("fresh_session")
def test_receive_without_environment_names_the_variable() -> None:
    with pytest.raises(ClientAPIError, match="environment variable FLARE_JOB is not set") as info:
        flare.receive()
    assert "launched by flare-airflow" in str(info.value)


@pytest.mark.parametrize("missing", REQUIRED)
def test_receive_names_each_missing_variable(env, monkeypatch, missing) -> None:
    monkeypatch.delenv(missing)
    with pytest.raises(ClientAPIError, match=f"environment variable {missing} is not set"):
        flare.receive()


def test_receive_returns_the_global_model(env, global_model) -> None:
    model = flare.receive()
    expected, _ = read_artifact(global_model)
    assert set(model.params) == {"w", "b"}
    for name, arr in expected.items():
        np.testing.assert_array_equal(model.params[name], arr)
        assert model.params[name].dtype == arr.dtype
    assert model.params_type is ParamsType.FULL
    assert (model.current_round, model.total_rounds, model.site) == (3, 5, "site-2")
    assert model.meta == {"job": "demo", "run_id": env["FLARE_RUN_ID"], "task": "train"}
    assert model.metrics == {"acc": 0.5}
    assert flare.get_job_info() == {"job": "demo", "run_id": env["FLARE_RUN_ID"], "site": "site-2", "round": 3}
    assert flare.is_train() and not flare.is_evaluate()


def test_receive_signals_the_launcher_handshake(env, tmp_path, monkeypatch) -> None:
    handshake = tmp_path / "handshake"
    monkeypatch.setenv("FLARE_HANDSHAKE", str(handshake))
    assert not handshake.exists()
    flare.receive()
    assert handshake.exists()


def test_receive_with_an_unreadable_global_model(env, global_model) -> None:
    global_model.write_bytes(global_model.read_bytes()[:-1])
    with pytest.raises(ClientAPIError, match=r"cannot read the global model: .*truncated"):
        flare.receive()


def test_send_before_receive(env) -> None:
    with pytest.raises(ClientAPIError, match=r"send\(\) called before receive\(\)"):
        flare.send(FLModel(params={"w": np.ones((2, 3), np.float32)}))
    assert not pathlib.Path(env["FLARE_OUTPUT"]).exists()


def test_send_twice(env) -> None:
    model = flare.receive()
    flare.send(FLModel(params=model.params, meta={"num_samples": 1}))
    with pytest.raises(ClientAPIError, match=r"send\(\) called twice"):
        flare.send(FLModel(params=model.params, meta={"num_samples": 1}))
    # A new receive() opens a new exchange.
    flare.receive()
    flare.send(FLModel(params=model.params, meta={"num_samples": 2}))
    assert read_artifact(pathlib.Path(env["FLARE_OUTPUT"]))[1].num_samples == 2


def test_send_checks_its_argument(env) -> None:
    flare.receive()
    with pytest.raises(ClientAPIError, match="takes an FLModel, got dict"):
        flare.send({"w": np.ones(3)})  # type: ignore[arg-type]
    with pytest.raises(ClientAPIError, match="train task needs params"):
        flare.send(FLModel(metrics={"loss": 1.0}))


def test_evaluate_task_sends_metrics_only(env, monkeypatch) -> None:
    monkeypatch.setenv("FLARE_TASK", "evaluate")
    flare.receive()
    assert flare.is_evaluate()
    flare.send(FLModel(metrics={"accuracy": 0.75}))
    params, record = read_artifact(pathlib.Path(env["FLARE_OUTPUT"]))
    assert params == {}
    assert record.metrics == {"accuracy": 0.75}


def test_get_hparams(env, monkeypatch) -> None:
    assert flare.get_hparams() == {"lr": 0.1, "epochs": 3, "optimizer": "sgd"}
    monkeypatch.delenv("FLARE_HPARAMS")
    assert flare.get_hparams() == {}
    monkeypatch.setenv("FLARE_HPARAMS", "{lr: 0.1}")
    with pytest.raises(ClientAPIError, match="FLARE_HPARAMS is not valid JSON"):
        flare.get_hparams()
    monkeypatch.setenv("FLARE_HPARAMS", "[0.1]")
    with pytest.raises(ClientAPIError, match="FLARE_HPARAMS must be a JSON object"):
        flare.get_hparams()


def test_diff_send_round_trip(env) -> None:
    model = flare.receive()
    diff = {name: np.full_like(arr, 0.25) for name, arr in model.params.items()}
    flare.send(
        FLModel(params=diff, params_type=ParamsType.DIFF, metrics={"train_loss": 0.125}, meta={"num_samples": 64})
    )
    params, record = read_artifact(pathlib.Path(env["FLARE_OUTPUT"]))
    assert record.params_type is ParamsType.DIFF
    assert record.num_samples == 64
    assert record.metrics == {"train_loss": 0.125}
    for name, arr in diff.items():
        np.testing.assert_array_equal(params[name], arr)
        assert params[name].dtype == np.float32


def test_send_rejects_a_bad_model_with_the_site_and_round(env) -> None:
    flare.receive()
    with pytest.raises(Exception, match="update from site site-2 round 3: meta\\['num_samples'\\]"):
        flare.send(FLModel(params={"w": np.ones(2)}, meta={"num_samples": 0}))


# ---------------------------------------------------------------- a site image without Airflow

TRAINER = """
import sys

import flare_airflow.client as flare

model = flare.receive()
assert model.site == "site-7", model.site
hp = flare.get_hparams()
new = {name: arr + hp["step"] for name, arr in model.params.items()}
flare.send(flare.FLModel(params=new, metrics={"loss": 0.5}, meta={"num_samples": 9}))
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"airflow", "pydantic", "yaml", "sqlalchemy"})
print("heavy modules:", heavy)
"""


def test_client_api_runs_where_airflow_is_not_installed(bare_venv, package_copy, tmp_path, global_model) -> None:
    base_env = {"PATH": os.environ["PATH"], "PYTHONNOUSERSITE": "1", "HOME": str(tmp_path)}
    for module in ("airflow", "pydantic", "yaml"):
        probe = subprocess.run(
            [str(bare_venv), "-c", f"import {module}"], env=base_env, capture_output=True, text=True, timeout=60
        )
        assert probe.returncode != 0
        assert f"No module named '{module}'" in probe.stderr
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    env = {
        **base_env,
        **flare_env(tmp_path, global_model),
        "FLARE_SITE": "site-7",
        "FLARE_HPARAMS": json.dumps({"step": 2}),
        "PYTHONPATH": str(package_copy),
    }
    result = subprocess.run(
        [str(bare_venv), str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "heavy modules: []" in result.stdout
    params, record = read_artifact(pathlib.Path(env["FLARE_OUTPUT"]))
    np.testing.assert_array_equal(params["w"], np.full((2, 3), 3.0, np.float32))
    np.testing.assert_array_equal(params["b"], np.full(3, 2.0, np.float32))
    assert record.num_samples == 9
    # It really ran the copy, in the bare environment.
    where = subprocess.run(
        [str(bare_venv), "-c", "import flare_airflow, numpy; print(flare_airflow.__file__); print(numpy.__version__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    module_file, numpy_version = where.stdout.split()
    assert module_file.startswith(str(package_copy))
    assert numpy_version == np.__version__


def test_log_metric_travels_in_the_update_record(env) -> None:
    flare.receive()
    flare.log_metric("epoch_loss", 0.9, step=21)
    flare.log_metric("epoch_loss", np.float32(0.5), step=22)
    flare.log_metric("epoch_loss", 0.4, step=22)  # the same name and step again: the last value counts
    flare.log_metric("grad_norm", 3)  # no step: the round (FLARE_ROUND=3)
    flare.send(FLModel(params={"w": np.ones(2, np.float32)}, meta={"num_samples": 4}))
    _, record = read_artifact(pathlib.Path(env["FLARE_OUTPUT"]))
    assert record.meta["tracked_metrics"] == [["epoch_loss", 0.9, 21], ["epoch_loss", 0.4, 22], ["grad_norm", 3.0, 3]]
    assert record.num_samples == 4


@pytest.mark.parametrize(
    ("name", "value", "step", "error"),
    [
        ("loss?", 1.0, None, "metric name 'loss?' is not allowed"),
        ("", 1.0, None, "metric name '' is not allowed"),
        ("loss", float("nan"), None, "must be a finite number"),
        ("loss", "high", None, "must be a finite number"),
        ("loss", 1.0, -1, "step must be an integer in 0..2**53"),
        ("loss", 1.0, 1.5, "step must be an integer in 0..2**53"),
    ],
)
def test_log_metric_refuses_what_a_tracker_cannot_hold(env, name, value, step, error) -> None:
    flare.receive()
    with pytest.raises(ClientAPIError, match=error.replace("?", r"\?").replace("*", r"\*")):
        flare.log_metric(name, value, step=step)


def test_log_metric_points_do_not_leak_into_the_next_round(env) -> None:
    flare.receive()
    flare.log_metric("loss", 1.0)
    flare.receive()  # a new round in the same process starts with no points
    flare.send(FLModel(params={"w": np.ones(2, np.float32)}))
    _, record = read_artifact(pathlib.Path(env["FLARE_OUTPUT"]))
    assert "tracked_metrics" not in record.meta
