"""``write_task_logs``: an in-process run's output split into one file per task try, Airflow's layout."""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.cli.dag_runs import write_task_logs

LOG = """\
2026 [info] parsing
2026 [info] [DAG TEST] starting task_id=prepare map_index=-1 [dag]
prepare says hi
2026 [info] [DAG TEST] end task task_id=prepare map_index=-1 [dag]
2026 [info] [DAG TEST] starting task_id=round_1.site-1 map_index=-1 [dag]
[site-1 r1] first try fails
2026 [info] [DAG TEST] end task task_id=round_1.site-1 map_index=-1 [dag]
2026 [info] [DAG TEST] starting task_id=round_1.site-1 map_index=-1 [dag]
[site-1 r1] second try works
2026 [info] [DAG TEST] end task task_id=round_1.site-1 map_index=-1 [dag]
between tasks: belongs to none
"""
STATE = {
    "dag_id": "d",
    "run_id": "manual__1",
    "tasks": {"prepare": {"try_number": 1}, "round_1.site-1": {"try_number": 2}},
}


@pytest.fixture
def base(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    folder = tmp_path / "logs"
    monkeypatch.setenv("AIRFLOW__LOGGING__BASE_LOG_FOLDER", str(folder))
    return folder


def task_log(base: pathlib.Path, task: str, attempt: int) -> pathlib.Path:
    return base / "dag_id=d" / "run_id=manual__1" / f"task_id={task}" / f"attempt={attempt}.log"


def test_each_try_gets_its_own_file(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    (tmp_path / "run.log").write_text(LOG)
    assert write_task_logs(str(tmp_path / "run.log"), STATE) == str(base / "dag_id=d" / "run_id=manual__1")
    assert "prepare says hi" in task_log(base, "prepare", 1).read_text()
    first, second = task_log(base, "round_1.site-1", 1).read_text(), task_log(base, "round_1.site-1", 2).read_text()
    assert "first try fails" in first and "second try" not in first
    assert "second try works" in second and "first try" not in second
    assert not any("belongs to none" in p.read_text() for p in base.rglob("*.log"))


def test_existing_files_and_links_are_never_written_through(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    (tmp_path / "run.log").write_text(LOG)
    kept = task_log(base, "prepare", 1)
    kept.parent.mkdir(parents=True)
    kept.write_text("the scheduler's own log\n")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = task_log(base, "round_1.site-1", 1)
    link.parent.mkdir(parents=True)
    link.symlink_to(victim)
    write_task_logs(str(tmp_path / "run.log"), STATE)
    assert kept.read_text() == "the scheduler's own log\n"
    assert victim.read_text() == "precious\n"
    assert "second try works" in task_log(base, "round_1.site-1", 2).read_text()


def test_an_unreadable_run_log_writes_nothing(tmp_path: pathlib.Path, base: pathlib.Path) -> None:
    assert write_task_logs(str(tmp_path / "missing.log"), STATE) is None
    assert not base.exists()
