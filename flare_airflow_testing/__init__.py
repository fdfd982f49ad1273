"""The project's test machinery, shared by ``tests/`` and ``benchmarks/`` (as Airflow keeps its own in
``devel-common/src/tests_common``). Not part of the ``flare_airflow`` distribution: it is never
installed, and is imported from the repository root (pytest and the benchmarks put it on ``sys.path``).

- :mod:`.k8s`: a real Kubernetes control plane (etcd, kube-apiserver, scheduler, controller-manager)
  on loopback, the LOCAL NODE AGENT that plays the kubelet, the audit-log reader, pytest fixtures.
- :mod:`.slurm`: a real single-node SLURM cluster (munged, slurmctld, slurmd, fake GPUs), sshd, fixtures.
- :mod:`.harness`: a private Airflow home (SQLite) and ``flare-airflow run`` of a job, task states read back.
- :mod:`.stack`: a private PostgreSQL and a real Airflow deployment (api-server, scheduler, dag-processor).
- :mod:`.local_airflow`: ``make airflow``'s local Airflow, started and stopped as a user would.
- :mod:`.edge_sites`, :mod:`.deploy_guide`, :mod:`.s3_server`, :mod:`.netns`, :mod:`.site_data`: sites at
  the sites (Edge workers, an S3 emulator, network namespaces) set up as docs/deploy-across-sites.md says.
- :mod:`.containers`: the project's images, built or found by ``docker/images.py``.
- :mod:`.side_venvs`: NVIDIA FLARE's and PyTorch's side environments, cached per machine.
- :mod:`.nvflare_poc`: a real FLARE deployment (NVFlare's POC system) for native mode's tests and benchmark.
- :mod:`.mlflow_server`: a real ``mlflow server`` on loopback (experiment tracking's tests and benchmark).

The import contracts in pyproject.toml keep it below the tests: it never imports ``tests`` or ``benchmarks``,
and benchmarks never import ``tests``. Submodules are imported directly; this package imports nothing.
"""
