"""TensorBoard event files: one folder per DAG run, one run folder in it for the global numbers and
one per site, one event file per round.

TensorBoard reads every ``*tfevents*`` file of a run folder in name order. A round's points -- the
round's own at ``step = round`` and a trainer's scalars at the steps it gave -- go into the file of
that round, which is written whole to a temporary name and renamed over the old one. So a retried
aggregation, a resume or a re-run publish replaces a round's file instead of adding to it: one
point per key and step, whoever writes it and how often.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from flare_airflow.core.tracking import Points, sorted_steps
from flare_airflow.tracking.mlflow_writer import TrackingError

GLOBAL_RUN = "global"
# Run ids are Airflow's (letters, digits and _ . ~ : + -); anything else would make a path of them.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.~:+-]")


def _folder_name(name: str) -> str:
    safe = _UNSAFE.sub("_", name)
    return "_" + safe if safe.startswith(".") else safe


def event_file_name(round_num: int) -> str:
    """The round's event file: TensorBoard needs ``tfevents`` in the name and reads files in name order."""
    return f"events.out.tfevents.{round_num:010d}.flare-airflow"


class TensorBoardWriter:
    """Writes one DAG run's numbers as event files under ``root/<job>/<run id>/{global,<site>}/``.

    Parameters
    ----------
    root:
        The folder TensorBoard is pointed at (``tensorboard --logdir root``).
    job, run_id:
        The job and the DAG run: the run's folder is ``root/<job>/<run id>``.
    """

    def __init__(self, root: str | Path, job: str, run_id: str) -> None:
        self.run_dir = Path(root) / _folder_name(job) / _folder_name(run_id)

    @contextlib.contextmanager
    def session(self) -> Iterator[TensorBoardWriter]:
        """Writes inside this block; a file system that refuses one becomes a :class:`TrackingError`."""
        try:
            yield self
        except OSError as exc:
            raise TrackingError(f"TensorBoard event files in {self.run_dir}: {type(exc).__name__}: {exc}") from exc

    def write_round(self, round_num: int, run_points: Points, site_points: Mapping[str, Points]) -> None:
        """Round ``round_num``'s event file of the global run and of each site, replacing earlier ones."""
        self._write(self.run_dir / GLOBAL_RUN, round_num, run_points)
        for site, points in sorted(site_points.items()):
            self._write(self.run_dir / _folder_name(site), round_num, points)

    def _write(self, folder: Path, round_num: int, points: Points) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.record_writer import RecordWriter

        if not points:
            return
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / event_file_name(round_num)
        partial = folder / f".round-{round_num}.{os.getpid()}.partial"  # TensorBoard reads only *tfevents* names
        by_step: dict[int, list[Summary.Value]] = {}
        for key, step, value in sorted_steps(points):
            by_step.setdefault(step, []).append(Summary.Value(tag=key, simple_value=value))
        now = time.time()
        writer = RecordWriter(str(partial))
        try:
            writer.write(Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
            # Steps ascending within the file: TensorBoard drops points that go back in step per tag.
            for step in sorted(by_step):
                event = Event(wall_time=now, step=step, summary=Summary(value=by_step[step]))
                writer.write(event.SerializeToString())
            writer.flush()
        finally:
            writer.close()
        os.replace(partial, target)
