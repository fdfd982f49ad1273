"""Resumable uploads through a site's own store connection (s3fs) on moto's S3 server (an emulator:
flare_airflow_testing/s3_server.py): the site keeps its multipart upload's id, a writer killed
midway is resumed by the retry without re-sending what arrived, changed bytes are sent again."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from flare_airflow.core.errors import StoreError
from flare_airflow.core.store_links import bucket_key
from flare_airflow.core.store_resume import STATE_DIR_ENV, resumable_upload
from flare_airflow_testing.s3_server import BUCKET, S3Server

PART = 5 << 20  # S3's smallest part
CONN = "flare_resume_s3"


@pytest.fixture(scope="module")
def s3():
    server = S3Server(enforce_iam=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def conn_env(s3, monkeypatch) -> dict[str, str]:
    env = {f"AIRFLOW_CONN_{CONN.upper()}": s3.connection()}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def slot(tmp_path: pathlib.Path):
    from airflow.sdk import ObjectStoragePath

    return ObjectStoragePath(f"s3://{CONN}@{BUCKET}/resume/{tmp_path.name}/sites/site-1.safetensors")


def get(s3: S3Server, path) -> bytes:
    bucket, key = bucket_key(path)
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


# A site writer that SIGKILLs itself right after its second part arrived (a worker killed midway).
_KILLED_WRITER = """
import os, pathlib, signal, sys
from airflow.sdk import ObjectStoragePath
from flare_airflow.core import store_resume
put, sent = store_resume._upload_part, []
def put_then_die(*args):
    sent.append(put(*args))
    if len(sent) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return sent[-1]
store_resume._upload_part = put_then_die
store_resume.resumable_upload(
    pathlib.Path(sys.argv[1]), ObjectStoragePath(sys.argv[2]), state_dir=pathlib.Path(sys.argv[3]),
    part_size=int(sys.argv[4]), single_put_limit=int(sys.argv[4]),
)
"""


def test_a_writer_killed_midway_is_resumed_by_the_retry_without_resending_what_arrived(s3, conn_env, tmp_path):
    dst, state = slot(tmp_path), tmp_path / "uploads"
    local = tmp_path / "update.bin"
    local.write_bytes(np.random.default_rng(7).bytes(4 * PART + 12345))  # 5 parts, the last one short
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(local), str(dst), str(state), str(PART)],
        env={**os.environ, **conn_env}, check=False, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    assert not s3.keys(bucket_key(dst)[1]), "a killed writer completes nothing"
    [noted] = state.glob("*.json")  # the upload's id stays at the site, nothing else of it
    assert json.loads(noted.read_text())["uri"] == f"s3://{BUCKET}/{bucket_key(dst)[1]}"

    sent = resumable_upload(local, dst, state_dir=state, part_size=PART, single_put_limit=PART)
    assert sent == local.stat().st_size - 2 * PART  # parts 1 and 2 were not sent again
    assert get(s3, dst) == local.read_bytes()
    assert not list(state.glob("*.json"))  # completed: nothing left to resume


def test_a_retry_that_wrote_other_bytes_sends_the_changed_parts_again(s3, conn_env, tmp_path, monkeypatch):
    dst = slot(tmp_path)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "uploads"))  # the worker's default place
    first = np.random.default_rng(1).bytes(3 * PART)
    local = tmp_path / "update.bin"
    local.write_bytes(first)
    from flare_airflow.core import store_resume

    calls: list[int] = []
    real = store_resume._upload_part

    def die_after_two(*a):
        if len(calls) == 2:
            raise ConnectionError("network lost")  # an OSError: the site task's StoreError says what to do
        calls.append(a[4])
        return real(*a)

    monkeypatch.setattr(store_resume, "_upload_part", die_after_two)
    with pytest.raises(StoreError, match="the upload stays open"):
        resumable_upload(local, dst, part_size=PART, single_put_limit=PART)
    second = first[:PART] + np.random.default_rng(2).bytes(2 * PART)  # retrained: parts 2 and 3 differ
    local.write_bytes(second)
    monkeypatch.setattr(store_resume, "_upload_part", real)
    assert resumable_upload(local, dst, part_size=PART, single_put_limit=PART) == 2 * PART
    assert get(s3, dst) == second


def test_small_updates_and_other_stores_are_left_to_the_plain_copy(s3, conn_env, tmp_path):
    local = tmp_path / "small.bin"
    local.write_bytes(b"x" * 1024)
    assert resumable_upload(local, slot(tmp_path), part_size=PART, single_put_limit=PART) is None
    assert resumable_upload(local, tmp_path / "elsewhere.bin") is None


def test_an_upload_noted_with_another_part_size_is_aborted_and_started_again(s3, conn_env, tmp_path, monkeypatch):
    from flare_airflow.core import store_resume

    dst, state = slot(tmp_path), tmp_path / "uploads"
    local = tmp_path / "update.bin"
    local.write_bytes(np.random.default_rng(3).bytes(2 * PART + 1))
    real = store_resume._upload_part

    def die_after_one(*a):
        real(*a)
        raise ConnectionError("network lost")

    monkeypatch.setattr(store_resume, "_upload_part", die_after_one)
    with pytest.raises(StoreError):
        resumable_upload(local, dst, state_dir=state, part_size=PART, single_put_limit=PART)
    [noted] = state.glob("*.json")
    old_id = json.loads(noted.read_text())["upload_id"]
    monkeypatch.setattr(store_resume, "_upload_part", real)
    assert (
        resumable_upload(local, dst, state_dir=state, part_size=2 * PART, single_put_limit=PART) == local.stat().st_size
    )
    assert get(s3, dst) == local.read_bytes()
    uploads = s3.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    assert old_id not in {u["UploadId"] for u in uploads}  # the abandoned upload was aborted, not left billed
