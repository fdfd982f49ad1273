"""NVFlare's weighted aggregation over safetensors updates (runs in NVFlare's own virtual environment).

    python aggregate.py '{"files": [...], "weights": [...], "out": PATH or null}'

Feeds NVFlare's ``WeightedAggregationHelper`` -- what the FedAvg controller of NVFlare's numpy
FedAvg recipe uses for its in-time aggregation -- one update at a time, as results arrive there:
load one file (``safetensors.numpy.load_file``), ``add`` it with its weight (a float, as the
controller passes ``aggregation_weight * NUM_STEPS_CURRENT_ROUND``), drop it; then ``get_result``.
Loading and aggregation are timed separately. Peak memory: the kernel's RSS high-water mark,
reset after the imports. The aggregate is saved (untimed) to ``out`` for comparison.

Prints ``RESULT {json}`` as its last line.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from pathlib import Path

# bench_common is stdlib only: importable from NVFlare's own venv.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import rss_baseline, status_kib


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    import numpy as np
    from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper
    from safetensors.numpy import load_file, save_file

    files, weights = list(args["files"]), [float(w) for w in args["weights"]]
    gc.collect()
    reset, base_rss = rss_baseline()
    helper = WeightedAggregationHelper()
    load_s = agg_s = 0.0
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for i, (path, weight) in enumerate(zip(files, weights, strict=True)):
        t0 = time.perf_counter()
        params = load_file(path)
        t1 = time.perf_counter()
        helper.add(data=params, weight=weight, contributor_name=f"site-{i:02d}", contribution_round=1)
        agg_s += time.perf_counter() - t1
        load_s += t1 - t0
        del params
    t0 = time.perf_counter()
    result = helper.get_result()
    agg_s += time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    peak_kib = status_kib("VmHWM")
    dtypes = sorted({str(v.dtype) for v in result.values()})
    if args.get("out"):
        save_file({k: np.ascontiguousarray(v) for k, v in result.items()}, args["out"])
    print(
        "RESULT "
        + json.dumps(
            {
                "load_seconds": load_s,
                "aggregate_seconds": agg_s,
                "cpu_seconds": cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime,  # load + aggregate
                "peak_delta": (peak_kib - base_rss) * 1024,
                "hwm_reset": reset,
                "result_dtypes": dtypes,
                "numpy": np.__version__,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
