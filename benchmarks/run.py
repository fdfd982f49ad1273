"""flare-airflow benchmarks: measured side by side, printed as markdown tables, never asserted.

    .venv/bin/python benchmarks/run.py              # everything (~35 min on 2 cores)
    .venv/bin/python benchmarks/run.py --quick      # smaller set (~2 min)
    .venv/bin/python benchmarks/run.py --only e2e   # or --only fedavg, --only k8s, ...

1. **e2e** -- a trivial job (2 sites x 1 and x 3 rounds, no-op trainer) through real Airflow
   (embedded default: SQLite, ``airflow dags test``) next to a 1-task no-op DAG (Airflow's floor).
2. **fedavg** -- ``fedavg_from_store`` on 4 and 16 updates of 64 and 256 MiB: throughput and peak
   memory, next to numpy's own streaming bandwidth on the same bytes, and a per-stage breakdown.
3. **k8s** -- the Kubernetes API requests of one site job (ours deferrable and sync, the stock
   KubernetesPodOperator sync and deferrable; jobs of 10 s and 60 s) against a real control plane
   (flare_airflow_testing/k8s), all cases at once in separate namespaces (~1.5 min).
5. **nvflare** -- side by side with NVIDIA FLARE 2.9.0 (installed on first use into its own venv,
   /var/tmp/flare-airflow-bench/nvflare-venv): the same jobs end to end (hello-numpy-style 2 sites x 1
   and x 3 rounds, digits 4 x 5) through ``flare-airflow run`` and NVFlare's simulator, and FedAvg on
   the same updates vs NVFlare's ``WeightedAggregationHelper`` (~10 min; ``--only nvflare`` writes
   ``benchmarks/results/nvflare.md``; ``--only nvflare-aggregation`` runs its aggregation part alone,
   ~3 min, into ``benchmarks/results/nvflare_aggregation.md``; ``--only nvflare-poc``: the same jobs
   under Airflow's real scheduler vs NVFlare's POC mode (server + client processes, admin API),
   Airflow defaults and tuned settings side by side, into ``benchmarks/results/nvflare_poc.md``;
   ``--only nvflare-shim``: the NVFlare Client API stand-in's per-round cost next to the native
   Client API on the digits model, ~1 min, into ``benchmarks/results/nvflare_shim.md``;
   ``--only nvflare-native``: native mode (FlareJobOperator on a FLARE POC system) per job next to
   ``nvflare job submit`` + ``wait`` + ``download``, ~4 min, into ``benchmarks/results/nvflare_native.md``).
7. **edge** -- sites on Edge workers vs the central LocalExecutor (per-round cost), and model
   exchange through an S3 endpoint (moto, an emulator) vs the local store (~4 min;
   ``benchmarks/results/edge.md``); ``--only edge-trust``: an Edge round with site-key worker
   auth and the site guard next to the shared-secret setup, both deployments up at once (~6 min;
   ``benchmarks/results/edge_trust.md``).
6. **rounds** -- a run of R of a job's M rounds next to a job of exactly R rounds under the real
   scheduler (PostgreSQL, LocalExecutor): what the rounds a run does not ask for cost (~4 min;
   ``benchmarks/results/skipped_rounds.md``).
9. **containers** -- the digits job's round under the real scheduler with all sites process, all
   container (rootful podman, the trainer image), all pod (real kube-apiserver, LOCAL NODE AGENT);
   then one site job of each through its launcher, the container launcher's engine calls before
   they were cut, the engine's floors and options (~25 min at --reps 3 on a loaded machine;
   ``benchmarks/results/containers.md``).

The tables go to stdout and to ``benchmarks/results/latest.md`` with the machine's details
(``--only k8s``: to ``benchmarks/results/k8s_api.md``, ``--only fedavg``: ``fedavg.md``, and so on,
so that one part does not replace a full report). These
machines are noisy: compared cases alternate within one run, repetitions >= 3, medians reported.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bench_confinement
import bench_containers
import bench_data_trigger
import bench_e2e
import bench_edge
import bench_edge_trust
import bench_fedavg
import bench_k8s_api
import bench_links
import bench_nvflare
import bench_nvflare_native
import bench_nvflare_shim
import bench_poc
import bench_privacy
import bench_privacy_keying
import bench_rounds
import bench_scale
import bench_tracking
import bench_trust
from bench_common import BenchmarkFailed, CpuSnapshot, Table, log, machine_table

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
DEFAULT_OUTPUT = RESULTS / "latest.md"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: ``--only NAME`` runs it alone, into its own report (``output``); those in the
    full run (``in_full_run``) add their section to ``latest.md``."""

    name: str
    in_full_run: bool
    doing: str  # the log line while it runs
    title: str  # its section of the report
    run: Callable[[argparse.Namespace], list[Table]]
    output: Path | None = None  # None: latest.md


# Report order; the full run runs those marked in_full_run, in this order.
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "e2e",
        True,
        "end-to-end through Airflow",
        "1. End to end through Airflow",
        lambda a: bench_e2e.run(reps=a.reps, quick=a.quick, keep=a.keep, tmp_base=a.tmp_dir),
    ),
    Benchmark(
        "fedavg",
        True,
        "FedAvg throughput and memory",
        "2. FedAvg throughput and peak memory",
        lambda a: bench_fedavg.run(
            sizes_mib=[64] if a.quick else [64, 256],
            counts=[4, 16],
            reps=a.reps,
            quick=a.quick,
            keep=a.keep,
            tmp_base=a.tmp_dir,
        ),
        RESULTS / "fedavg.md",
    ),
    Benchmark(
        "k8s",
        True,
        "Kubernetes API requests of one site job",
        "3. Kubernetes API requests of one site job",
        lambda a: bench_k8s_api.run(quick=a.quick, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "k8s_api.md",
    ),
    Benchmark(
        "scale",
        True,
        "DAG parse and one round under the real scheduler, 64-1024 sites",
        "4. Scale: DAG parse and one round for 64-1024 sites",
        lambda a: bench_scale.run(reps=a.reps, quick=a.quick, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "scale.md",
    ),
    Benchmark(
        "nvflare",
        True,
        "side by side with NVIDIA FLARE 2.9.0 (its own venv)",
        "5. Side by side with NVIDIA FLARE 2.9.0",
        lambda a: bench_nvflare.run(reps=a.reps, quick=a.quick, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "nvflare.md",
    ),
    Benchmark(
        "rounds",
        True,
        "R of M rounds vs exactly R rounds under the real scheduler",
        "6. Rounds a run does not ask for, under the real scheduler",
        lambda a: bench_rounds.run(reps=a.reps, quick=a.quick, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "skipped_rounds.md",
    ),
    Benchmark(
        "edge",
        True,
        "Edge workers vs the central executor; S3 (moto) vs the local store",
        "7. Sites at the sites: Edge workers and an object store",
        lambda a: bench_edge.run(reps=a.reps, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "edge.md",
    ),
    Benchmark(
        "edge-trust",
        False,
        "an Edge round with site-key worker auth + the site guard vs the shared secret",
        "The control plane without a shared secret (issue 36)",
        lambda a: bench_edge_trust.run(reps=a.reps, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "edge_trust.md",
    ),
    Benchmark(
        "privacy",
        True,
        "the site's filters per update; digits accuracy under local DP",
        "8. Privacy: the site's filters and what noise costs",
        lambda a: bench_privacy.run(reps=a.reps, quick=a.quick),
        RESULTS / "privacy.md",
    ),
    Benchmark(
        "privacy-keying",
        False,
        "the noise's keying old vs new, and the site's ledger per round",
        "Privacy keyed by what is released, and the site's ledger (issue 34)",
        lambda a: bench_privacy_keying.run(reps=max(a.reps, 5), quick=a.quick),
        RESULTS / "privacy_keying.md",
    ),
    Benchmark(
        "confinement",
        False,
        "one site job, confined (bubblewrap) vs unconfined",
        "Confinement of process trainers: the cost of one site job",
        lambda a: bench_confinement.run(reps=max(a.reps, 5), keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "confinement.md",
    ),
    Benchmark(
        "trust",
        False,
        "signing and verifying records at 256 MiB; a hello round before and with trust",
        "Trust: signed records, their cost",
        lambda a: bench_trust.run(reps=a.reps, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "trust.md",
    ),
    Benchmark(
        "data-trigger",
        False,
        "quorum-forming announcement to the first site task, real scheduler",
        "Runs driven by the sites' data: from the announcement to the run (issue 39)",
        lambda a: bench_data_trigger.run(reps=a.reps, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "data_trigger.md",
    ),
    Benchmark(
        "links",
        False,
        "a site's round today vs links + sealing + signatures (moto S3), and a hello round",
        "Store links, sealing and signatures: the data plane's cost",
        lambda a: bench_links.run(reps=a.reps, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "links.md",
    ),
    Benchmark(
        "tracking",
        False,
        "digits: no tracking, MLflow embedded, MLflow server; under the real scheduler",
        "Experiment tracking's cost per round",
        lambda a: bench_tracking.run(reps=a.reps, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "tracking.md",
    ),
    Benchmark(
        "containers",
        True,
        "a round and one site job: container sites (podman) vs process vs pod",
        "9. Container sites next to process and pod sites: a round, one site job",
        lambda a: bench_containers.run(reps=a.reps, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "containers.md",
    ),
    Benchmark(
        "nvflare-aggregation",
        False,
        "aggregation side by side with NVIDIA FLARE 2.9.0 (its own venv)",
        "5. Side by side with NVIDIA FLARE 2.9.0: aggregation",
        lambda a: bench_nvflare.run_aggregation_only(reps=a.reps, quick=a.quick, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "nvflare_aggregation.md",
    ),
    Benchmark(
        "nvflare-e2e",
        False,
        "end to end side by side with NVIDIA FLARE 2.9.0's simulator (its own venv)",
        "5. Side by side with NVIDIA FLARE 2.9.0: end to end",
        lambda a: bench_nvflare.run_e2e_only(reps=a.reps, quick=a.quick, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "nvflare_e2e.md",
    ),
    Benchmark(
        "nvflare-shim",
        False,
        "the NVFlare Client API stand-in vs the native Client API, per round",
        "NVFlare Client API stand-in: per-round cost",
        lambda a: bench_nvflare_shim.run(reps=a.reps, tmp_base=a.tmp_dir),
        RESULTS / "nvflare_shim.md",
    ),
    Benchmark(
        "nvflare-poc",
        False,
        "under the real scheduler vs NVIDIA FLARE 2.9.0's POC mode (its own venv)",
        "Under the real scheduler: side by side with NVIDIA FLARE 2.9.0's POC mode",
        lambda a: bench_poc.run(reps=a.reps, quick=a.quick, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "nvflare_poc.md",
    ),
    Benchmark(
        "nvflare-native",
        False,
        "native mode's added latency per job vs NVFlare's CLI (one POC system)",
        "NVFlare-native mode: added latency per job next to NVFlare's CLI",
        lambda a: bench_nvflare_native.run(reps=a.reps, keep=a.keep, tmp_base=a.tmp_dir),
        RESULTS / "nvflare_native.md",
    ),
)
BY_NAME = {b.name: b for b in BENCHMARKS}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="smaller set: 64 MiB updates only, no cold-run pass, 5/20 s k8s jobs"
    )
    p.add_argument(
        "--only",
        choices=tuple(BY_NAME),
        help="run one benchmark (all but e2e write a report of their own)",
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions per case (at least 3; medians reported)")
    p.add_argument("--tmp-dir", help="where temporary AIRFLOW_HOME and model stores go (on disk, not tmpfs)")
    p.add_argument("--keep", action="store_true", help="keep temporary files (Airflow logs, stores)")
    p.add_argument(
        "--output",
        type=Path,
        help=f"markdown report (default: {DEFAULT_OUTPUT}; with --only X other than e2e: a file of its own)",
    )
    args = p.parse_args(argv)
    if args.output is None:
        args.output = (BY_NAME[args.only].output if args.only else None) or DEFAULT_OUTPUT
    if args.reps < 3:
        p.error("--reps must be at least 3: these machines are noisy and single runs mislead")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    tmp_dir = args.tmp_dir or tempfile.gettempdir()
    sections: list[tuple[str, list[Table]]] = []
    machine = machine_table(tmp_dir)  # before the benchmarks: the load average at start
    cpu_start = CpuSnapshot.take()
    chosen = [BY_NAME[args.only]] if args.only else [b for b in BENCHMARKS if b.in_full_run]
    try:
        for bench in chosen:
            log(f"[{bench.name}] {bench.doing} ...")
            sections.append((bench.title, bench.run(args)))
    except BenchmarkFailed as exc:
        print(f"BENCHMARK FAILED: {exc}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - started
    machine.add("foreign CPU load during the benchmark", cpu_start.foreign_load(CpuSnapshot.take()))
    machine.add("load average at end", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    mode = "quick" if args.quick else "full"
    command = shlex.join(["python", "benchmarks/run.py", *argv])
    if args.only == "k8s":
        reps = "one run per case (request counts, not timings)"
    else:
        reps = f"{args.reps} repetitions per case" + (" (k8s request counts: one run)" if args.only is None else "")
    parts = [
        "# flare-airflow benchmarks\n",
        f"`{command}` — {mode} set, {reps}; the benchmark itself took "
        f"{elapsed / 60:.1f} min. Measured, never asserted: compare rows within this file, not across machines.\n",
        machine.markdown(),
    ]
    for title, tables in sections:
        parts.append(f"## {title}\n")
        parts.extend(t.markdown() for t in tables)
    report = "\n".join(parts)
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    log(f"wrote {args.output} ({elapsed:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
