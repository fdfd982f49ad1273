"""A model store that fills up (a real 1 MiB tmpfs as the store): the failing site's reason
reaches the aggregation through the task's XCom when its failure record cannot be written, the
round fails naming the store, and no temporary file is left behind (issue 16, item 4)."""

from __future__ import annotations

import os
import pathlib
import subprocess
from collections.abc import Iterator

import pytest

from flare_airflow_testing.harness import AirflowHome, behave_job

pytestmark = pytest.mark.e2e


@pytest.fixture
def tiny_store(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A 1 MiB tmpfs (the tests run as root, as CI does; a failure to mount fails the test)."""
    mount = tmp_path / "tiny-store"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_store_keeps_every_reason_and_leaves_no_temporary_file(
    airflow_home: AirflowHome, tiny_store: pathlib.Path
) -> None:
    job = behave_job(airflow_home.root, "full-store", sites=2, rounds=1, min_clients=1, args=["--fill-store", "site-2"])
    job["store"] = f"file://{tiny_store}"
    job["evaluate"] = False
    result = airflow_home.run("flare_full_store", airflow_home.write_job("full_store", job))
    tasks = result.tasks
    assert tasks["prepare"] == "success"
    assert tasks["round_1.site-2"] == "failed"
    # site-1 trained before or after the store filled up: its update may or may not have fitted.
    assert tasks["round_1.site-1"] in {"success", "failed"}
    assert tasks["round_1.global_model"] == "failed"
    assert tasks["publish"] == "upstream_failed"
    assert result.state["state"] == "failed"
    # The reason of site-2 (its trainer could not write: the store is full) is what the round
    # reports, not "failed before its trainer ran".
    assert "No space left on device" in result.log
    assert "failed before its trainer ran" not in result.log
    reason = "trainer failed: exit code 1; its last output: OSError: [Errno 28] No space left on device"
    # In the aggregation's words: a rejected site (site-1 counted) or the lost quorum's list (site-1
    # could not write either).
    assert f"site site-2 does not count: {reason}" in result.log or f"site-2: {reason}" in result.log
    assert "round 1" in result.log and (
        "cannot write the global model" in result.log or "valid update(s)" in result.log
    )
    leftovers = [p for p in tiny_store.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == [], leftovers
    assert os.path.ismount(tiny_store)
