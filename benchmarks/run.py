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
DEFAULT_OUTPUT = BENCH_DIR / "results" / "latest.md"
K8S_OUTPUT = BENCH_DIR / "results" / "k8s_api.md"  # --only k8s: a report of its own
SCALE_OUTPUT = BENCH_DIR / "results" / "scale.md"  # --only scale: a report of its own
NVFLARE_OUTPUT = BENCH_DIR / "results" / "nvflare.md"  # --only nvflare: a report of its own
OWN_OUTPUTS = {
    "fedavg": BENCH_DIR / "results" / "fedavg.md",
    "k8s": K8S_OUTPUT,
    "scale": SCALE_OUTPUT,
    "nvflare": NVFLARE_OUTPUT,
    "nvflare-aggregation": BENCH_DIR / "results" / "nvflare_aggregation.md",
    "nvflare-e2e": BENCH_DIR / "results" / "nvflare_e2e.md",
    "nvflare-poc": BENCH_DIR / "results" / "nvflare_poc.md",
    "nvflare-native": BENCH_DIR / "results" / "nvflare_native.md",
    "nvflare-shim": BENCH_DIR / "results" / "nvflare_shim.md",
    "rounds": BENCH_DIR / "results" / "skipped_rounds.md",
    "edge": BENCH_DIR / "results" / "edge.md",
    "edge-trust": BENCH_DIR / "results" / "edge_trust.md",
    "privacy": BENCH_DIR / "results" / "privacy.md",
    "privacy-keying": BENCH_DIR / "results" / "privacy_keying.md",
    "confinement": BENCH_DIR / "results" / "confinement.md",
    "tracking": BENCH_DIR / "results" / "tracking.md",
    "containers": BENCH_DIR / "results" / "containers.md",
    "trust": BENCH_DIR / "results" / "trust.md",
    "data-trigger": BENCH_DIR / "results" / "data_trigger.md",
    "links": BENCH_DIR / "results" / "links.md",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="smaller set: 64 MiB updates only, no cold-run pass, 5/20 s k8s jobs"
    )
    p.add_argument(
        "--only",
        choices=(
            "e2e",
            "fedavg",
            "k8s",
            "scale",
            "nvflare",
            "nvflare-aggregation",
            "nvflare-e2e",
            "nvflare-poc",
            "nvflare-native",
            "nvflare-shim",
            "rounds",
            "edge",
            "edge-trust",
            "privacy",
            "privacy-keying",
            "confinement",
            "tracking",
            "containers",
            "trust",
            "data-trigger",
            "links",
        ),
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
        args.output = OWN_OUTPUTS.get(args.only, DEFAULT_OUTPUT)
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
    try:
        if args.only in (None, "e2e"):
            log("[e2e] end-to-end through Airflow ...")
            tables = bench_e2e.run(reps=args.reps, quick=args.quick, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("1. End to end through Airflow", tables))
        if args.only in (None, "fedavg"):
            log("[fedavg] FedAvg throughput and memory ...")
            tables = bench_fedavg.run(
                sizes_mib=[64] if args.quick else [64, 256],
                counts=[4, 16],
                reps=args.reps,
                quick=args.quick,
                keep=args.keep,
                tmp_base=args.tmp_dir,
            )
            sections.append(("2. FedAvg throughput and peak memory", tables))
        if args.only in (None, "k8s"):
            log("[k8s] Kubernetes API requests of one site job ...")
            tables = bench_k8s_api.run(quick=args.quick, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("3. Kubernetes API requests of one site job", tables))
        if args.only in (None, "scale"):
            log("[scale] DAG parse and one round under the real scheduler, 64-1024 sites ...")
            tables = bench_scale.run(reps=args.reps, quick=args.quick, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("4. Scale: DAG parse and one round for 64-1024 sites", tables))
        if args.only in (None, "nvflare"):
            log("[nvflare] side by side with NVIDIA FLARE 2.9.0 (its own venv) ...")
            tables = bench_nvflare.run(reps=args.reps, quick=args.quick, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("5. Side by side with NVIDIA FLARE 2.9.0", tables))
        if args.only in (None, "rounds"):
            log("[rounds] R of M rounds vs exactly R rounds under the real scheduler ...")
            tables = bench_rounds.run(reps=args.reps, quick=args.quick, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("6. Rounds a run does not ask for, under the real scheduler", tables))
        if args.only in (None, "edge"):
            log("[edge] Edge workers vs the central executor; S3 (moto) vs the local store ...")
            tables = bench_edge.run(reps=args.reps, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("7. Sites at the sites: Edge workers and an object store", tables))
        if args.only == "edge-trust":
            log("[edge-trust] an Edge round with site-key worker auth + the site guard vs the shared secret ...")
            tables = bench_edge_trust.run(reps=args.reps, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("The control plane without a shared secret (issue 36)", tables))
        if args.only in (None, "privacy"):
            log("[privacy] the site's filters per update; digits accuracy under local DP ...")
            tables = bench_privacy.run(reps=args.reps, quick=args.quick)
            sections.append(("8. Privacy: the site's filters and what noise costs", tables))
        if args.only == "privacy-keying":
            log("[privacy-keying] the noise's keying old vs new, and the site's ledger per round ...")
            tables = bench_privacy_keying.run(reps=max(args.reps, 5), quick=args.quick)
            sections.append(("Privacy keyed by what is released, and the site's ledger (issue 34)", tables))
        if args.only == "confinement":
            log("[confinement] one site job, confined (bubblewrap) vs unconfined ...")
            tables = bench_confinement.run(reps=max(args.reps, 5), keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("Confinement of process trainers: the cost of one site job", tables))
        if args.only == "trust":
            log("[trust] signing and verifying records at 256 MiB; a hello round before and with trust ...")
            tables = bench_trust.run(reps=args.reps, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("Trust: signed records, their cost", tables))
        if args.only == "data-trigger":
            log("[data-trigger] quorum-forming announcement to the first site task, real scheduler ...")
            tables = bench_data_trigger.run(reps=args.reps, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("Runs driven by the sites' data: from the announcement to the run (issue 39)", tables))
        if args.only == "links":
            log("[links] a site's round today vs links + sealing + signatures (moto S3), and a hello round ...")
            tables = bench_links.run(reps=args.reps, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("Store links, sealing and signatures: the data plane's cost", tables))
        if args.only == "tracking":
            log("[tracking] digits: no tracking, MLflow embedded, MLflow server; under the real scheduler ...")
            tables = bench_tracking.run(reps=args.reps, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("Experiment tracking's cost per round", tables))
        if args.only in (None, "containers"):
            log("[containers] a round and one site job: container sites (podman) vs process vs pod ...")
            tables = bench_containers.run(reps=args.reps, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("9. Container sites next to process and pod sites: a round, one site job", tables))
        if args.only == "nvflare-aggregation":
            log("[nvflare] aggregation side by side with NVIDIA FLARE 2.9.0 (its own venv) ...")
            tables = bench_nvflare.run_aggregation_only(
                reps=args.reps, quick=args.quick, keep=args.keep, tmp_base=args.tmp_dir
            )
            sections.append(("5. Side by side with NVIDIA FLARE 2.9.0: aggregation", tables))
        if args.only == "nvflare-e2e":
            log("[nvflare] end to end side by side with NVIDIA FLARE 2.9.0's simulator (its own venv) ...")
            tables = bench_nvflare.run_e2e_only(reps=args.reps, quick=args.quick, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("5. Side by side with NVIDIA FLARE 2.9.0: end to end", tables))
        if args.only == "nvflare-shim":
            log("[nvflare-shim] the NVFlare Client API stand-in vs the native Client API, per round ...")
            tables = bench_nvflare_shim.run(reps=args.reps, tmp_base=args.tmp_dir)
            sections.append(("NVFlare Client API stand-in: per-round cost", tables))
        if args.only == "nvflare-poc":
            log("[poc] under the real scheduler vs NVIDIA FLARE 2.9.0's POC mode (its own venv) ...")
            tables = bench_poc.run(reps=args.reps, quick=args.quick, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("Under the real scheduler: side by side with NVIDIA FLARE 2.9.0's POC mode", tables))
        if args.only == "nvflare-native":
            log("[nvflare-native] native mode's added latency per job vs NVFlare's CLI (one POC system) ...")
            tables = bench_nvflare_native.run(reps=args.reps, keep=args.keep, tmp_base=args.tmp_dir)
            sections.append(("NVFlare-native mode: added latency per job next to NVFlare's CLI", tables))
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
