"""core/store_resume.py without a store: where a site keeps the ids of its open uploads, attacked as
another local user of the worker would (the resumed uploads themselves: tests/integration/store/)."""

from __future__ import annotations

import os
import pathlib

import pytest

from flare_airflow.core.errors import StoreError
from flare_airflow.core.store_resume import _UploadState, own_directory

URI = "s3://flare/store/j/r/round-0001/sites/site-1.safetensors"


def test_the_state_directory_is_made_private_and_a_note_round_trips(tmp_path: pathlib.Path) -> None:
    state = _UploadState(tmp_path / "uploads", URI)
    assert (os.stat(tmp_path / "uploads").st_mode & 0o777) == 0o700
    state.write("upload-1", 64 << 20)
    assert state.read() == {"uri": URI, "upload_id": "upload-1", "part_size": 64 << 20}
    assert [p.name for p in (tmp_path / "uploads").iterdir()] == [state.path.name]  # no temporary left
    state.clear()
    assert state.read() is None


@pytest.mark.parametrize("made_by_someone_else", ["world-writable", "a symlink"])
def test_a_state_directory_someone_else_could_write_is_refused(tmp_path: pathlib.Path, made_by_someone_else) -> None:
    """The default directory's name is predictable in the shared /tmp: a local user who made it first
    (or a link to a directory of theirs) could plant a link for the worker to write through."""
    victim = tmp_path / "passwd"
    victim.write_text("root:x:0:0")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    planted = tmp_path / "uploads"
    if made_by_someone_else == "a symlink":
        planted.symlink_to(theirs, target_is_directory=True)
    else:
        planted.mkdir()
        os.chmod(planted, 0o777)
    note = _UploadState(tmp_path / "probe", URI).path.name  # the note's name, derived from the URI
    (theirs / note).with_suffix(".tmp").symlink_to(victim)  # where a writer that trusts the folder writes
    with pytest.raises(StoreError, match="FLARE_UPLOAD_STATE_DIR"):
        _UploadState(planted, URI).write("u", 1)
    assert victim.read_text() == "root:x:0:0"
    assert own_directory(tmp_path / "mine") == tmp_path / "mine"
