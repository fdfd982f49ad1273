"""`make test`'s long setup steps in the background while the work that does not need them runs.

On a fresh machine the Kubernetes control plane is built from source (~7.5 min on 2 cores), the
language-model side environment is installed (2-6 min) and the tests' images are built (a Debian
root filesystem, then the trainer, Airflow, PostgreSQL and LM trainer images: ~6 min, much of it
downloads); lint, the unit tier, the battery and most of integration and e2e need none of them.
``make test`` therefore runs::

    python -m flare_airflow_testing.background --make control-plane --make lm-env --make test-images -- make lint pytest

Each ``--make TARGET`` starts ``make TARGET`` (at niceness 10) in a session of its own, its output in ``DIR/TARGET.log``
and its exit status in ``DIR/TARGET.rc`` when it ends (``DIR``: ``$FLARE_BACKGROUND_DIR``, given to the
foreground command). A test that needs a step's product calls :func:`wait_for`, which waits for the
step and raises with its log when it failed. pytest runs the modules that need a step last (see
``tests/conftest.py``), so the steps have the whole unit tier and the rest of the suite to finish in.

The foreground's exit status is the command's, unless it passed and a step failed: then 1, with the
step's log shown. Whatever happens (a failure, Ctrl-C, SIGTERM), nothing is left running: a step still
running when the foreground failed is ended with its whole process group.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

ENV = "FLARE_BACKGROUND_DIR"
LOG_LINES = 40
NICENESS = 10


class BackgroundStepFailed(RuntimeError):
    """A setup step run in the background by ``make test`` failed (its log is in the message)."""


def tail(path: pathlib.Path, lines: int = LOG_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def wait_for(target: str, timeout: float = 3600) -> None:
    """Wait for the background step ``make TARGET`` when ``make test`` started one; return at once
    otherwise (a developer's pytest, or a step this run did not start). Raises
    :class:`BackgroundStepFailed`, with the step's log, when it failed or did not end in time."""
    directory = os.environ.get(ENV)
    if not directory or not (pathlib.Path(directory) / f"{target}.log").exists():
        return
    rc_file = pathlib.Path(directory) / f"{target}.rc"
    log = pathlib.Path(directory) / f"{target}.log"
    deadline = time.monotonic() + timeout
    while not rc_file.exists():
        if time.monotonic() > deadline:
            raise BackgroundStepFailed(
                f"`make {target}` (background) did not end in {timeout:.0f} s; {log}:\n{tail(log)}"
            )
        time.sleep(1)
    rc = rc_file.read_text().strip()
    if rc != "0":
        raise BackgroundStepFailed(
            f"`make {target}` (background) failed (exit {rc}); last lines of {log}:\n{tail(log)}"
        )


#: The fixtures that hand a test a product of ``make test``'s background steps: the tests' images
#: (``trainer_image``; ``images``, the three of ``make images``) and the Kubernetes control plane.
IMAGE_FIXTURES = frozenset({"trainer_image", "images"})
CONTROL_PLANE_FIXTURES = frozenset({"control_plane"})


def _wait_rank(item: pytest.Item) -> int:
    """0: the test needs no product of ``make test``'s background steps; 1: an image or the
    language-model side environment (its module uses ``lm_venv``), steps of a few minutes; 2: the
    Kubernetes control plane, whose build from source is the longest step."""
    from flare_airflow_testing.side_venvs import lm_venv

    fixtures = set(getattr(item, "fixturenames", ()))
    if CONTROL_PLANE_FIXTURES & fixtures:
        return 2
    if IMAGE_FIXTURES & fixtures or getattr(getattr(item, "module", None), "lm_venv", None) is lm_venv:
        return 1
    return 0


def background_last(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` module by module: first the modules that need no background step, then those that
    need a short one (images, the LM environment), then those that need the control plane (see
    :func:`_wait_rank`); within each group the modules with more tests first (pytest-xdist's own
    order, which ``make test`` turns off with ``--no-loadscope-reorder`` so that this one holds). A
    module is never split: its module-scoped stack starts once."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(modules.values(), key=lambda tests: (max(map(_wait_rank, tests)), -len(tests)))
    return [item for tests in ordered for item in tests]


class _Step:
    def __init__(self, target: str, directory: pathlib.Path, make: str) -> None:
        self.target = target
        self.log = directory / f"{target}.log"
        self.rc_file = directory / f"{target}.rc"
        self.started = time.monotonic()
        self.seconds: float | None = None
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                # At a lower priority: the tests' own timeouts (a trainer's launch_timeout, heartbeats)
                # must not lose their two cores to a compiler. A bad_inputs trainer case missed its
                # launch timeout once at the same priority.
                ["nice", "-n", str(NICENESS), make, "--no-print-directory", target],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() ends everything it started
            )
        self._watcher = threading.Thread(target=self._record, daemon=True)
        self._watcher.start()

    def _record(self) -> None:
        rc = self.proc.wait()
        self.seconds = time.monotonic() - self.started
        # Written then renamed: wait_for() never reads a half-written status.
        partial = self.rc_file.with_suffix(".rc.partial")
        partial.write_text(f"{rc}\n")
        partial.rename(self.rc_file)

    def finish(self) -> int:
        self._watcher.join()
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # anything left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)


def run(targets: Sequence[str], command: Sequence[str], directory: pathlib.Path, make: str = "make") -> int:
    """Run ``command`` with ``make TARGET`` for each target in the background; see the module's doc."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in (*directory.glob("*.rc"), *directory.glob("*.log")):
        stale.unlink()
    steps: list[_Step] = []

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for target in targets:
            steps.append(_Step(target, directory, make))
            print(f"background: make {target} started; its output: {steps[-1].log}", flush=True)
        code = subprocess.run(list(command), env={**os.environ, ENV: str(directory)}, check=False).returncode
        if code != 0:
            return code
        for step in steps:
            rc = step.finish()
            if rc != 0:
                print(
                    f"background: make {step.target} failed (exit {rc}); last lines of {step.log}:\n{tail(step.log)}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            print(f"background: make {step.target} took {step.seconds:.0f} s", flush=True)
        return 0
    finally:
        for step in steps:
            step.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flare_airflow_testing.background", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--make", action="append", default=[], metavar="TARGET", help="a make target run in the background"
    )
    parser.add_argument(
        "--dir", type=pathlib.Path, help="where the logs and statuses go (default: a temporary directory)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the foreground command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no foreground command (give it after --)")
    directory = args.dir or pathlib.Path(tempfile.mkdtemp(prefix="flare-background-"))
    code = run(args.make, command, directory, make=os.environ.get("MAKE", "make"))
    if code == 0 and args.dir is None:  # a failed run keeps the steps' logs (their path was printed)
        shutil.rmtree(directory, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
