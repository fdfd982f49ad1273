"""A new user's first hour, from the docs alone: docs/dag-authors.md "Your own Airflow, your own job folder".

The blocks of that section marked ``<!-- walkthrough: ... -->`` are the test: its files are written
as shown, its shell blocks run as one script, line by line, exactly as written, in a home directory
of its own with a copy of this checkout -- a fresh virtualenv, ``pip install`` (not the Makefile),
``airflow db migrate``, a job folder outside the repository, ``flare-airflow validate``,
``try-trainer``, ``run --dagfile`` with conf overrides, ``report``. Every command's exit status and
every output the section promises are checked, and every task instance's final state.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "dag-authors.md"
_BLOCK = re.compile(r"<!-- walkthrough: (\S+) -->\n```(\w*)\n(.*?)```", re.S)
TIMEOUT = 900


def walkthrough_blocks() -> list[tuple[str, str, str]]:
    """(name, language, text) of each walkthrough block, in the order of the doc."""
    return [(m.group(1), m.group(2), m.group(3)) for m in _BLOCK.finditer(DOC.read_text())]


def copy_checkout(target: pathlib.Path) -> None:
    """The files a clone of this repository has (tracked, plus new ones not ignored), no build output."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = REPO / name
        if src.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target / name)


def clean_env(home: pathlib.Path) -> dict[str, str]:
    """This machine's environment as a new user's shell has it: no Airflow settings, no project venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW", "_AIRFLOW", "VIRTUAL_ENV", "PYTHONPATH", "FLARE_"))
    }
    venv_bin = str(pathlib.Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    # pip's wheel cache of the real home: a second run need not download Airflow again.
    env.setdefault("PIP_CACHE_DIR", str(pathlib.Path.home() / ".cache" / "pip"))
    env["HOME"] = str(home)
    return env


def command_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


class Script:
    """The commands, started in one bash in ``home``; :meth:`results` waits for them."""

    def __init__(self, commands: list[str], home: pathlib.Path) -> None:
        self.commands = commands
        script = ["exec 2>&1"]
        for i, command in enumerate(commands):
            script += [f"echo '@@CMD {i}@@'", command, f'echo "@@RC {i} $?@@"']
        self.proc = subprocess.Popen(
            ["bash", "-c", "\n".join(script)],
            cwd=home,
            env=clean_env(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def results(self) -> list[tuple[str, int, str]]:
        """(command, exit status, its output) for each command."""
        try:
            out, _ = self.proc.communicate(timeout=TIMEOUT)
        finally:
            self.stop()
        results = []
        for i, command in enumerate(self.commands):
            m = re.search(rf"@@CMD {i}@@\n(.*?)@@RC {i} (\d+)@@", out, re.S)
            assert m, f"command {command!r} did not run to its end; output:\n{out[-5000:]}"
            results.append((command, int(m.group(2)), m.group(1)))
        return results

    def stop(self) -> None:
        """Ends the script's whole session if it still runs (a timeout, or a test that never waited)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


def task_states(output: str) -> dict[str, str]:
    """The final states ``flare-airflow run`` prints: ``round_1: global_model=success, hospital-a=...``."""
    states = {}
    for m in re.finditer(r"^\s+(-|round_\d+): (.*)$", output, re.M):
        for pair in m.group(2).split(", "):
            task, _, state = pair.partition("=")
            states[task if m.group(1) == "-" else f"{m.group(1)}.{task}"] = state
    return states


@pytest.fixture(scope="module")
def client_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[pathlib.Path, Script | None]]:
    """docs/trainer-authors.md's install block, as written, in a home of its own: started before the
    walkthrough, so that the two installs run side by side (they share nothing but pip's cache).
    ``None`` when the doc lost the block (the client test fails on that)."""
    text = (REPO / "docs" / "trainer-authors.md").read_text()
    m = re.search(r"<!-- client-install -->\n```bash\n(.*?)```", text, re.S)
    home = tmp_path_factory.mktemp("site-home")
    if not m:
        yield home, None
        return
    copy_checkout(home / "flare-airflow")
    script = Script(command_lines(m.group(1)), home)
    try:
        yield home, script
    finally:
        script.stop()


@pytest.fixture(scope="module")
def walkthrough(
    tmp_path_factory: pytest.TempPathFactory, client_install: tuple[pathlib.Path, Script | None]
) -> dict[str, tuple[int, str]]:
    home = tmp_path_factory.mktemp("new-user-home")
    copy_checkout(home / "flare-airflow")
    commands = []
    for name, lang, text in walkthrough_blocks():
        if lang == "bash":
            commands += command_lines(text)
        else:
            path = home / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    results = Script(commands, home).results()
    return {command: (rc, output) for command, rc, output in results}


def result(walkthrough: dict[str, tuple[int, str]], command: str, rc: int) -> str:
    assert command in walkthrough, f"the walkthrough no longer runs {command!r}; it runs: {list(walkthrough)}"
    code, output = walkthrough[command]
    assert code == rc, f"{command!r} exited {code}, expected {rc}:\n{output[-5000:]}"
    # the trainer's own traceback is its output ("[site rN] ..."); ours would be a bug
    ours = "\n".join(line for line in output.splitlines() if not re.match(r"\[\S+ r\d+\] ", line))
    assert "Traceback (most recent call last)" not in ours, output[-5000:]
    return output


def test_the_walkthrough_has_its_blocks() -> None:
    names = [name for name, _, _ in walkthrough_blocks()]
    assert names == ["install", "my-job/job.yaml", "my-job/trainer.py", "my-job/dag.py", "check", "run", "schedule"]


def test_install_and_setup(walkthrough) -> None:
    for command in ("pip install -q -c flare-airflow/requirements.lock ./flare-airflow", "airflow db migrate"):
        result(walkthrough, command, 0)


def test_validate_and_try_trainer(walkthrough) -> None:
    assert "job 'my-job': 3 rounds, min_clients 2" in result(walkthrough, "flare-airflow validate job.yaml", 0)
    out = result(walkthrough, "flare-airflow try-trainer job.yaml --site hospital-a", 0)
    assert "update accepted: FULL update of 200 sample(s)" in out
    out = result(walkthrough, "flare-airflow try-trainer job.yaml --site hospital-c", 1)
    assert "FAILED [EXECUTION_ERROR]: trainer failed: exit code 1" in out
    assert "RuntimeError: hospital-c: this week's data export is missing" in out


def test_a_run_the_quorum_carries_succeeds_and_names_the_failing_site(walkthrough) -> None:
    out = result(walkthrough, "flare-airflow run flare_my_job --dagfile dag.py", 0)
    states = task_states(out)
    expected = {"prepare": "success", "publish": "success", "verdict": "success"}
    for r in (1, 2, 3):
        expected |= {f"round_{r}.global_model": "success", f"round_{r}.hospital-a": "success"}
        expected |= {f"round_{r}.hospital-b": "success", f"round_{r}.hospital-c": "failed"}
    assert states == expected, out
    assert "site failures the quorum absorbed (the run succeeded without them)" in out
    for r in (1, 2, 3):
        assert (
            f"round_{r}.hospital-c: trainer failed: exit code 1; its last output: "
            "RuntimeError: hospital-c: this week's data export is missing [EXECUTION_ERROR]"
        ) in out
    assert "final model: file://" in out and "metrics.png" in out
    # one log file per task try, in Airflow's own layout (the UI's Logs tab reads them)
    folder = pathlib.Path(re.search(r"task logs \(one file per task try[^)]*\): (\S+)", out).group(1))
    failed = (folder / "task_id=round_1.hospital-c" / "attempt=1.log").read_text()
    assert "RuntimeError: hospital-c: this week's data export is missing" in failed
    healthy = (folder / "task_id=round_1.hospital-a" / "attempt=1.log").read_text()
    assert "starting task_id=round_1.hospital-a " in healthy and "hospital-c" not in healthy
    assert len(list(folder.glob("task_id=*/attempt=1.log"))) == len(states)  # every task ran once


def test_a_conf_asks_for_fewer_rounds(walkthrough) -> None:
    out = result(
        walkthrough, """flare-airflow run flare_my_job --dagfile dag.py --conf '{"rounds": 1, "hp_lr": 0.05}'""", 0
    )
    states = task_states(out)
    assert states["round_1.global_model"] == "success" and states["publish"] == "success"
    assert {states[f"round_{r}.{t}"] for r in (2, 3) for t in ("global_model", "hospital-a", "hospital-c")} == {
        "skipped"
    }


def test_a_run_that_misses_its_quorum_fails_with_the_rounds_reason_first(walkthrough) -> None:
    out = result(walkthrough, """flare-airflow run flare_my_job --dagfile dag.py --conf '{"min_clients": 3}'""", 1)
    states = task_states(out)
    assert states["round_1.global_model"] == "failed" and states["round_1.hospital-c"] == "failed"
    assert states["publish"] == "upstream_failed"
    reasons = [line for line in out.splitlines() if line.startswith("  ") and ": " in line and "=" not in line]
    assert reasons[0].startswith("  round_1.global_model: round 1 failed"), out
    assert "2 valid update(s) from ['hospital-a', 'hospital-b'], min_clients is 3" in reasons[0], reasons[0]
    assert "Failed sites: hospital-c: trainer failed: exit code 1; its last output: RuntimeError" in reasons[0]


def test_report(walkthrough) -> None:
    command = next(c for c in walkthrough if c.startswith("flare-airflow report"))
    out = result(walkthrough, command, 0)
    assert "round | valid sites" in out


def test_the_dags_folder_unpause_and_trigger(walkthrough) -> None:
    result(walkthrough, "airflow dags reserialize", 0)
    assert "flare_my_job" in result(walkthrough, "airflow dags unpause flare_my_job", 0)
    out = result(walkthrough, """airflow dags trigger flare_my_job --conf '{"rounds": 2}'""", 0)
    assert "queued" in out and "flare_my_job" in out
    assert "flare_airflow" in result(walkthrough, "airflow plugins", 0)


def test_the_client_api_installs_and_runs_without_airflow(
    client_install: tuple[pathlib.Path, Script | None], tmp_path: pathlib.Path
) -> None:
    """docs/trainer-authors.md's install block, as written: then a real receive() / send() there."""
    home, script = client_install
    assert script is not None, "docs/trainer-authors.md lost its client-install block"
    for command, rc, output in script.results():
        assert rc == 0, f"{command!r} exited {rc}:\n{output[-3000:]}"
    python = home / "trainer-venv" / "bin" / "python"
    listed = subprocess.run([str(python), "-m", "pip", "list"], capture_output=True, text=True, check=True).stdout
    assert "apache-airflow" not in listed and "pydantic " not in listed, listed
    # a trainer round trip with the Client API alone: a model written by the full package, read and sent there
    import numpy as np

    from flare_airflow.core.model import FLModel, read_artifact, write_artifact

    write_artifact(tmp_path / "global.safetensors", FLModel(params={"w": np.zeros(3, np.float32)}))
    trainer = (
        "import flare_airflow.client as flare, sys\n"
        "m = flare.receive()\n"
        "flare.send(flare.FLModel(params={'w': m.params['w'] + 1}, meta={'num_samples': 7}))\n"
        "assert not any(n == 'airflow' or n.startswith(('airflow.', 'pydantic')) for n in sys.modules)\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "FLARE_JOB": "j",
        "FLARE_RUN_ID": "r",
        "FLARE_SITE": "site-1",
        "FLARE_ROUND": "1",
        "FLARE_TOTAL_ROUNDS": "1",
        "FLARE_TASK": "train",
        "FLARE_GLOBAL_MODEL": str(tmp_path / "global.safetensors"),
        "FLARE_OUTPUT": str(tmp_path / "update.safetensors"),
    }
    out = subprocess.run([str(python), "-c", trainer], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    params, record = read_artifact(tmp_path / "update.safetensors")
    assert params["w"].tolist() == [1.0, 1.0, 1.0] and record.num_samples == 7
