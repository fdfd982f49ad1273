"""A site trainer for pod tests (Client API only): adds 1 to every tensor of the global model.

``--release PATH`` waits until PATH exists before sending; ``--secret-env NAME`` prints the sha256
of that variable (never the value); ``--exit N`` exits with N instead of sending; ``--sleep S``
trains for S seconds.
"""

import argparse
import hashlib
import os
import sys
import time

import flare_airflow.client as flare

parser = argparse.ArgumentParser()
parser.add_argument("--release")
parser.add_argument("--secret-env")
parser.add_argument("--exit", type=int)
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()

model = flare.receive()
print(f"site {flare.get_site_name()} round {flare.get_round()} pid {os.getpid()}", flush=True)
if args.secret_env:
    print("secret sha256", hashlib.sha256(os.environ[args.secret_env].encode()).hexdigest(), flush=True)
if args.release:
    while not os.path.exists(args.release):
        time.sleep(0.05)
time.sleep(args.sleep)
if args.exit is not None:
    sys.exit(args.exit)
flare.send(flare.FLModel(params={k: v + 1 for k, v in model.params.items()}, meta={"num_samples": 7}))
print("update sent", flush=True)
