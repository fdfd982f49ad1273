"""The images of docker/ run: the site trainer as a pod would run it, the Airflow image's provider."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from flare_airflow.core.aggregation.update_reader import validate_update
from flare_airflow.core.model import FLModel, read_artifact, tensor_spec, write_artifact
from flare_airflow_testing.containers import engine, openblas_env

ROOT = Path(__file__).resolve().parents[3]
INITIAL_MODEL = ROOT / "examples" / "digits" / "initial_model.safetensors"
TRAINER_ARGS = ["--num-sites", "4", "--alpha", "0.5", "--seed", "0"]


def _global_model(store: Path) -> Path:
    from safetensors.numpy import load_file

    path = store / "digits" / "run-1" / "round_1" / "global" / "model.safetensors"
    path.parent.mkdir(parents=True)
    write_artifact(path, FLModel(params=load_file(str(INITIAL_MODEL))))
    return path


def test_trainer_image_trains_as_non_root_on_a_read_only_root(images: dict[str, str], tmp_path: Path) -> None:
    """The digits trainer in the image: Client API in, a valid update out, UID 1000, read-only /,
    no network, no capabilities; the same update as the trainer run on this machine."""
    store = tmp_path / "store"
    global_model = _global_model(store)
    out_dir = store / "digits" / "run-1" / "round_1" / "site-2"
    out_dir.mkdir(parents=True)
    out_dir.chmod(0o777)  # the trainer is UID 1000; the store belongs to this test's user
    mount = "/flare-store"
    env = {
        "FLARE_JOB": "digits",
        "FLARE_RUN_ID": "run-1",
        "FLARE_SITE": "site-2",
        "FLARE_ROUND": "1",
        "FLARE_TOTAL_ROUNDS": "5",
        "FLARE_TASK": "train",
        "FLARE_HPARAMS": json.dumps({"lr": 0.5, "local_epochs": 2, "batch_size": 16}),
        "FLARE_GLOBAL_MODEL": f"{mount}/{global_model.relative_to(store)}",
        "FLARE_OUTPUT": f"{mount}/{out_dir.relative_to(store)}/update.safetensors",
    }
    name = f"flare-test-trainer-{tmp_path.name}"
    argv = [
        engine(), "run", "--name", name, "--read-only", "--network", "none", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--tmpfs", "/tmp", "--pids-limit", "64",
        "-v", f"{global_model.parent}:{mount}/{global_model.parent.relative_to(store)}:ro",
        "-v", f"{out_dir}:{mount}/{out_dir.relative_to(store)}:rw",
        *[opt for key, value in env.items() for opt in ("-e", f"{key}={value}")],
        *openblas_env(),
        images["trainer"], "python", "/opt/trainer/trainer.py", *TRAINER_ARGS,
    ]  # fmt: skip
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        inspected = subprocess.run(
            [engine(), "inspect", "--format", "{{.HostConfig.ReadonlyRootfs}} {{.Config.User}}", name],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
    finally:
        subprocess.run([engine(), "rm", "-f", name], capture_output=True, check=False)
    assert inspected == ["true", "1000:1000"]
    assert "site site-2 round 1:" in proc.stdout

    update = out_dir / "update.safetensors"
    params, record = read_artifact(update)  # digests verified against the record the image wrote
    assert update.stat().st_uid == 1000
    global_params, _ = read_artifact(global_model)
    validate_update("site-2", tensor_spec(global_params), params)  # names, shapes, dtypes, finite
    assert record.num_samples and record.num_samples > 0
    assert set(record.metrics) == {"train_loss", "train_accuracy"}
    assert record.blake3  # blake3 is in the image, so the record carries both digests
    assert not np.array_equal(params["weight"], global_params["weight"])

    # The same trainer on this machine (the project's venv) computes the same update.
    local_out = tmp_path / "local" / "update.safetensors"
    local_out.parent.mkdir()
    local_env = {**env, "FLARE_GLOBAL_MODEL": str(global_model), "FLARE_OUTPUT": str(local_out)}
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits" / "trainer.py"), *TRAINER_ARGS],
        env={**os.environ, **local_env}, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    local_params, local_record = read_artifact(local_out)
    assert local_record.num_samples == record.num_samples
    for key, value in local_params.items():
        np.testing.assert_allclose(params[key], value, rtol=1e-5, atol=1e-6)


def test_trainer_image_has_no_airflow_and_runs_as_uid_1000(images: dict[str, str]) -> None:
    probe = (
        "import importlib.util as u, os; print(u.find_spec('airflow') is None, u.find_spec('pip') is None, os.getuid())"
    )
    out = subprocess.run(
        [engine(), "run", "--rm", "--network", "none", images["trainer"], "python", "-c", probe],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    assert out == ["True", "True", "1000"]


def test_airflow_image_lists_this_provider(images: dict[str, str]) -> None:
    proc = subprocess.run(
        [engine(), "run", "--rm", "--network", "none", images["airflow"], "providers", "list", "-o", "json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    providers = {p["package_name"]: p["version"] for p in json.loads(proc.stdout)}
    assert providers.get("flare-airflow") == "0.1.0", providers
    assert "apache-airflow-providers-cncf-kubernetes" in providers
    assert "apache-airflow-providers-edge3" in providers
