"""Records when it ran and which GPUs it was given, holds them a while, sends the model back.

``gpu_probe.py IGNORED SECONDS``: the record is ``gpu-probe.json`` in the try's staging directory.
"""

import json
import os
import sys
import time

import flare_airflow.client as flare

model = flare.receive()
record = {"site": flare.get_site_name(), "pid": os.getpid(), "start": time.time()}
record["devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
time.sleep(float(sys.argv[2]))
record["end"] = time.time()
# Next to the update (FLARE_OUTPUT's directory): the only place a confined trainer may write.
staging = os.path.dirname(os.environ["FLARE_OUTPUT"].removeprefix("file://"))
with open(os.path.join(staging, "gpu-probe.json"), "w") as fh:
    json.dump(record, fh)
flare.send(flare.FLModel(params=model.params, meta={"num_samples": 1}))
