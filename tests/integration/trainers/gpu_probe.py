"""Records when it ran and which GPUs it was given, holds them a while, sends the model back."""

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
with open(os.path.join(sys.argv[1], f"{record['site']}-{os.getpid()}.json"), "w") as fh:
    json.dump(record, fh)
flare.send(flare.FLModel(params=model.params, meta={"num_samples": 1}))
