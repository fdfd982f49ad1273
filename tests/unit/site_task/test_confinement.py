"""Process trainers confined by bubblewrap (issue 28): real bwrap, real trainer processes.

Each test runs the site runner (``run_site`` or ``python -m flare_airflow.site_task``) on a small
store; a confined trainer may write only its output directory and a private /tmp, cannot touch its
input global model, has no network when the policy says so, and leaves nothing running however
its job ends. The opt-out (``mode: off``) restores the unconfined behaviour.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid

import pytest

from flare_airflow.core.spec import JobReturnCode as RC
from flare_airflow.launchers.process import ProcessLauncher
from flare_airflow.launchers.process.launcher import sweep_scratch
from flare_airflow.site_task.runner import run_site
from flare_airflow.site_task.spec import SPEC_ENV, SiteRun

PY = sys.executable
REPO = pathlib.Path(__file__).resolve().parents[3]

PROBE = """
import errno, json, os, sys, pathlib
import flare_airflow.client as flare
m = flare.receive()
out = pathlib.Path(os.environ["FLARE_OUTPUT"]).parent
results = {}
def attempt(name, path):
    try:
        with open(path, "ab") as fh:
            fh.write(b"x")
        results[name] = "written"
    except OSError as exc:
        results[name] = errno.errorcode.get(exc.errno, str(exc.errno))
attempt("outside", os.path.join(os.path.dirname(os.path.abspath(__file__)), "pwned"))
attempt("global", os.environ["FLARE_GLOBAL_MODEL"])
attempt("store_root", os.path.join(os.environ["STORE_ROOT"], "pwned"))
attempt("own_dir", str(out / "scratch"))
attempt("tmp", "/tmp/" + os.environ["MARK"])
results["openblas"] = os.environ.get("OPENBLAS_NUM_THREADS")
results["pid"] = os.getpid()
print("RESULTS " + json.dumps(results), flush=True)
flare.send(flare.FLModel(params=m.params, meta={"num_samples": 1}))
"""


@pytest.fixture
def site(tmp_path: pathlib.Path, global_model: pathlib.Path, write_script):
    """A site run of a script: ``make(script_source, **SiteRun fields) -> (SiteRun, output)``."""
    store = global_model.parents[2]  # .../store/demo/run/round-0000/global.safetensors -> store/demo/run
    mark = f"flare-i28-{uuid.uuid4().hex[:12]}"

    def make(source: str, **kw) -> SiteRun:
        script = write_script("trainer.py", source)
        fields = {
            "job": "demo", "run_id": "run", "round": 1, "total_rounds": 1, "site": "site-1", "task": "train",
            "argv": [PY, str(script)], "global_model": str(global_model),
            "output": str(store / "round-0001" / "sites" / "site-1.safetensors"),
            "staging": str(store / "round-0001" / "staging" / "site-1" / "try-1" / "update.safetensors"),
            "env": {"STORE_ROOT": str(store), "MARK": mark}, "shutdown_timeout": 3.0,
        }  # fmt: skip
        fields.update(kw)
        return SiteRun(**fields)  # type: ignore[arg-type]

    make.mark = mark  # type: ignore[attr-defined]
    make.store = store  # type: ignore[attr-defined]
    return make


def _results(lines: list[str]) -> dict:
    (line,) = [x for x in lines if "RESULTS " in x]
    return json.loads(line.split("RESULTS ", 1)[1])


def _marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``MARK=<mark>`` (the trainer's, wherever they moved)."""
    needle = f"MARK={mark}".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if needle in pathlib.Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                    stat = pathlib.Path(f"/proc/{name}/stat").read_text()
                    if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                        found.append(int(name))
    return found


def test_a_confined_trainer_writes_only_its_output_and_a_private_tmp(site, monkeypatch, global_model) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    before = global_model.read_bytes()
    lines: list[str] = []
    rc, summary = run_site(site(PROBE), ProcessLauncher(sink=lines.append), handle_signals=False)
    assert rc is RC.SUCCESS, summary
    got = _results(lines)
    assert got["outside"] == "EROFS" and got["global"] == "EROFS" and got["store_root"] == "EROFS", got
    assert got["own_dir"] == "written" and got["tmp"] == "written", got
    assert got["openblas"] == "3", "the worker's OPENBLAS_* reach the trainer unchanged"
    assert got["pid"] == 2, "the trainer has its own PID namespace (bwrap's init is 1)"
    assert not pathlib.Path("/tmp", site.mark).exists(), "the trainer's /tmp is private"
    assert not (site.store / "pwned").exists() and global_model.read_bytes() == before


def test_the_opt_out_restores_the_unconfined_trainer(site, global_model) -> None:
    lines: list[str] = []
    run = site(PROBE.replace('attempt("global"', 'results["global"] = "skipped"  #'), confinement={"mode": "off"})
    rc, summary = run_site(run, ProcessLauncher(sink=lines.append), handle_signals=False)
    assert rc is RC.SUCCESS, summary
    got = _results(lines)
    assert got["outside"] == "written" and got["store_root"] == "written" and got["pid"] != 2, got
    assert (site.store / "pwned").exists()
    with contextlib.suppress(FileNotFoundError):
        pathlib.Path("/tmp", site.mark).unlink()


def _listener() -> tuple[socket.socket, list[bool]]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(20)
    accepted: list[bool] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            accepted.append(True)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server, accepted


CONNECT = """
import os, socket
import flare_airflow.client as flare
m = flare.receive()
socket.create_connection(("127.0.0.1", int(os.environ["PORT"])), timeout=10).close()
flare.send(flare.FLModel(params=m.params, meta={"num_samples": 1}))
"""


@pytest.mark.parametrize("network", [True, False])
def test_network_is_the_site_policys(site, network: bool) -> None:
    server, accepted = _listener()
    try:
        port = str(server.getsockname()[1])
        run = site(CONNECT, confinement={"network": network})
        run.env["PORT"] = port
        rc, result = run_site(run, ProcessLauncher(sink=lambda _l: None), handle_signals=False)
    finally:
        server.close()
    if network:
        assert rc is RC.SUCCESS and accepted == [True], result
    else:  # its own loopback: nobody listens there
        assert rc is RC.EXECUTION_ERROR and "ConnectionRefusedError" in str(result) and not accepted, result


def test_required_on_a_host_without_bwrap_refuses_auto_warns(site, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # a worker without bubblewrap
    ok = (
        "import flare_airflow.client as f\nm = f.receive()\n"
        "f.send(f.FLModel(params=m.params, meta={'num_samples': 1}))\n"
    )
    rc, result = run_site(site(ok, confinement={"mode": "required"}), ProcessLauncher(), handle_signals=False)
    assert rc is RC.INFRASTRUCTURE_ERROR
    assert "the site policy requires confined trainers (confinement.mode: required)" in str(result)
    assert "bubblewrap (bwrap) is not installed on this host" in str(result)
    said: list[str] = []
    monkeypatch.setattr("builtins.print", lambda *a, **_k: said.append(" ".join(map(str, a))))
    rc, summary = run_site(site(ok), ProcessLauncher(sink=lambda _l: None), handle_signals=False)
    assert rc is RC.SUCCESS, summary
    assert any("WARNING: site site-1 round 1: the trainer is NOT confined" in s for s in said), said


GRACEFUL = """
import os, signal, subprocess, sys, time, pathlib
import flare_airflow.client as flare
flare.receive()
out = pathlib.Path(os.environ["FLARE_OUTPUT"]).parent
def bye(*_):
    (out / "graceful").write_text("yes")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
# A daemon that leaves the trainer's session: it must end with the job all the same.
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(1000)"])
(out / "started").write_text("yes")
time.sleep(1000)
"""


def test_terminate_gives_the_confined_trainer_its_grace_and_leaves_nothing(site, wait) -> None:
    run = site(GRACEFUL)
    handles: list = []
    done: list = []
    thread = threading.Thread(
        target=lambda: done.append(
            run_site(run, ProcessLauncher(sink=lambda _l: None), handle_signals=False, on_launch=handles.append)
        )
    )
    thread.start()
    staging = pathlib.Path(run.staging).parent
    assert wait(lambda: (staging / "started").exists(), 30), "the trainer did not start"
    assert len(_marked(site.mark)) >= 3  # bwrap's init, the trainer, its daemon
    handles[0].terminate()
    thread.join(30)
    assert done and done[0][0] is RC.ABORTED, done
    assert (staging / "graceful").read_text() == "yes", "SIGTERM reached the trainer before any SIGKILL"
    assert wait(lambda: not _marked(site.mark), 5), f"left running: {_marked(site.mark)}"


def test_kill_9_of_the_site_runner_leaves_nothing_running(site, wait, kill_on_exit) -> None:
    run = site(GRACEFUL)
    # A temporary directory of the runner's own (a sticky, world-writable one, as /tmp is): any other
    # launch on this host (another test, another pytest worker) sweeps dead runners' scratch in /tmp.
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="flare-kill9-tmp-"))
    scratch.chmod(0o1777)
    env = {k: v for k, v in os.environ.items() if k != SPEC_ENV}
    env[SPEC_ENV] = run.to_json()
    env["TMPDIR"] = str(scratch)
    proc = subprocess.Popen([PY, "-m", "flare_airflow.site_task"], env=env, stdout=subprocess.DEVNULL)
    kill_on_exit(proc.pid)
    staging = pathlib.Path(run.staging).parent
    assert wait(lambda: (staging / "started").exists(), 30), "the trainer did not start"
    running = _marked(site.mark)
    assert len(running) >= 3
    for pid in running:
        kill_on_exit(pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert wait(lambda: not _marked(site.mark), 5), f"left running after kill -9: {_marked(site.mark)}"
    assert not (staging / "graceful").exists(), "kill -9 gives no grace: the namespace is SIGKILLed"
    # The killed runner cleaned up nothing; the next launch on this host removes its scratch.
    left = list(scratch.glob(f"flare-sandbox-{proc.pid}-*"))
    assert len(left) == 1, left
    assert left[0] in sweep_scratch(str(scratch))
    assert not left[0].exists()
    shutil.rmtree(scratch, ignore_errors=True)


def test_the_digits_update_is_bitwise_identical_confined_or_not(site, tmp_path) -> None:
    from safetensors.numpy import load_file

    from flare_airflow.core.model import FLModel, write_artifact

    params = load_file(str(REPO / "examples" / "digits" / "initial_model.safetensors"))
    trainer = REPO / "examples" / "digits" / "trainer.py"
    updates = {}
    for mode in ("auto", "off"):
        store = tmp_path / mode
        glob_model = store / "round-0000" / "global.safetensors"
        write_artifact(glob_model, FLModel(params=dict(params)))
        run = site("", argv=[PY, str(trainer), "--num-sites", "4", "--alpha", "0.5", "--seed", "0"],
                   global_model=str(glob_model), output=str(store / "round-0001" / "sites" / "site-2.safetensors"),
                   staging=str(store / "round-0001" / "staging" / "site-2" / "try-1" / "update.safetensors"),
                   site="site-2", hparams={"lr": 0.5, "local_epochs": 2, "batch_size": 16},
                   confinement={"mode": mode})  # fmt: skip
        rc, summary = run_site(run, ProcessLauncher(sink=lambda _l: None), handle_signals=False)
        assert rc is RC.SUCCESS, summary
        updates[mode] = pathlib.Path(run.output).read_bytes()
    assert updates["auto"] == updates["off"], "confinement changed the digits update"


HOSTILE = """
import ctypes, errno, json, os, pathlib, socket, subprocess
import flare_airflow.client as flare
m = flare.receive()
libc = ctypes.CDLL(None, use_errno=True)
results = {}
def err(rc):
    return "ok" if rc == 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def run(argv):
    out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    return [out.returncode, out.stdout.strip(), out.stderr.strip()]
status = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines())
results["ids"] = [os.getuid(), os.geteuid(), os.getgid()]
results["cap_eff"] = status["CapEff"].strip()
results["no_new_privs"] = status["NoNewPrivs"].strip()
results["mount_cmd"] = run(["mount", "-o", "remount,bind,rw", "/"])[0]
MS_REMOUNT, MS_BIND = 32, 4096
results["mount_syscall"] = err(libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND, None))
try:
    pathlib.Path(os.environ["STORE_ROOT"], "pwned").write_text("x")
    results["write_store"] = "written"
except OSError as exc:
    results["write_store"] = errno.errorcode[exc.errno]
# unshare(2) from a single-threaded process (the client's threads would make it EINVAL)
for name in ("user", "mount", "net", "pid"):
    results["unshare_" + name] = run(["unshare", "--" + name, "true"])[::2]
results["su"] = run(["su", "-c", "id -u", "root"])[:2]
results["setuid_copy"] = run([os.environ["SETUID_ID"], "-u"])[:2]
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
    results["raw_socket"] = "ok"
except OSError as exc:
    results["raw_socket"] = errno.errorcode[exc.errno]
PTRACE_ATTACH = 16
results["ptrace_parent"] = err(libc.ptrace(PTRACE_ATTACH, os.getppid(), None, None))
results["ptrace_worker"] = err(libc.ptrace(PTRACE_ATTACH, int(os.environ["WORKER_PID"]), None, None))
print("RESULTS " + json.dumps(results), flush=True)
flare.send(flare.FLModel(params=m.params, meta={"num_samples": 1}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker must run as root: where bwrap used to keep every capability")
def test_a_hostile_trainer_under_a_root_worker_gains_no_privilege(site, global_model, tmp_path) -> None:
    """Issue 35: bwrap started by root kept every capability, so a trainer could remount / read-write."""
    setuid_id = tmp_path / "setuid-bin" / "id"
    setuid_id.parent.mkdir()
    shutil.copy2("/usr/bin/id", setuid_id)
    os.chown(setuid_id, 0, 0)
    setuid_id.chmod(0o4755)
    before = global_model.read_bytes()
    lines: list[str] = []
    run = site(HOSTILE)
    run.env.update({"SETUID_ID": str(setuid_id), "WORKER_PID": str(os.getpid())})
    rc, summary = run_site(run, ProcessLauncher(sink=lines.append), handle_signals=False)
    assert rc is RC.SUCCESS, (summary, lines[-20:])
    got = _results(lines)
    assert got["ids"] == [65534, 65534, 65534], "the trainer is nobody in its user namespace, not root"
    assert got["cap_eff"] == "0000000000000000" and got["no_new_privs"] == "1", got
    assert got["mount_cmd"] != 0 and got["mount_syscall"] == "EPERM", got
    assert got["write_store"] == "EROFS", got
    # --disable-userns: no nested user namespace (its limit is reached: ENOSPC); no other without a capability
    assert got["unshare_user"] == [1, "unshare: unshare failed: No space left on device"], got
    for kind in ("mount", "net", "pid"):
        assert got[f"unshare_{kind}"] == [1, "unshare: unshare failed: Operation not permitted"], got
    assert got["su"][0] != 0 and got["su"][1] != "0", got
    assert got["setuid_copy"] == [0, "65534"], "a setuid-root binary gives no root (nosuid, no-new-privs)"
    assert got["raw_socket"] == "EPERM", got
    assert got["ptrace_parent"] == "EPERM", "seccomp: no ptrace, even of bwrap's init in the sandbox"
    assert got["ptrace_worker"] in ("ESRCH", "EPERM"), "the worker is outside the trainer's PID namespace"
    assert not (site.store / "pwned").exists() and global_model.read_bytes() == before
    published = pathlib.Path(run.output)
    assert published.stat().st_uid == os.getuid(), "the update is the worker's file, as before confinement"
