"""A Kubernetes site's secret reaches its trainer and nothing else (real control plane, the LOCAL NODE
AGENT test harness playing the kubelet).

The site names a key of a Kubernetes Secret in ``secret_env``; the Secret holds a random canary.
The site task runs as Airflow runs it (deferrable ``SitePodOperator``: execute, the pod-state
trigger, re-entry). The trainer proves it received the value by sending a metric derived from its
sha256; the canary must appear in no pod spec (the API's stored pod has only
``valueFrom.secretKeyRef``), no process's argv on the machine while the pod runs, no XCom or summary,
no task log line (the operator's own log and the pod's log it relays), and no file of the model store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import secrets
import threading
from typing import Any

import pytest
from kubernetes import client as k8s

from flare_airflow.launchers.kubernetes import pod_to_dict
from flare_airflow_testing.k8s.kube import wait_for
from tests.integration.k8s.test_site_pod_operator import context_for, make_op, run_deferred

SECRET, KEY, VARIABLE = "fl-canary", "token", "FL_CANARY"

TRAINER = """\
import hashlib, os, pathlib, sys, time

import flare_airflow.client as flare

ready, release = sys.argv[1:3]
model = flare.receive()
value = os.environ["FL_CANARY"]
digest = hashlib.sha256(value.encode()).hexdigest()
print(f"trainer received a secret of {len(value)} characters", flush=True)
pathlib.Path(ready).write_text(str(os.getpid()))
while not os.path.exists(release):
    time.sleep(0.05)
flare.send(
    flare.FLModel(
        params={k: v + 1 for k, v in model.params.items()},
        metrics={"canary_sha256_48": int(digest[:12], 16)},
        meta={"num_samples": 3},
    )
)
"""


def _argvs() -> dict[int, bytes]:
    """Every process's argv on this machine (NUL-separated, as the kernel keeps it)."""
    out = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:  # ended meanwhile
                continue
    return out


def _files_containing(root: pathlib.Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_a_secret_canary_reaches_the_trainer_and_nothing_else(
    tmp_path: pathlib.Path,
    control_plane: Any,
    node_agent: Any,
    namespace: str,
    core: k8s.CoreV1Api,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    canary = f"canary-{secrets.token_hex(16)}"
    needle = canary.encode()
    core.create_namespaced_secret(
        namespace, k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=SECRET), string_data={KEY: canary})
    )
    trainer = tmp_path / "canary_trainer.py"
    trainer.write_text(TRAINER)
    ready, release = tmp_path / "ready", tmp_path / "release"
    op, store = make_op(
        tmp_path,
        namespace,
        control_plane.kubeconfig,
        args=[str(ready), str(release)],
        trainer_script=str(trainer),
        secret_env={VARIABLE: {"secret": SECRET, "key": KEY}},
    )
    context = context_for(op)
    pushed: list[Any] = []
    context["ti"].xcom_push = lambda *a, **k: pushed.append((a, k))

    seen: dict[str, Any] = {}

    def while_the_pod_runs() -> None:
        # The trainer waits for `release`: look at the running pod and every process meanwhile.
        try:
            wait_for(ready.exists, 60, what="the trainer is running")
            pid = int(ready.read_text())
            seen["trainer_environ_has_it"] = needle in pathlib.Path(f"/proc/{pid}/environ").read_bytes()
            seen["argv_with_it"] = {p: argv for p, argv in _argvs().items() if needle in argv}
            seen["argv_count"] = len(_argvs())
            (pod,) = core.list_namespaced_pod(namespace).items
            seen["pod"] = pod_to_dict(pod)
        except Exception as exc:  # reported by the main thread
            seen["error"] = repr(exc)
        finally:
            release.write_text("go")

    watcher = threading.Thread(target=while_the_pod_runs, daemon=True)
    watcher.start()
    with caplog.at_level(logging.DEBUG):
        summary = run_deferred(op, context)
    watcher.join(30)
    assert "error" not in seen, seen.get("error")

    # The trainer received exactly the Secret's value ...
    assert seen["trainer_environ_has_it"], "the scan below would prove nothing"
    expected = int(hashlib.sha256(needle).hexdigest()[:12], 16)
    assert summary["metrics"]["canary_sha256_48"] == expected
    # ... through a reference: the stored pod has valueFrom.secretKeyRef and no value.
    pod = seen["pod"]
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env[VARIABLE] == {"name": VARIABLE, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": KEY}}}
    assert canary not in json.dumps(pod)
    # The pod the API accepted is the hardened one: read-only root, and of the store only the
    # input global model's two files (read-only) and this try's staging directory (read-write).
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    store_mounts = [m for m in container["volumeMounts"] if m["name"] == "flare-store"]
    assert len(store_mounts) == 3, store_mounts
    inputs = [m["subPath"].rsplit("/", 2)[-2:] for m in store_mounts if m.get("readOnly")]
    assert sorted(inputs) == [["round-0000", "global.json"], ["round-0000", "global.safetensors"]]
    (output,) = [m for m in store_mounts if not m.get("readOnly")]
    assert "/round-0001/staging/site-1/" in output["subPath"]
    assert canary not in json.dumps(pod_to_dict(op.pod))
    # No process's argv on the machine held it while the trainer ran.
    assert seen["argv_count"] > 10 and seen["argv_with_it"] == {}
    # Not in the summary (the task's XCom) or anything else pushed.
    assert canary not in json.dumps(summary) and canary not in repr(pushed)
    # Not in the task log: the operator's records and the pod log it relays (shown to be captured).
    out, err = capfd.readouterr()
    task_log = caplog.text + out + err
    assert "trainer received a secret of 39 characters" in task_log
    assert canary not in task_log
    # Not in the model store (updates, records, failure records).
    assert any(store.rglob("*.safetensors"))
    assert _files_containing(store, needle) == []
    assert os.environ.get(VARIABLE) is None, "the worker's own environment never gets it"
