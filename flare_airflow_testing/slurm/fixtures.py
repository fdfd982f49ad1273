"""Fixtures for tests against a real single-node SLURM cluster (munged + slurmctld + slurmd, fake GPUs).

Nothing here skips: a cluster that cannot start (packages missing -- ``make system-deps`` installs
them -- or a daemon failing) raises, and every test using it errors.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flare_airflow_testing.slurm.cluster import SlurmCluster
from flare_airflow_testing.slurm.sshd import Sshd


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    print(f"\n[slurm] cluster ready in {cluster.start_seconds:.1f} s (run dir {cluster.run_dir})")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's cluster; at teardown the test FAILS if any job is still queued or running
    (10 s after the test: a cancelled job takes up to KillWait to leave the queue)."""
    yield slurm_cluster
    left = slurm_cluster.settled_jobs()
    if left:
        slurm_cluster.cancel_all()
        pytest.fail(f"SLURM jobs left in the queue after the test: {'; '.join(left)}")


@pytest.fixture(scope="session")
def sshd(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """A real sshd on loopback (key auth) whose sessions reach the test cluster (SLURM_CONF)."""
    server = Sshd(tmp_path_factory.mktemp("sshd"), slurm_cluster.env).start()
    try:
        yield server
    finally:
        server.stop()
