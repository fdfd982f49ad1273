"""Bad-input battery, category "trainer": trainers that crash, lie, hang, escape or flood.

Each case runs a real trainer process through the site runner (``run_site``) against a small
global model in a fresh store. A case passes when the user is told what happened (``assert_clear``
on the returned reason), and, for every failure, no update and no record exist at the site's
published place while the failure record does -- nothing a failed job leaves can be counted.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import textwrap

import numpy as np
import pytest

from flare_airflow.core.failure_record import read_failure
from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import failure_path, record_path
from flare_airflow.launchers.process import ProcessLauncher
from flare_airflow.site_task.runner import run_site
from flare_airflow.site_task.spec import SiteRun
from tests.bad_inputs.cases import Case, assert_clear

PY = sys.executable

PRELUDE = """
import json, os, signal, subprocess, sys, time
import numpy as np
import flare_airflow.client as flare

def ok_params(model):
    return {k: v + 1 for k, v in model.params.items()}

def send(params=None, **meta):
    model = flare.receive()
    flare.send(flare.FLModel(params=ok_params(model) if params is None else params, meta=meta or {"num_samples": 4}))
"""


def _c(id: str, bad: str, error: str, body: str, **run: object) -> tuple[Case, str, dict[str, object]]:
    return Case(id, "trainer", bad, error), textwrap.dedent(body), run


W = "np.ones((2, 3), np.float32)"
B = "np.zeros(3, np.float32)"
RAW: list[tuple[Case, str, dict[str, object]]] = [
    _c("trainer-crashes-with-traceback", "raises ZeroDivisionError before receive()",
       "trainer failed: exit code 1; its last output: ZeroDivisionError: division by zero", "1 / 0"),
    _c("trainer-crashes-after-receive", "raises after receive(), before send()",
       "its last output: RuntimeError: out of data", "flare.receive(); raise RuntimeError('out of data')"),
    _c("trainer-exits-nonzero-after-send", "calls send() then exits 3",
       "trainer failed: exit code 3", "send(); sys.exit(3)"),
    _c("trainer-sends-twice", "calls send() twice for one receive()",
       "send() called twice for one receive()", "send(); flare.send(flare.FLModel(params={'w': 1}))"),
    _c("trainer-never-sends", "exits 0 without calling send()",
       "sent no update (did it call flare.send()?)", "flare.receive()"),
    _c("trainer-never-receives", "exits 0 without receive() or send()",
       "sent no update", "pass"),
    _c("trainer-send-before-receive", "calls send() before receive()",
       "send() called before receive()", "flare.send(flare.FLModel(params={'w': np.zeros(1)}))"),
    _c("trainer-wrong-shape", "sends w with shape (3, 3) instead of (2, 3)",
       "shape (3, 3)", f"send({{'w': np.zeros((3, 3), np.float32), 'b': {B}}})"),
    _c("trainer-wrong-dtype", "sends w as float64 instead of float32",
       "dtype float64", f"send({{'w': np.ones((2, 3)), 'b': {B}}})"),
    _c("trainer-missing-tensor", "sends only w (b missing)",
       "'b'", f"send({{'w': {W}}})"),
    _c("trainer-extra-tensor", "sends an extra tensor",
       "'extra'", f"send({{'w': {W}, 'b': {B}, 'extra': np.zeros(1, np.float32)}})"),
    _c("trainer-renamed-tensor", "sends weight instead of w",
       "'weight'", f"send({{'weight': {W}, 'b': {B}}})"),
    _c("trainer-sends-nan", "sends NaN weights",
       "NaN", f"send({{'w': np.full((2, 3), np.nan, np.float32), 'b': {B}}})"),
    _c("trainer-sends-inf", "sends +inf weights",
       "inf", f"send({{'w': np.full((2, 3), np.inf, np.float32), 'b': {B}}})"),
    _c("trainer-huge-num-samples", "num_samples = 10**400",
       "num_samples", "send(num_samples=10**400)"),
    _c("trainer-negative-num-samples", "num_samples = -5",
       "num_samples", "send(num_samples=-5)"),
    _c("trainer-zero-num-samples", "num_samples = 0",
       "num_samples", "send(num_samples=0)"),
    _c("trainer-float-num-samples", "num_samples = 2.5",
       "num_samples", "send(num_samples=2.5)"),
    _c("trainer-string-num-samples", "num_samples = 'many'",
       "num_samples", "send(num_samples='many')"),
    _c("trainer-nan-metric", "a metric that is NaN",
       "loss", "m = flare.receive(); flare.send(flare.FLModel(params=ok_params(m), metrics={'loss': float('nan')}))"),
    _c("trainer-non-numeric-metric", "a metric that is a string",
       "accuracy", "m = flare.receive(); flare.send(flare.FLModel(params=ok_params(m), metrics={'accuracy': 'high'}))"),
    _c("trainer-huge-metric-name", "a metric whose name is 2 MB long",
       "metric name 'xxxxx", "m = flare.receive(); flare.send(flare.FLModel(params=ok_params(m), "
       "metrics={'x' * 2_000_000: 1.0}))"),
    _c("trainer-too-many-metrics", "1000 metrics in one update",
       "1000 metrics, more than the 64 an update may report",
       "m = flare.receive(); flare.send(flare.FLModel(params=ok_params(m), "
       "metrics={f'm{i}': 1.0 for i in range(1000)}))"),
    _c("trainer-metric-name-newline", "a metric name with a newline (a forged log line)",
       "has control characters", "m = flare.receive(); flare.send(flare.FLModel(params=ok_params(m), "
       "metrics={'loss\\nERROR site-2 failed': 1.0}))"),
    _c("trainer-record-claims-huge-size", "rewrites its update's record to claim 10^12 bytes after send()",
       "record says 1000000000000; the file is truncated or its record is wrong",
       "send(); p = os.environ['FLARE_OUTPUT'].removesuffix('.safetensors') + '.json'\n"
       "r = json.load(open(p)); r['size'] = 10**12; json.dump(r, open(p, 'w'))"),
    _c("trainer-sends-no-params", "send() with metrics only in a train task",
       "needs params", "flare.receive(); flare.send(flare.FLModel(metrics={'loss': 1.0}))"),
    _c("trainer-overwrites-global-model", "writes garbage over FLARE_GLOBAL_MODEL, then sends (confined)",
       "its input global model is read-only", "send(); open(os.environ['FLARE_GLOBAL_MODEL'], 'wb').write(b'garbage')"),
    _c("trainer-overwrites-global-model-unconfined", "the same with the site's confinement mode off",
       "the trainer changed or removed its input global model",
       "send(); open(os.environ['FLARE_GLOBAL_MODEL'], 'wb').write(b'garbage')", confinement={"mode": "off"}),
    _c("trainer-writes-outside-staging", "writes a file next to its own script (confined)",
       "the trainer is confined: it may write only", "flare.receive(); open(__file__ + '.pwned', 'w').write('x')"),
    _c("trainer-writes-store-root", "writes a file at the model store's root (confined)",
       "the trainer is confined: it may write only",
       "flare.receive(); open(os.path.join(os.environ['STORE_ROOT'], 'pwned'), 'w').write('x')"),
    _c("trainer-opens-socket-without-network", "connects out while the site policy says network: false",
       "confined without network (the site policy's confinement.network: false)",
       "flare.receive(); import socket; socket.create_connection(('192.0.2.1', 80), timeout=10)",
       confinement={"network": False}),
    _c("trainer-writes-published-place", "writes a fake update at the published place, sends nothing",
       "the trainer is confined: it may write only",
       "flare.receive(); m = flare.FLModel(params={'w': np.ones((2, 3), np.float32), "
       "'b': np.zeros(3, np.float32)}, meta={'num_samples': 1})\n"
       "import pathlib; from flare_airflow.core.model import write_artifact\n"
       "write_artifact(pathlib.Path(os.environ['PUBLISHED']), m)"),
    _c("trainer-hangs-past-launch-timeout", "never calls receive(); launch_timeout 0.5 s",
       "did not call receive() within launch_timeout=0.5s", "time.sleep(1000)", launch_timeout=0.5),
    _c("trainer-ignores-sigterm", "ignores SIGTERM and hangs before receive(); launch_timeout 0.3 s",
       "did not call receive() within launch_timeout=0.3s",
       "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)", launch_timeout=0.3, shutdown_timeout=0.5),
    _c("trainer-setsid-child-then-fails", "starts a setsid child, then exits 5 (unconfined: its pid is the host's)",
       "trainer failed: exit code 5",
       "p = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(1000)'])\n"
       "open(os.environ['PIDS'], 'w').write(str(p.pid)); time.sleep(0.3); sys.exit(5)", confinement={"mode": "off"}),
    _c("trainer-floods-output", "prints 4 MB of output, then crashes",
       "its last output: the end", "sys.stdout.write(('x' * 1000 + '\\n') * 4000); print('the end'); sys.exit(2)"),
    _c("trainer-killed-by-signal", "kills itself with SIGSEGV",
       "killed by SIGSEGV", "os.kill(os.getpid(), signal.SIGSEGV)"),
    _c("trainer-sigkilled", "is SIGKILLed (as by the OOM killer)",
       "possibly the out-of-memory killer", "os.kill(os.getpid(), signal.SIGKILL)"),
    _c("trainer-exit-code-config-error", "exits 103 (its own config check failed)",
       "exit code 103 (CONFIG_ERROR)", "sys.exit(103)"),
    _c("trainer-pickle-instead-of-safetensors", "replaces its update with a pickle after send()",
       "", "send(); import pickle; open(os.environ['FLARE_OUTPUT'], 'wb').write(pickle.dumps({'w': 1}))"),
]  # fmt: skip

CASES = [case for case, _, _ in RAW]
BODIES = {case.id: (body, run) for case, body, run in RAW}


@pytest.fixture
def store(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "store"
    write_artifact(
        root / "round-0000" / "global.safetensors",
        FLModel(params={"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}),
    )
    write_artifact(root / "round-0001" / "sites" / "site-2.safetensors", FLModel(params={"w": np.ones(1)}))
    return root


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_trainer_case(case: Case, store: pathlib.Path, tmp_path: pathlib.Path) -> None:
    body, extra = BODIES[case.id]
    script = tmp_path / "trainer.py"
    script.write_text(PRELUDE + body + "\n")
    global_model = store / "round-0000" / "global.safetensors"
    output = store / "round-0001" / "sites" / "site-1.safetensors"
    other = store / "round-0001" / "sites" / "site-2.safetensors"
    other_bytes = other.read_bytes()
    pids = tmp_path / "pids"
    fields: dict[str, object] = {
        "job": "demo", "run_id": "r", "round": 1, "total_rounds": 1, "site": "site-1", "task": "train",
        "argv": [PY, str(script)], "global_model": str(global_model), "output": str(output),
        "staging": str(store / "round-0001" / "staging" / "site-1" / "try-1" / "update.safetensors"),
        "env": {"OTHER_SITE": str(other), "PUBLISHED": str(output), "PIDS": str(pids), "STORE_ROOT": str(store)},
        "shutdown_timeout": 2.0,
    }  # fmt: skip
    fields.update(extra)
    lines: list[str] = []
    rc, result = run_site(SiteRun(**fields), ProcessLauncher(sink=lines.append), handle_signals=False)  # type: ignore[arg-type]
    if case.id == "trainer-pickle-instead-of-safetensors":
        # The update file no longer matches what send() recorded: refused, whatever the wording.
        assert rc is not JobReturnCode.SUCCESS
        assert isinstance(result, str) and "Traceback (most recent call last)" not in result
    else:
        assert rc is not JobReturnCode.SUCCESS, f"{case.id}: accepted: {result}"
        assert isinstance(result, str)
        assert_clear(case, result)
    assert not output.exists() and not record_path(output).exists(), "a failed job left an update"
    assert failure_path(output).exists() and read_failure(output)
    assert other.read_bytes() == other_bytes
    assert not (store / "pwned").exists() and not script.with_name("trainer.py.pwned").exists()
    if pids.exists():
        pid = int(pids.read_text())
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), "the trainer's setsid child outlived the job"
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True
