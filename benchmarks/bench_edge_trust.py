"""The control plane without a shared secret: what it costs, side by side in one run (issue 36).

Two Edge deployments of flare_airflow_testing/edge_sites.py are up at once on this machine, each
PostgreSQL + api-server + scheduler (``LocalExecutor,EdgeExecutor``) + dag-processor + triggerer
and one Edge worker per site, running the same job (2 process sites, the no-op trainer,
``evaluate: false``, a local store):

- **shared secret** (before issue 36): ``[api_auth] jwt_secret`` on every side; each site runs
  ``airflow edge worker --queues <site>``; no registry, so the site guard passes everything.
- **site keys**: the guide as it is now -- the central side signs with its Ed25519 token key,
  each worker is ``flare-airflow site worker <site>`` signing each call with the site's key, edge3
  checks it against the registry, and the site guard checks each worker call and each site task's
  Variable/Connection request (strict mode: records verified against the registry too).

After one untimed run on each, runs of 1 and 3 rounds alternate between the two; the per-round
cost is the slope (T3 - T1) / 2. A second table times one worker API call's check in-process:
signing a token, verifying it, and the guard's rule.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import Table, log, median, spread
from bench_edge import ROUNDS, SITES, _timed, _write_job
from bench_scale import write_init_model

REPO = Path(__file__).resolve().parent.parent
MODES = ("shared secret", "site keys")
# The site-key settings of the guide's central airflow.cfg: what the shared-secret setup lacks.
_TRUST_KEYS = (
    "AIRFLOW__EDGE__TRUSTED_JWKS_URL",
    "AIRFLOW__EDGE__JWT_ALGORITHM",
    "AIRFLOW__EDGE__JWT_ISSUER",
    "AIRFLOW__EDGE__JWT_VERIFIER",
    "AIRFLOW__API_AUTH__JWT_PRIVATE_KEY_PATH",
    "AIRFLOW__FLARE__SITE_KEYS",
    "AIRFLOW__FLARE__KEY_DIR",
)


class _Deployment:
    def __init__(self, root: Path, mode: str, init: Path, s3: Any) -> None:
        import secrets

        from flare_airflow_testing.edge_sites import EdgeWorker, central_env, enrol
        from flare_airflow_testing.ports import free_port
        from flare_airflow_testing.stack import AirflowStack, Postgres

        self.mode, self.workers = mode, []
        self.pg = Postgres()
        port = free_port()
        env = central_env(f"http://127.0.0.1:{port}", root / "central")
        self.secret = secrets.token_urlsafe(64) if mode == "shared secret" else None
        if self.secret is not None:
            env = {k: v for k, v in env.items() if k not in _TRUST_KEYS}
            env["AIRFLOW__API_AUTH__JWT_SECRET"] = self.secret
        self.stack = AirflowStack(root / "stack", self.pg.url, extra_env=env, port=port)
        if self.secret is None:
            self.stack.env.pop("AIRFLOW__API_AUTH__JWT_SECRET", None)
        _write_job(self.stack.dags, "edge_sites", init, root / "store", edge=True)
        self.workers = [EdgeWorker(root / "workers", site, self.stack, s3, queue=site) for site in SITES]
        for w in self.workers:
            # The same launcher and store as the other deployment's (no connection of its own).
            w.policy.write_text(json.dumps({"sites": {w.site: {"launcher": "process"}}}))
        if self.secret is None:
            enrol(root / "central", self.workers)

    def start(self) -> None:
        from flare_airflow_testing.stack import BIN, start_triggerer

        self.stack.start()
        start_triggerer(self.stack)
        for w in self.workers:
            if self.secret is None:
                w.start()
                continue
            env = {k: v for k, v in w.env().items() if k not in ("FLARE_KEY_DIR", "FLARE_SITE_KEYS")}
            env["AIRFLOW__API_AUTH__JWT_SECRET"] = self.secret
            argv = [str(BIN / "airflow"), "edge", "worker", "--queues", w.queue, "--edge-hostname", w.name]
            log_file = open(w.root / "worker.log", "ab")  # noqa: SIM115 - lives as long as the worker
            w.proc = subprocess.Popen(
                [*argv, "--concurrency", "2"], env=env, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=w.root,
            )  # fmt: skip

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.stack.stop()
        self.pg.stop()


def rounds_table(reps: int, root: Path) -> Table:
    from flare_airflow_testing.s3_server import S3Server

    init = write_init_model(root / "init.safetensors")
    s3 = S3Server()
    deps: dict[str, _Deployment] = {}
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for n, mode in enumerate(MODES):
            deps[mode] = _Deployment(root / f"d{n}", mode, init, s3)
            deps[mode].start()
        log("[edge-trust] both deployments up")
        for mode in MODES:  # not timed: the DAG's first parse, unpausing
            _timed(deps[mode].stack, "edge_sites", 1)
        for rep in range(reps):
            cases = [(m, r) for m in MODES for r in ROUNDS]
            for mode, r in cases if rep % 2 == 0 else cases[::-1]:
                elapsed = _timed(deps[mode].stack, "edge_sites", r)
                times.setdefault((mode, r), []).append(elapsed)
                log(f"[edge-trust] {mode} {r} round(s): {elapsed:.1f}s")
        refused = _guard_refusals(deps["site keys"])
    finally:
        for dep in deps.values():
            dep.stop()
        s3.stop()
    table = Table(
        f"An Edge round: site-key worker auth + the site guard vs the shared-secret setup; {len(SITES)} process "
        f"sites on Edge workers (poll 1 s), no-op trainer, local store; both deployments up at once, runs "
        f"alternating; trigger to end, median of {reps}",
        ["control plane", "1 round (s)", "3 rounds (s)", "per round (T3 - T1) / 2 (s)", "runs (1 / 3 rounds)"],
    )
    slope = {}
    for mode in MODES:
        t1, t3 = times[(mode, 1)], times[(mode, 3)]
        slope[mode] = (median(t3) - median(t1)) / 2
        runs = f"{spread(t1, '{:.1f}')} / {spread(t3, '{:.1f}')}"
        table.add(mode, f"{median(t1):.1f}", f"{median(t3):.1f}", f"{slope[mode]:.1f}", runs)
    t3 = {m: median(times[(m, 3)]) for m in MODES}
    table.notes.append(
        f"site keys / shared secret: {t3['site keys'] / t3['shared secret']:.3f}x for a 3-round run, "
        f"{slope['site keys'] - slope['shared secret']:+.1f} s per round (goal <= 1.05x; compare with the "
        f"runs' spread: this machine is shared). The site guard refused {refused} worker API call(s) in "
        "the site-key runs (expected 0: it only refuses what a worker of another site asks)."
    )
    return table


def _guard_refusals(dep: _Deployment) -> int:
    return (dep.stack.root / "api-server.log").read_text().count("flare-airflow refused")


def check_table(root: Path) -> Table:
    """One worker API call's check, in-process: what the site key adds to each request."""
    from flare_airflow.core.trust import generate_keys
    from flare_airflow.core.trust.control import check_worker_call
    from flare_airflow.core.trust.grants import Grants
    from flare_airflow.core.trust.keys import load_signing_key, party_dir
    from flare_airflow.core.trust.registry import Registry
    from flare_airflow.core.trust.tokens import sign_worker_token, verify_worker_token

    jwks = []
    for site in SITES:
        jwks += generate_keys(site, party_dir(root / "keys", site)).jwks["keys"]
    data = {"keys": jwks}
    registry = Registry.from_jwks(data, "bench")
    grants = Grants.from_registry(data, registry)
    kid, key = load_signing_key(party_dir(root / "keys", "site-1"), "site-1")
    method = "jobs/fetch/site-1-worker"
    n = 2000
    results: dict[str, list[float]] = {}
    for _ in range(5):
        started = time.perf_counter()
        tokens = [sign_worker_token(key, kid, site="site-1", worker="site-1-worker", method=method) for _ in range(n)]
        results.setdefault("sign a token (worker)", []).append((time.perf_counter() - started) / n)
        started = time.perf_counter()
        for token in tokens:
            claims = verify_worker_token(token, registry)
            check_worker_call("POST", method, {"queues": ["site-1"]}, claims, grants, lambda k: None)
        results.setdefault("verify + the guard's rule (api-server)", []).append((time.perf_counter() - started) / n)
    table = Table(
        f"One worker API call's check, in-process, median of 5 x {n} calls (µs)", ["step", "µs per call", "runs"]
    )
    for step, values in results.items():
        us = [v * 1e6 for v in values]
        table.add(step, f"{median(us):.0f}", spread(us, "{:.0f}"))
    table.notes.append(
        "A worker makes about one call per second (its job poll) plus a heartbeat; edge3 verifies the same "
        "token once more (PyJWT) and, for state and log pushes, the guard reads the job's row (one indexed query)."
    )
    return table


def run(*, reps: int, keep: bool, tmp_base: str | None) -> list[Table]:
    sys.path.insert(0, str(REPO))
    root = Path(tempfile.mkdtemp(prefix="flare-bench-edge-trust-", dir=tmp_base))
    try:
        return [rounds_table(reps, root / "rounds"), check_table(root / "check")]
    finally:
        if not keep:
            with contextlib.suppress(OSError):
                shutil.rmtree(root)
