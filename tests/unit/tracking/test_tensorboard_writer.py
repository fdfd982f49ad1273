"""TensorBoard event files, read back with TensorBoard's own reader: one file per round, replaced
(not appended to) when a round is written again."""

from __future__ import annotations

import pathlib

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flare_airflow.tracking import TensorBoardWriter, TrackingError


def _scalars(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    reader = EventAccumulator(str(folder))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def test_rounds_written_again_leave_one_point_per_step(tmp_path: pathlib.Path) -> None:
    writer = TensorBoardWriter(tmp_path, "demo", "manual__2026-12-02T00:00:00+00:00")
    round_1 = ({"global_accuracy": {1: 0.5}}, {"site-1": {"train_loss": {1: 0.75}, "epoch_loss": {1: 1.0, 2: 0.5}}})
    round_2 = ({"global_accuracy": {2: 0.75}}, {"site-1": {"train_loss": {2: 0.5}, "epoch_loss": {3: 0.25, 4: 0.125}}})
    with writer.session():
        writer.write_round(1, *round_1)
        writer.write_round(2, *round_2)
        writer.write_round(2, *round_2)  # a retried aggregation
        writer.write_round(1, *round_1)  # publish fills every round again
    assert writer.run_dir == tmp_path / "demo" / "manual__2026-12-02T00:00:00+00:00"
    assert _scalars(writer.run_dir / "global") == {"global_accuracy": [(1, 0.5), (2, 0.75)]}
    assert _scalars(writer.run_dir / "site-1") == {
        "train_loss": [(1, 0.75), (2, 0.5)],
        "epoch_loss": [(1, 1.0), (2, 0.5), (3, 0.25), (4, 0.125)],
    }
    assert sorted(p.name for p in (writer.run_dir / "site-1").iterdir()) == [
        "events.out.tfevents.0000000001.flare-airflow",
        "events.out.tfevents.0000000002.flare-airflow",
    ]  # no partial file left


def test_names_that_are_no_folder_names_stay_inside_the_root(tmp_path: pathlib.Path) -> None:
    writer = TensorBoardWriter(tmp_path, "demo", "../../etc")
    assert writer.run_dir.parent == tmp_path / "demo" and writer.run_dir.name == "_.._.._etc"


def test_a_folder_that_cannot_be_written_is_a_tracking_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "demo").write_text("a file where the job's folder goes")
    with (
        pytest.raises(TrackingError, match=r"TensorBoard event files in .*demo"),
        TensorBoardWriter(tmp_path, "demo", "run").session() as writer,
    ):
        writer.write_round(1, {"global_accuracy": {1: 0.5}}, {})
