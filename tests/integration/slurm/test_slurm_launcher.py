"""The SLURM launcher against real daemons (munged, slurmctld, slurmd with 4 fake GPUs)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flare_airflow.core.config import ResourceSpec, SlurmLaunchSpec
from flare_airflow.core.spec import JobReturnCode, JobState, SiteJob
from flare_airflow.launchers.slurm import (
    LaunchError,
    LocalCommands,
    SlurmJobHandle,
    SlurmLauncher,
    list_jobs,
    site_job_prefix,
)
from flare_airflow_testing.slurm.cluster import GPUS, SlurmCluster


def site_job(argv: list[str], site: str = "site-1", round_num: int = 1, **env: str) -> SiteJob:
    return SiteJob(job="demo", run_id="manual__t", round=round_num, site=site, argv=tuple(argv), env=env)


def commands(slurm: SlurmCluster) -> LocalCommands:
    return LocalCommands({**os.environ, **slurm.env})


def launcher(slurm: SlurmCluster, tmp_path: Path, lines: list[str] | None = None, **spec: object) -> SlurmLauncher:
    resources = ResourceSpec(**spec.pop("resources", {}))  # type: ignore[arg-type]
    return SlurmLauncher(
        SlurmLaunchSpec(**{"output_dir": str(tmp_path / "out"), "poll_interval": 0.3, **spec}),  # type: ignore[arg-type]
        resources,
        commands=commands(slurm),
        sink=None if lines is None else lines.append,
    )


def test_a_job_runs_its_exact_argv_and_streams_its_output(slurm: SlurmCluster, tmp_path: Path) -> None:
    lines: list[str] = []
    marker = tmp_path / "pwned"
    argv = [sys.executable, "-c", "import os, sys; print(sys.argv[1:]); print(os.environ['FLARE_SITE'])"]
    hostile = [f"$(touch {marker})", "; rm -rf /", "'quoted'", "two words"]
    argv += hostile
    handle = launcher(slurm, tmp_path, lines).launch_job(site_job(argv, FLARE_SITE="site-1"))
    assert handle.wait(60) is JobReturnCode.SUCCESS
    assert handle.state is JobState.SUCCEEDED and handle.reason == ""
    assert lines == [
        f"[site-1 r1] {hostile}",
        "[site-1 r1] site-1",
    ]
    assert not marker.exists()


def test_a_failing_trainer_gives_its_exit_code_and_last_output(slurm: SlurmCluster, tmp_path: Path) -> None:
    code = "import sys; [print('step', i) for i in range(30)]; print('boom: bad data'); sys.exit(3)"
    handle = launcher(slurm, tmp_path).launch_job(site_job([sys.executable, "-c", code]))
    assert handle.wait(60) is JobReturnCode.EXECUTION_ERROR
    assert handle.state is JobState.FAILED
    assert "FAILED" in handle.reason and "exit code 3" in handle.reason
    assert handle.reason.endswith("step 28 | step 29 | boom: bad data")


def test_reserved_exit_codes_pass_through(slurm: SlurmCluster, tmp_path: Path) -> None:
    handle = launcher(slurm, tmp_path).launch_job(site_job([sys.executable, "-c", "raise SystemExit(103)"]))
    assert handle.wait(60) is JobReturnCode.CONFIG_ERROR


def test_terminate_cancels_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    handle = launcher(slurm, tmp_path).launch_job(site_job([sys.executable, "-c", "import time; time.sleep(300)"]))
    deadline = time.monotonic() + 30
    while handle.read_status().state is not JobState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.2)
    handle.terminate()
    assert handle.poll() is JobReturnCode.ABORTED
    assert handle.state is JobState.TERMINATED
    assert "cancelled by flare-airflow" in handle.reason
    assert slurm.jobs() == []


def test_more_gpus_than_the_cluster_has_is_refused_at_submission(slurm: SlurmCluster, tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"sbatch refused the job .*Requested node configuration is not available"):
        launcher(slurm, tmp_path, resources={"num_of_gpus": GPUS + 1}).launch_job(site_job(["true"]))


def test_five_one_gpu_jobs_on_four_gpus(slurm: SlurmCluster, tmp_path: Path) -> None:
    """One job waits PENDING (Resources) until a GPU frees up; each sees only its own GPU."""
    script = tmp_path / "gpu.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            print("CVD", os.environ.get("CUDA_VISIBLE_DEVICES"), time.time(), flush=True)
            time.sleep(3)
            print("END", time.time(), flush=True)
            """
        )
    )
    out: list[str] = []
    handles: list[SlurmJobHandle] = []

    def submit(n: int) -> SlurmJobHandle:
        run = launcher(slurm, tmp_path, out, resources={"num_of_gpus": 1})
        handle = run.launch_job(site_job([sys.executable, str(script)], site=f"site-{n}"))
        handles.append(handle)
        return handle

    for n in range(GPUS):
        submit(n)
    deadline = time.monotonic() + 30
    while {h.read_status().state for h in handles} != {JobState.RUNNING} and time.monotonic() < deadline:
        time.sleep(0.1)
    fifth = submit(GPUS)  # every GPU is taken: it must wait for one
    seen: list[str] = []
    while time.monotonic() < deadline + 60:
        codes = [h.poll() for h in handles]  # every handle, every time: each keeps its own status
        seen.append(fifth.status.native)
        if JobReturnCode.UNKNOWN not in codes:
            break
        time.sleep(0.1)
    assert [h.poll() for h in handles] == [JobReturnCode.SUCCESS] * (GPUS + 1)
    assert "PENDING (Resources)" in seen, seen
    starts = {}
    for line in out:
        site, _, rest = line.partition("] ")
        if rest.startswith("CVD"):
            starts[site] = rest.split()[1:]
    assert len(starts) == GPUS + 1
    assert all(dev in {str(g) for g in range(GPUS)} for dev, _ in starts.values())  # exactly one device each
    # The first GPUS jobs ran at once, on distinct devices.
    first = sorted(starts.values(), key=lambda item: float(item[1]))[:GPUS]
    assert sorted(dev for dev, _ in first) == [str(g) for g in range(GPUS)]
    # ... and the fifth started only once one of them had ended.
    ends = [float(rest.split()[1]) for line in out if (rest := line.partition("] ")[2]).startswith("END")]
    assert float(starts[f"[site-{GPUS} r1"][1]) >= min(ends)


def test_pending_timeout_cancels_a_job_that_waits_too_long(slurm: SlurmCluster, tmp_path: Path) -> None:
    busy = launcher(slurm, tmp_path, resources={"num_of_gpus": GPUS}).launch_job(
        site_job([sys.executable, "-c", "import time; time.sleep(60)"], site="busy")
    )
    try:
        waiting = launcher(slurm, tmp_path, resources={"num_of_gpus": 1}, pending_timeout=2.0).launch_job(
            site_job(["true"], site="waiting")
        )
        assert waiting.wait(30) is JobReturnCode.INFRASTRUCTURE_ERROR
        assert "stayed PENDING" in waiting.reason and "pending_timeout=2s" in waiting.reason
    finally:
        busy.terminate()
    deadline = time.monotonic() + 10
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)


def test_later_tries_find_earlier_jobs_by_name(slurm: SlurmCluster, tmp_path: Path) -> None:
    first = launcher(slurm, tmp_path).launch_job(site_job([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        found = list_jobs(commands(slurm), site_job_prefix("demo", "manual__t", 1, "site-1"))
        assert [(job_id, name.rsplit("-", 1)[1]) for job_id, name, _ in found] == [(first.job_id, "t1")]
        other = list_jobs(commands(slurm), site_job_prefix("demo", "manual__t", 2, "site-1"))
        assert other == []
    finally:
        first.terminate()


RENDEZVOUS = """
import os, socket, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if rank == 0:
    server = socket.create_server(("0.0.0.0", port))
    got = [0]
    for _ in range(world - 1):
        conn, _ = server.accept()
        got.append(int(conn.recv(16)))
    print("rank 0 gathered", sorted(got), "local ranks", os.environ["LOCAL_RANK"], flush=True)
else:
    for _ in range(100):
        try:
            with socket.create_connection((addr, port), timeout=1) as conn:
                conn.sendall(str(rank).encode())
            break
        except OSError:
            time.sleep(0.1)
    else:
        sys.exit("rank %d could not reach %s:%d" % (rank, addr, port))
"""


def test_several_ranks_rendezvous_over_tcp(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "rdv.py"
    script.write_text(RENDEZVOUS)
    lines: list[str] = []
    handle = launcher(slurm, tmp_path, lines, tasks_per_node=3).launch_job(site_job([sys.executable, str(script)]))
    assert handle.wait(60) is JobReturnCode.SUCCESS, "\n".join(lines)
    assert "[site-1 r1] rank 0 gathered [0, 1, 2] local ranks 0" in lines


def test_one_failing_rank_ends_the_whole_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    code = "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.5) if r else time.sleep(300); sys.exit(5)"
    handle = launcher(slurm, tmp_path, tasks_per_node=2).launch_job(site_job([sys.executable, "-c", code]))
    assert handle.wait(60) is JobReturnCode.EXECUTION_ERROR
    assert slurm.jobs() == []


def test_a_job_that_cannot_start_fails_after_startup_timeout(slurm: SlurmCluster, tmp_path: Path) -> None:
    """PENDING for a reason waiting does not fix (here the partition is down): startup_timeout, not
    pending_timeout, and the job is cancelled."""
    slurm.run("scontrol", "update", f"PartitionName={slurm.partition}", "State=DOWN")
    try:
        handle = launcher(slurm, tmp_path, startup_timeout=2.0, pending_timeout=600.0).launch_job(site_job(["true"]))
        assert handle.wait(30) is JobReturnCode.CONFIG_ERROR
    finally:
        slurm.run("scontrol", "update", f"PartitionName={slurm.partition}", "State=UP")
    assert "stayed PENDING (PartitionDown)" in handle.reason and "startup_timeout=2s" in handle.reason
