"""Digests of artifact records: sha256 always, BLAKE3 where the blake3 package is installed."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import blake3
import pytest

from flare_airflow.core.digests import BLAKE3, SHA256, available, digest_all, new_hasher, verifiable

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_both_algorithms_here_and_their_digests() -> None:
    assert available() == (SHA256, BLAKE3)
    data = b"flare" * 1000
    assert digest_all(data, available()) == {
        SHA256: hashlib.sha256(data).hexdigest(),
        BLAKE3: blake3.blake3(data).hexdigest(),
    }
    with pytest.raises(ValueError, match="'md5' is not available"):
        new_hasher("md5")


def test_only_digests_the_record_holds_are_verifiable() -> None:
    assert verifiable({SHA256: "a" * 64}) == (SHA256,)
    assert verifiable({SHA256: "a" * 64, BLAKE3: None}) == (SHA256,)
    assert verifiable({SHA256: "a" * 64, BLAKE3: "b" * 64}) == (SHA256, BLAKE3)


WITHOUT_BLAKE3 = """
import json, pathlib, sys
sys.modules["blake3"] = None  # as in a trainer image with only numpy and safetensors: import fails
import numpy as np
from flare_airflow.core.aggregation.streaming import fedavg_from_store
from flare_airflow.core.model import FLModel, read_artifact, read_record, write_artifact
out, theirs = sys.argv[1], sys.argv[2]
rec = write_artifact(pathlib.Path(out), FLModel(params={"w": np.ones(4, np.float32)}))
read_artifact(pathlib.Path(out))
read_artifact(pathlib.Path(theirs))  # a record with BLAKE3, verified by sha256 here
agg = fedavg_from_store({"w": np.zeros(4, np.float32)}, [("a", pathlib.Path(theirs), None)], min_clients=1)
print(json.dumps({"blake3": rec.blake3, "accepted": sorted(agg.accepted)}))
"""


def test_without_the_blake3_package_records_carry_sha256_alone_and_still_verify(tmp_path: pathlib.Path) -> None:
    import numpy as np

    from flare_airflow.core.model import FLModel, record_path, write_artifact

    theirs = tmp_path / "theirs.safetensors"
    assert write_artifact(theirs, FLModel(params={"w": np.ones(4, np.float32)})).blake3
    out = tmp_path / "mine.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_BLAKE3, str(out), str(theirs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"blake3": None, "accepted": ["a"]}
    assert "blake3" not in json.loads(record_path(out).read_text())
