"""Writing an import into --out: all of it or nothing (flare_airflow/nvflare/output.py)."""

from __future__ import annotations

import os
import pathlib

import pytest

from flare_airflow.nvflare import output
from flare_airflow.nvflare.errors import NvflareJobError
from flare_airflow.nvflare.output import check_targets, move_into_place, staging_folder

NAMES = ["nv", "nv.yaml", "nv_dag.py"]


def _earlier_import(out: pathlib.Path) -> None:
    (out / "nv").mkdir(parents=True)
    (out / "nv" / "old.py").write_text("old\n")
    (out / "nv.yaml").write_text("old job\n")
    (out / "nv_dag.py").write_text("# edited by hand\n")


def _staged(staging: pathlib.Path) -> None:
    (staging / "nv").mkdir()
    (staging / "nv" / "new.py").write_text("new\n")
    (staging / "nv.yaml").write_text("new job\n")
    (staging / "nv_dag.py").write_text("new dag\n")


def test_a_failed_move_puts_back_what_was_there(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    _earlier_import(out)
    real_rename = os.rename

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        # the new DAG file, the last name: two are in place already (putting the old one back works)
        if str(dst).endswith("out/nv_dag.py") and ".replaced" not in str(src):
            raise OSError(28, "No space left on device")
        real_rename(src, dst)

    with staging_folder(out, "nv") as staging:
        _staged(staging)
        monkeypatch.setattr(output.os, "rename", rename)
        with pytest.raises(NvflareJobError, match=r"cannot move the imported files into place .*nothing was changed"):
            move_into_place(staging, out, NAMES)
    assert sorted(p.name for p in out.iterdir()) == NAMES  # no staging folder left behind either
    assert (out / "nv" / "old.py").read_text() == "old\n" and not (out / "nv" / "new.py").exists()
    assert (out / "nv.yaml").read_text() == "old job\n"
    assert (out / "nv_dag.py").read_text() == "# edited by hand\n"


def test_force_replaces_a_folder_with_a_folder(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    _earlier_import(out)
    check_targets(out, NAMES, force=True)
    with staging_folder(out, "nv") as staging:
        _staged(staging)
        move_into_place(staging, out, NAMES)
    assert sorted(p.name for p in out.iterdir()) == NAMES
    assert sorted(p.name for p in (out / "nv").iterdir()) == ["new.py"]


def test_without_force_nothing_there_is_replaced(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    (out).mkdir()
    (out / "nv_dag.py").write_text("# edited by hand\n")
    with pytest.raises(NvflareJobError, match=r"nv_dag\.py already there"):
        check_targets(out, NAMES, force=False)
    check_targets(out, ["other.yaml"], force=False)  # an unrelated file is no obstacle
