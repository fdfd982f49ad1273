"""The site's privacy plan in the site runner: the trainer cannot skip it, and a retry republishes the same release."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from flare_airflow.core.failure_record import read_failure
from flare_airflow.core.model import read_artifact
from flare_airflow.core.privacy.filters import l2_norm
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import record_path
from flare_airflow.launchers.process import ProcessLauncher
from flare_airflow.site_task.runner import run_site
from flare_airflow.site_task.spec import NOISE_SECRET_ENV, SPEC_ENV, SUMMARY_PREFIX, SiteRun

PY = sys.executable
SECRET = "38e373fdf7f4143431349998d5e3be233724268a2a39bae2f73f65c78b55f0b8"

# A trainer that does not use send(): it writes its update (tensors + record) straight to FLARE_OUTPUT,
# a large step away from the global model, with a metric meant to stay home when asked to.
BYPASS = """
import os, sys

import numpy as np

from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.store import path_from_uri

glob, _ = read_artifact(path_from_uri(os.environ["FLARE_GLOBAL_MODEL"]))
print("noise secret visible:", "FLARE_SITE_NOISE_SECRET" in os.environ, flush=True)
# "frozen_b": b left as received (a strategy that trains only w, as FFA-LoRA trains only B).
b = glob["b"] if sys.argv[1] == "frozen_b" else glob["b"] - np.float32(4.0)
params = {"w": glob["w"] + np.float32(3.0), "b": b}
metrics = {"loss": 0.5, **({"patient_count": 17.0} if sys.argv[1] == "leak" else {})}
model = FLModel(params=params, metrics=metrics, meta={"num_samples": 8})
write_artifact(path_from_uri(os.environ["FLARE_OUTPUT"]), model)
"""

PLAN = {
    "filters": [{"type": "gaussian", "clip": 1.0, "noise_multiplier": 0.5}],
    "public_metrics": ["loss"],
    "delta": 1e-5,
}


@pytest.fixture
def bypass(write_script) -> pathlib.Path:
    return write_script("bypass.py", BYPASS)


def site_run(
    trainer: pathlib.Path, global_model: pathlib.Path, try_number: int, mode: str = "ok", lora: dict | None = None
) -> SiteRun:
    round_dir = global_model.parent.parent / "round-0001"
    return SiteRun(
        job="demo",
        run_id="manual__2024-01-01T00:00:00+00:00",
        round=1,
        total_rounds=1,
        site="site-1",
        task="train",
        argv=[PY, str(trainer), mode],
        global_model=str(global_model),
        output=str(round_dir / "sites" / "site-1.safetensors"),
        staging=str(round_dir / "staging" / "site-1" / f"try-{try_number}" / "update.safetensors"),
        privacy=PLAN,
        lora=lora,
    )


def test_a_trainer_writing_its_update_directly_is_filtered_and_a_retry_publishes_the_same_bytes(
    bypass, global_model, lines
) -> None:
    published = []
    for try_number in (1, 2):
        run = site_run(bypass, global_model, try_number)
        rc, summary = run_site(run, ProcessLauncher(sink=lines), handle_signals=False, noise_secret=SECRET)
        assert rc is JobReturnCode.SUCCESS, summary
        assert isinstance(summary, dict)
        out = pathlib.Path(run.output)
        published.append((out.read_bytes(), summary["sha256"], hashlib.sha256(out.read_bytes()).hexdigest()))
        params, record = read_artifact(out)
        glob, _ = read_artifact(global_model)
        diff = {k: params[k].astype(np.float64) - glob[k] for k in params}
        # clipped to 1 (the raw step has norm ~9.6), then noise of sd 0.5 per element: far from the raw step
        assert not np.allclose(diff["w"], 3.0, atol=1.0)
        assert summary["privacy"]["epsilon"] == pytest.approx(PLAN_EPSILON, abs=1e-3)
        assert record.meta["privacy"]["filters"][0]["norm"] == pytest.approx(
            l2_norm({"w": np.full(6, 3.0), "b": np.full(3, -4.0)})
        )
        assert record.metrics == {"loss": 0.5} and record.num_samples == 8
    assert published[0] == published[1]
    assert published[0][1] == published[0][2]


PLAN_EPSILON = 9.997  # z = 0.5 (μ = 2), one round, δ = 1e-5


def test_metrics_meant_to_stay_home_are_refused_and_nothing_is_published(bypass, global_model, lines) -> None:
    run = site_run(bypass, global_model, 1, "leak")
    rc, reason = run_site(run, ProcessLauncher(sink=lines), handle_signals=False, noise_secret=SECRET)
    assert rc is JobReturnCode.EXECUTION_ERROR
    assert "'patient_count' are not declared public" in str(reason)
    out = pathlib.Path(run.output)
    assert not out.exists() and not record_path(out).exists()
    assert "patient_count" in (read_failure(out) or "")


def test_without_its_noise_secret_the_site_publishes_nothing(bypass, global_model, lines) -> None:
    run = site_run(bypass, global_model, 1)
    rc, reason = run_site(run, ProcessLauncher(sink=lines), handle_signals=False)
    assert rc is JobReturnCode.EXECUTION_ERROR
    assert "noise secret (Airflow variable 'flare_noise_secret')" in str(reason)
    assert not pathlib.Path(run.output).exists()


def test_the_runner_command_keeps_the_noise_secret_from_the_trainer(bypass, global_model) -> None:
    run = site_run(bypass, global_model, 1)
    env = {**os.environ, SPEC_ENV: run.to_json(), NOISE_SECRET_ENV: SECRET}
    proc = subprocess.run(
        [PY, "-m", "flare_airflow.site_task"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "noise secret visible: False" in proc.stdout
    assert SECRET not in proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix(SUMMARY_PREFIX))
    assert summary["privacy"]["noise_multiplier"] == 0.5


@pytest.mark.parametrize("mode", ["frozen_b", "ok"])
def test_the_strategys_frozen_tensors_skip_the_noise_and_must_not_move(bypass, global_model, lines, mode) -> None:
    base = global_model.parent / "base.gguf"
    base.write_bytes(b"base model")
    lora = {
        "base_model": str(base),
        "base_model_sha256": hashlib.sha256(base.read_bytes()).hexdigest(),
        "target_modules": ["q_proj"],
        "rank": 2,
        "alpha": 4.0,
        "seq_len": 16,
        "steps_per_round": 1,
        "frozen": ["b"],
    }
    run = site_run(bypass, global_model, 1, mode, lora=lora)
    rc, summary = run_site(run, ProcessLauncher(sink=lines), handle_signals=False, noise_secret=SECRET)
    out = pathlib.Path(run.output)
    if mode == "ok":  # the trainer moved the frozen b: refused at the site, nothing published
        assert rc is JobReturnCode.EXECUTION_ERROR
        assert "tensor 'b' differs from the global model's, but the job's strategy keeps it frozen" in str(summary)
        assert not out.exists()
        return
    assert rc is JobReturnCode.SUCCESS, summary
    params, _ = read_artifact(out)
    glob, _ = read_artifact(global_model)
    assert params["b"].tobytes() == glob["b"].tobytes()  # unnoised: the global model's own values
    assert not np.allclose(params["w"] - glob["w"], 3.0, atol=1.0)  # w clipped and noised
