"""Build one NVFlare FedAvg job with NVFlare's numpy recipe and run it in NVFlare's simulator.

Runs in NVFlare's own virtual environment (the benchmark creates it), the way NVFlare's hello-numpy
example runs: ``NumpyFedAvgRecipe`` (FedAvg controller with in-time weighted aggregation, numpy
persistor, the client script run in process by the Client API executor) executed with ``SimEnv``,
which exports the job and runs ``python -m nvflare.private.fed.app.simulator.simulator`` on it
with one thread per client.

    python job.py hello  --sites 2 --rounds 3 --workspace DIR
    python job.py digits --sites 4 --rounds 5 --workspace DIR --trainer PATH --digits-data PATH --hparams JSON
    python job.py hello  --sites 2 --rounds 3 --workspace DIR --export-dir JOBS   # export only (POC mode)

The last stdout line is ``RESULT {json}``: wall-clock marks (``time.time()``) and the path of the
final global model (``server.npy``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str]) -> int:
    started = time.time()
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=("hello", "digits", "large"))
    p.add_argument("--sites", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--workspace", required=True, help="SimEnv workspace root")
    p.add_argument("--trainer", help="digits: path of examples/digits/trainer.py")
    p.add_argument("--digits-data", help="digits: path of scikit-learn's digits.csv.gz")
    p.add_argument("--trainer-args", default="[]", help="digits: the job's trainer args (JSON list)")
    p.add_argument("--hparams", default="{}", help="digits: the job's hparams (JSON)")
    p.add_argument("--size", type=int, default=0, help="large: the model's bytes (float32 zeros; hello's client)")
    p.add_argument("--export-dir", help="export the job folder here (for `nvflare job submit`) instead of running it")
    args = p.parse_args(argv)

    import numpy as np
    from nvflare.app_common.np.recipes import NumpyFedAvgRecipe
    from nvflare.recipe import SimEnv

    imported = time.time()
    name = f"{args.kind}-r{args.rounds}"
    if args.kind == "hello":
        model = np.arange(1, 10, dtype=np.float32).reshape(3, 3)  # hello-numpy's initial model
        script, train_args = os.path.join(HERE, "hello_client.py"), ""
    elif args.kind == "large":  # bench_large_round.py: one round exchanging updates of --size bytes
        # The recipe writes an initial model into the job's JSON as a list (100 MB of text for 16 MiB):
        # a placeholder here, the real one an .npy beside the job that the persistor loads (below).
        model = np.zeros(1, dtype=np.float32)
        script, train_args = os.path.join(HERE, "hello_client.py"), ""
    else:
        if not args.trainer or not args.digits_data:
            p.error("digits needs --trainer and --digits-data")
        hp = json.loads(args.hparams)
        model = np.zeros((65, 10), dtype=np.float32)  # weight (64 x 10) and bias (1 x 10), zeros as the example's
        script = os.path.join(HERE, "digits_client.py")
        extra = json.loads(args.trainer_args)  # the job's args: --num-sites 4 --alpha 0.5 --seed 0
        train_args = " ".join(
            [
                f"--trainer {args.trainer}",
                f"--digits-data {args.digits_data}",
                *extra,
                f"--lr {hp.get('lr', 0.5)}",
                f"--local-epochs {hp.get('local_epochs', 5)}",
                f"--batch-size {hp.get('batch_size', 32)}",
            ]
        )
    recipe = NumpyFedAvgRecipe(
        name=name,
        min_clients=args.sites,
        num_rounds=args.rounds,
        model=model,
        train_script=script,
        train_args=train_args,
    )
    if args.export_dir:
        recipe.export(args.export_dir)
        job_folder = os.path.join(args.export_dir, name)
        if args.kind == "large":
            initial = os.path.abspath(os.path.join(args.export_dir, "large-initial.npy"))
            np.save(initial, np.zeros(args.size // 4, dtype=np.float32))
            server_config = os.path.join(job_folder, "app", "config", "config_fed_server.json")
            with open(server_config) as fh:
                config = json.load(fh)
            for component in config["components"]:
                if component["id"] == "persistor":
                    component["args"].pop("model", None)
                    component["args"]["source_ckpt_file_full_name"] = initial
            with open(server_config, "w") as fh:
                json.dump(config, fh, indent=2)
        print("RESULT " + json.dumps({"job_folder": job_folder, "name": name}), flush=True)
        return 0
    env = SimEnv(num_clients=args.sites, workspace_root=args.workspace)
    run_started = time.time()
    recipe.run(env)  # raises if the simulator exits non-zero
    run_finished = time.time()
    result = {
        "started": started,
        "imported": imported,
        "run_started": run_started,
        "run_finished": run_finished,
        "final_model": os.path.join(args.workspace, name, "server", "simulate_job", "models", "server.npy"),
        "nvflare": __import__("nvflare").__version__,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
