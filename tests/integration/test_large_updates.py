"""Multi-GB updates in bounded memory: a FedAvg round of 2 x 1 GiB updates through the store, its peak
memory measured by the kernel (VmHWM) in a process of its own.

What the aggregation holds is fixed by design: the float64 accumulator (2 x one float32 update) and
two reused read buffers (2 x one update, verified side by side), whatever the number of sites
(tests/unit/core/aggregation/test_streaming.py::test_peak_memory_does_not_grow_with_the_number_of_updates
shows the independence from N at small sizes). This test checks the bound at the size that matters.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

from flare_airflow.core.model import FLModel, write_artifact

GIB = 1 << 30
CHILD = """
import json, sys
from pathlib import Path
from flare_airflow.core.aggregation.streaming import fedavg_from_store
from flare_airflow.core.model import read_artifact

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

root = Path(sys.argv[1])
glob, _ = read_artifact(root / "global.safetensors")
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset the high-water mark to the current RSS
outcome = fedavg_from_store(
    glob, [(f"site-{i}", root / f"site-{i}.safetensors", None) for i in (1, 2)], min_clients=2
)
print(json.dumps({"before": before, "peak": status("VmHWM:"), "accepted": sorted(outcome.accepted),
                  "first": float(outcome.params["t0"][0])}))
"""


def test_two_one_gib_updates_aggregate_within_five_updates_of_memory(tmp_path: pathlib.Path) -> None:
    n = GIB // 4 // 4  # 4 float32 tensors of 256 MiB: 1 GiB per update
    for name, value in (("global", 0.0), ("site-1", 1.0), ("site-2", 3.0)):
        tensors = {f"t{k}": np.full(n, value, np.float32) for k in range(4)}
        write_artifact(tmp_path / f"{name}.safetensors", FLModel(params=tensors, meta={"num_samples": 1}))
        del tensors
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, check=False, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["accepted"] == ["site-1", "site-2"] and got["first"] == 2.0
    extra = (got["peak"] - got["before"]) / GIB
    # float64 accumulator (2 GiB) + two read buffers (2 GiB); the mean is written over the accumulator.
    assert 2.0 < extra < 4.5, f"aggregation peak {extra:.2f} GiB above the loaded global model"
