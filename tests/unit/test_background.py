"""`make test`'s background steps (flare_airflow_testing/background.py) with a real make on a small
Makefile: the foreground overlaps them, a failed step fails the run with its log, a test waiting on a
step sees its failure, and nothing is left running."""

from __future__ import annotations

import os
import pathlib
import sys
import textwrap
import time

import pytest

from flare_airflow_testing import background

MAKEFILE = """\
slow:
\t@echo slow started; echo $$$$ > {pids}/slow.pid; sleep {sleep}; echo slow done
broken:
\t@echo compiling the control plane; echo 'error: no space left on device'; exit 3
"""


@pytest.fixture
def project(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    (tmp_path / "pids").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_makefile(project: pathlib.Path, sleep: float) -> None:
    (project / "Makefile").write_text(MAKEFILE.format(pids=project / "pids", sleep=sleep))


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_the_foreground_runs_while_the_step_runs_and_waits_for_it(project: pathlib.Path, capsys) -> None:
    write_makefile(project, sleep=2)
    # The foreground sees the step running (no status yet) and the directory in its environment.
    probe = python(
        f"""
        import os, pathlib, sys
        d = pathlib.Path(os.environ["{background.ENV}"])
        sys.exit(0 if (d / "slow.log").exists() and not (d / "slow.rc").exists() else 5)
        """
    )
    started = time.monotonic()
    code = background.run(["slow"], probe, project / "bg")
    assert code == 0
    assert time.monotonic() - started >= 2  # it waited for the step
    assert (project / "bg" / "slow.rc").read_text() == "0\n"
    assert "slow done" in (project / "bg" / "slow.log").read_text()
    assert "make slow took" in capsys.readouterr().out


def test_a_failed_step_fails_a_passing_run_and_shows_its_log(project: pathlib.Path, capsys) -> None:
    write_makefile(project, sleep=0)
    code = background.run(["broken"], python("pass"), project / "bg")
    assert code == 1
    err = capsys.readouterr().err
    assert "make broken failed (exit 2)" in err  # make's own status for a recipe that failed
    assert "error: no space left on device" in err


def test_wait_for_raises_with_the_steps_log(project: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_makefile(project, sleep=0)
    # A test in the foreground asks for the failed step's product.
    waiter = python(
        """
        from flare_airflow_testing import background
        try:
            background.wait_for("broken", timeout=60)
        except background.BackgroundStepFailed as exc:
            print(exc)
            raise SystemExit(7)
        """
    )
    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(background.__file__).parents[1]))
    code = background.run(["broken"], waiter, project / "bg")
    assert code == 7


def test_wait_for_returns_at_once_outside_make_test(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(background.ENV, raising=False)
    started = time.monotonic()
    background.wait_for("control-plane", timeout=0)
    assert time.monotonic() - started < 1


def test_a_failed_foreground_ends_the_running_step_and_everything_it_started(project: pathlib.Path) -> None:
    write_makefile(project, sleep=300)
    wait_for_pid = python(
        f"""
        import pathlib, time
        pid = pathlib.Path("{project}/pids/slow.pid")
        while not pid.exists() or not pid.read_text().strip():
            time.sleep(0.05)
        stat = pathlib.Path(f"/proc/{{pid.read_text().strip()}}/stat").read_text()
        nice = int(stat.rsplit(")", 1)[1].split()[16])
        raise SystemExit(4 if nice == {background.NICENESS} else 6)  # the step runs below the tests
        """
    )
    code = background.run(["slow"], wait_for_pid, project / "bg")
    assert code == 4  # the foreground's own status (6: the step was not niced)
    shell = int((project / "pids" / "slow.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(shell) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(shell), "the step's recipe (and its sleep) outlived the run"
    assert not sleeps_in(project), "the step's sleep outlived the run"


def sleeps_in(project: pathlib.Path) -> list[int]:
    """Live ``sleep`` processes started in ``project`` (this test's own directory)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if cmdline.startswith(b"sleep\0") and cwd == str(project) and alive(int(entry)):
            found.append(int(entry))
    return found


def test_main_leaves_no_directory_of_its_own_after_a_passing_run_and_keeps_a_failed_ones(
    project: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``make test`` runs it without --dir: its temporary directory would pile up in /tmp run after
    run; a failed run keeps it, for the logs whose path it printed."""
    write_makefile(project, sleep=0)
    monkeypatch.setenv("TMPDIR", str(project / "tmp"))
    (project / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert background.main(["--make", "slow", "--", sys.executable, "-c", "pass"]) == 0
    assert list((project / "tmp").iterdir()) == []
    assert background.main(["--make", "broken", "--", sys.executable, "-c", "pass"]) == 1
    (kept,) = (project / "tmp").iterdir()
    assert (kept / "broken.log").exists()


def test_modules_using_a_background_product_run_last_and_whole() -> None:
    from types import SimpleNamespace

    from flare_airflow_testing.side_venvs import lm_venv

    plain, lm_module = SimpleNamespace(), SimpleNamespace(lm_venv=lm_venv)

    def item(nodeid: str, *fixtures: str, module: object = plain) -> SimpleNamespace:
        return SimpleNamespace(nodeid=nodeid, fixturenames=("tmp_path", *fixtures), module=module)

    items = [
        item("tests/e2e/test_k8s.py::a", "control_plane"),
        item("tests/e2e/test_k8s.py::b"),  # a module is never split: its stack starts once
        item("tests/e2e/test_containers.py::a", "trainer_image"),
        item("tests/integration/test_images.py::a", "images"),
        item("tests/e2e/test_lm.py::a", module=lm_module),
        item("tests/unit/test_small.py::a"),
        item("tests/unit/test_big.py::a"),
        item("tests/unit/test_big.py::b"),
    ]
    ordered = [i.nodeid for i in background.background_last(items)]  # type: ignore[arg-type]
    assert ordered[:3] == ["tests/unit/test_big.py::a", "tests/unit/test_big.py::b", "tests/unit/test_small.py::a"]
    # Then the modules that wait for a short step (images, the LM environment), the control plane's last.
    assert set(ordered[3:6]) == {
        "tests/e2e/test_containers.py::a",
        "tests/integration/test_images.py::a",
        "tests/e2e/test_lm.py::a",
    }
    assert ordered[6:] == ["tests/e2e/test_k8s.py::a", "tests/e2e/test_k8s.py::b"]
