"""Export hello-numpy jobs with NVFlare's own recipe for native-mode tests (runs in NVFlare's environment).

    python make_native_jobs.py OUT_DIR SCRIPT

* ``hello-numpy``: ``NumpyFedAvgRecipe``, 2 clients, 2 rounds (a job that completes in seconds);
* ``hello-long``: the same with 500 rounds (a job that is still running when a test kills it).

The last stdout line is ``RESULT {json}`` with the job folders.
"""

import json
import os
import sys

import numpy as np
from nvflare.app_common.np.recipes import NumpyFedAvgRecipe

INITIAL = np.arange(1, 10, dtype=np.float32).reshape(3, 3)


def main(out, script):
    folders = {}
    for name, rounds in (("hello-numpy", 2), ("hello-long", 500)):
        recipe = NumpyFedAvgRecipe(name=name, min_clients=2, num_rounds=rounds, model=INITIAL, train_script=script)
        recipe.export(out)
        folders[name] = os.path.join(out, name)
    print("RESULT " + json.dumps(folders), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
