"""Native mode's pieces that need no FLARE: the submit token, the bridge's answers and errors, the
result reader. Against a real FLARE deployment: tests/e2e/test_nvflare_native.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from flare_airflow.nvflare_native.admin import PREFIX, FlareAdmin, last_answer, parse_answers
from flare_airflow.nvflare_native.errors import (
    FlareAdminError,
    FlareConnectionError,
    FlareCredentialError,
    FlareJobError,
    FlareNotReadyError,
    FlareResultError,
)
from flare_airflow.nvflare_native.result import read_global_model, submit_token


def test_the_submit_token_is_one_per_task_of_a_run_and_fits_flares_rules() -> None:
    token = submit_token("dag with spaces/and:more", "manual__2026-12-02T02:43:13.061360+00:00", "publish")
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", token + ".20")  # NVFlare's SUBMIT_TOKEN_PATTERN, generation added
    assert token == submit_token("dag with spaces/and:more", "manual__2026-12-02T02:43:13.061360+00:00", "publish")
    others = {
        submit_token("dag", "run", "publish"),
        submit_token("dag", "run2", "publish"),
        submit_token("dag", "run", "other"),
        submit_token("dag", "run", "publish", 0),
        submit_token("dag", "run", "publish", 1),
    }
    assert len(others) == 5


def test_answers_are_the_prefixed_lines_and_errors_are_typed() -> None:
    out = "Connecting to FLARE ...\n" + PREFIX + json.dumps({"status": "RUNNING"}) + "\nnoise\n"
    assert parse_answers(out) == [{"status": "RUNNING"}]
    assert last_answer(parse_answers(out), "status", 0, "") == {"status": "RUNNING"}
    for kind, error in [
        ("credential", FlareCredentialError),
        ("connection", FlareConnectionError),
        ("not_ready", FlareNotReadyError),
        ("conflict", FlareJobError),
        ("internal", FlareAdminError),
    ]:
        with pytest.raises(error, match="what went wrong"):
            last_answer([{"error": {"kind": kind, "message": "what went wrong"}}], "submit", 3, "")
    with pytest.raises(FlareAdminError, match=r"exited 1 without an answer: Traceback"):
        last_answer([], "watch", 1, "Traceback (most recent call last): ...")


def test_the_bridge_runs_without_nvflare_or_flare_airflow_and_says_what_is_wrong(tmp_path) -> None:
    """It runs from the installed package's file, with only the standard library importable."""
    admin = FlareAdmin(python=sys.executable, startup_kit=str(tmp_path / "no-kit"))
    proc = subprocess.run(
        admin.argv("status"),  # exactly [python, bridge.py, command]
        input="not json",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1"},
        check=False,
    )
    assert proc.returncode == 3
    assert parse_answers(proc.stdout) == [
        {
            "error": {
                "kind": "request",
                "message": "the request on stdin is not JSON: Expecting value: line 1 column 1 (char 0)",
            }
        }
    ]
    # An interpreter without nvflare (here the project's): the connection's python is wrong.
    with pytest.raises(FlareCredentialError, match=r"has no nvflare .*set the Airflow connection's extra 'python'"):
        admin.status("job")


def test_a_missing_interpreter_is_a_credential_error() -> None:
    with pytest.raises(FlareCredentialError, match="does not exist: set the Airflow connection's extra 'python'"):
        FlareAdmin(python="/nonexistent/python", startup_kit="/kit").status("job")


def test_the_global_model_is_read_without_pickle(tmp_path) -> None:
    models = tmp_path / "workspace" / "models"
    models.mkdir(parents=True)
    array = np.arange(9, dtype=np.float32).reshape(3, 3)
    np.save(models / "server.npy", array)
    got = read_global_model(tmp_path)
    assert list(got) == ["numpy_key"] and got["numpy_key"].dtype == np.float32
    np.testing.assert_array_equal(got["numpy_key"], array)

    np.save(models / "server.npy", np.array([{"w": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(FlareResultError, match="never unpickles"):
        read_global_model(tmp_path)
    np.save(models / "server.npy", np.array([1.0, np.nan], dtype=np.float32))
    with pytest.raises(FlareResultError, match="NaN or infinite"):
        read_global_model(tmp_path)

    save_file({"w": array}, str(models / "final.safetensors"))
    np.testing.assert_array_equal(read_global_model(tmp_path, "models/final.safetensors")["w"], array)
    (models / "FL_global_model.pt").write_bytes(b"\x80\x04pickle")
    with pytest.raises(FlareResultError, match=r"\.pt file .* is refused -- save it as safetensors"):
        read_global_model(tmp_path, "models/FL_global_model.pt")
    with pytest.raises(FlareResultError, match=r"has no models/missing\.npy"):
        read_global_model(tmp_path, "models/missing.npy")
