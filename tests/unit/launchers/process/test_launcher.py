"""ProcessLauncher and its handle: the exact argv (never a shell), output line by line, failure
reasons (flare_airflow.launchers.process.launcher)."""

from __future__ import annotations

import json
import os

from flare_airflow.launchers.process import ProcessLauncher
from tests.unit.launchers.process.jobs import PY, RC, site_job

HOSTILE = [
    "$(touch {tmp}/pwned-subshell)",
    "`touch {tmp}/pwned-backtick`",
    "; touch {tmp}/pwned-semicolon",
    "; rm -rf victim",
    "&& rm -rf victim",
    "| tee {tmp}/pwned-pipe",
    "> {tmp}/pwned-redirect",
    "*",
    "victim/*",
    "~",
    "$HOME",
    "'\"",
    "it's",
    "{{{{ ds }}}}",
    "line one\nline two",
    "",
    " leading and trailing ",
    "--flag=$(id)",
]


def test_argv_with_shell_metacharacters_arrives_literally(write_script, tmp_path, lines) -> None:
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep.txt").write_text("still here")
    dump = write_script("dump_argv.py", "import json, sys\njson.dump(sys.argv[2:], open(sys.argv[1], 'w'))\n")
    out = tmp_path / "argv.json"
    args = [a.format(tmp=tmp_path) for a in HOSTILE]
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, str(dump), str(out), *args], cwd=str(tmp_path)))
    assert handle.wait(timeout=30) is RC.SUCCESS
    assert json.loads(out.read_text()) == args
    assert "{{ ds }}" in args and "$(touch" in args[0]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("pwned")) == []
    assert (tmp_path / "victim" / "keep.txt").read_text() == "still here"


def test_output_streams_line_by_line_in_order_with_a_prefix(write_script, tmp_path, lines) -> None:
    go = tmp_path / "go"
    script = write_script(
        "talk.py",
        f"""
        import os, sys, time
        print("first")
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        for i in range(20):
            print(f"line {{i}}")
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
        """,
    )
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, str(script)]))
    # "first" arrives while the trainer still runs: output is streamed, not collected at exit.
    lines.wait_for("first")
    assert handle.poll() is RC.UNKNOWN
    go.touch()
    assert handle.wait(timeout=30) is RC.SUCCESS
    assert lines.lines == [
        "[site-1 r2] first",
        *(f"[site-1 r2] line {i}" for i in range(20)),
        "[site-1 r2] to stderr",
        "[site-1 r2] no newline at the end",
    ]


def test_prefix_can_be_turned_off(lines) -> None:
    handle = ProcessLauncher(sink=lines, prefix_lines=False).launch_job(site_job([PY, "-c", "print('plain')"]))
    assert handle.wait(timeout=30) is RC.SUCCESS
    assert lines.lines == ["plain"]


def test_a_failure_reason_quotes_the_last_output_line_with_secrets_hidden(lines) -> None:
    code = "print('token is s3cr3t'); raise SystemExit('ValueError: bad learning rate')"
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", code], env={"TOKEN": "s3cr3t"}))
    handle.hide(["s3cr3t"])
    assert handle.wait(timeout=30) is RC.EXECUTION_ERROR
    assert handle.reason == "exit code 1; its last output: ValueError: bad learning rate"
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", "print('key s3cr3t'); raise SystemExit(2)"]))
    handle.hide(["s3cr3t"])
    assert handle.wait(timeout=30) is RC.EXECUTION_ERROR
    assert handle.reason == "exit code 2; its last output: key ***"


def test_sweep_removes_only_the_scratch_of_launchers_that_are_gone(tmp_path) -> None:
    import subprocess

    from flare_airflow.launchers.process.launcher import sweep_scratch

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_dir = tmp_path / f"flare-sandbox-{gone.pid}-abc"
    dead_dir.mkdir()
    (dead_dir / "handshake").write_text("")
    dead_file = tmp_path / f"flare-handshake-{gone.pid}-xyz"
    dead_file.write_text("")
    dead_result = tmp_path / f"flare-site-result-{gone.pid}-r1"  # a killed process site task's
    dead_result.write_text("")
    live = tmp_path / f"flare-sandbox-{os.getpid()}-def"
    live.mkdir()
    unrelated = tmp_path / "flare-sandbox-oldstyle"
    unrelated.mkdir()
    assert sorted(sweep_scratch(str(tmp_path))) == sorted([dead_dir, dead_file, dead_result])
    assert not dead_dir.exists() and not dead_file.exists() and not dead_result.exists()
    assert live.is_dir() and unrelated.is_dir()
