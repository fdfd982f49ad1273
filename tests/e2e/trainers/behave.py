"""A tiny trainer whose misbehaviour per site is chosen by its arguments (end-to-end tests).

    behave.py [--fail SITE]... [--nan SITE]... [--shape SITE]... [--dtype SITE]...
              [--pickle SITE]... [--silent SITE]... [--hang SITE]... [--pidfile DIR] [--echo-args FILE]
              [--send-then-fail SITE]... [--send-twice SITE]... [--nan-metric SITE]...
              [--clobber-output-late SITE]... [--diff-all VALUE] [--fill-store SITE]...
              [--fail-in-round SITE:ROUND]... [--hang-in-round SITE:ROUND]... [--until-file PATH]
              [--hostile-retry SITE]...

Healthy sites send ``global + 1`` (FULL) with num_samples = the site's number. A relative
``--echo-args`` file is written in ``FLARE_OUTPUT``'s directory, which a confined trainer may write.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

import numpy as np

import flare_airflow.client as flare


def _escape(what: str) -> None:
    import pathlib
    import socket

    global_model = pathlib.Path(os.environ["FLARE_GLOBAL_MODEL"].removeprefix("file://"))
    if what == "outside":
        pathlib.Path("pwned-outside").write_text("x")
    elif what == "global":
        with open(global_model, "r+b") as fh:
            fh.write(b"garbage")
    elif what == "store":
        (global_model.parents[3] / "pwned-store-root").write_text("x")  # store/job/run/round-0000/global
    elif what == "net":
        socket.create_connection(("192.0.2.1", 80), timeout=10).close()


def main() -> int:
    p = argparse.ArgumentParser()
    flags = ("fail", "nan", "shape", "dtype", "pickle", "silent", "hang", "send_then_fail", "send_twice", "nan_metric")
    # --hostile-retry SITE: on a second or later try of a site task, send the global model back
    # (an update of 0) instead of global + 1: two tries, two different releases (issue 34).
    for flag in (*flags, "clobber_output_late", "fill_store", "hostile_retry"):
        p.add_argument(f"--{flag.replace('_', '-')}", action="append", default=[])
    p.add_argument("--diff-all", type=float)
    # --fail-in-round SITE:ROUND fails that site's job in that round, while --until-file (if given) does not exist.
    p.add_argument("--fail-in-round", action="append", default=[])
    # --escape SITE:WHAT tries to break out after receive(): outside (its cwd), global (its input
    # global model), store (the store's root), net (a connection out).
    p.add_argument("--escape", action="append", default=[])
    # --hang-in-round SITE:ROUND: that site's job in that round waits while --until-file does not exist.
    p.add_argument("--hang-in-round", action="append", default=[])
    p.add_argument("--until-file")
    p.add_argument("--fail-evaluate", action="store_true")
    p.add_argument("--pidfile-dir")
    p.add_argument("--echo-args")
    args, rest = p.parse_known_args()
    site = os.environ["FLARE_SITE"]
    # The server's evaluation is confined by default and writes only its output: sites only.
    evaluating = os.environ.get("FLARE_TASK") == "evaluate"
    if args.pidfile_dir and not evaluating:
        with open(os.path.join(args.pidfile_dir, f"{site}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    if args.echo_args and not evaluating:
        echo = os.path.join(os.path.dirname(os.environ["FLARE_OUTPUT"].removeprefix("file://")), args.echo_args)
        with open(echo, "w") as fh:
            json.dump({"args": rest, "hparams": flare.get_hparams(), "round": os.environ["FLARE_ROUND"]}, fh)
    if site in args.hang:
        print(f"{site}: hanging", flush=True)
        time.sleep(600)
    if site in args.fill_store:
        # Fill the store's filesystem (a small tmpfs in the test), then try to send.
        filler = os.path.join(os.path.dirname(os.environ["FLARE_OUTPUT"].removeprefix("file://")), "filler")
        os.makedirs(os.path.dirname(filler), exist_ok=True)
        try:
            with open(filler, "wb") as fh:
                while True:
                    fh.write(b"\0" * 65536)
        except OSError as exc:
            print(f"{site}: store filled ({exc.strerror})", flush=True)
    if f"{site}:{os.environ['FLARE_ROUND']}" in args.hang_in_round:
        print(f"{site}: waiting for {args.until_file}", flush=True)
        deadline = time.monotonic() + 600
        while not os.path.exists(args.until_file) and time.monotonic() < deadline:
            time.sleep(0.2)
    if f"{site}:{os.environ['FLARE_ROUND']}" in args.fail_in_round and not (
        args.until_file and os.path.exists(args.until_file)
    ):
        print(f"{site}: failing in round {os.environ['FLARE_ROUND']} on purpose", flush=True)
        return 3
    if site in args.fail:
        print(f"{site}: failing on purpose", flush=True)
        return 3
    model = flare.receive()
    for item in args.escape:
        who, _, what = item.partition(":")
        if who == site:
            _escape(what)
    if flare.is_evaluate():
        if args.fail_evaluate:
            print("evaluator crashing on purpose", flush=True)
            return 4
        w = model.params["w"]
        flare.send(flare.FLModel(metrics={"accuracy": float(1.0 / (1.0 + abs(w).mean())), "loss": float(w.mean())}))
        return 0
    if site in args.silent:
        print(f"{site}: exiting without sending", flush=True)
        return 0
    params = {k: v + np.float32(1) for k, v in model.params.items()}
    if site in args.hostile_retry and "/try-1/" not in os.environ["FLARE_OUTPUT"]:
        params = {k: v.copy() for k, v in model.params.items()}
    if site in args.nan:
        params["w"][0] = np.nan
    if site in args.shape:
        params["w"] = np.zeros(7, np.float32)
    if site in args.dtype:
        params["w"] = params["w"].astype(np.float64)
    number = int(site.rsplit("-", 1)[1])
    if args.diff_all is not None:
        diff = {k: np.full_like(v, args.diff_all) for k, v in model.params.items()}
        flare.send(flare.FLModel(params=diff, params_type=flare.ParamsType.DIFF, meta={"num_samples": number}))
        return 0
    metrics = {"train_loss": float("nan") if site in args.nan_metric else float(number)}
    flare.send(flare.FLModel(params=params, metrics=metrics, meta={"num_samples": number}))
    if site in args.send_then_fail:
        print(f"{site}: sent, now failing on purpose", flush=True)
        return 5
    if site in args.send_twice:
        flare.send(flare.FLModel(params=params, meta={"num_samples": number}))
    if site in args.clobber_output_late:
        # A trainer that leaves a child behind which rewrites its output after the job ended.
        out = os.environ["FLARE_OUTPUT"].removeprefix("file://")
        code = f"import time, shutil; time.sleep(2); open({out!r}, 'wb').write(b'late garbage')"
        import subprocess

        subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    if site in args.pickle:
        # Overwrite the update with a pickle payload and a record that matches it.
        out = os.environ["FLARE_OUTPUT"].removeprefix("file://")
        data = pickle.dumps({k: v for k, v in params.items()})
        with open(out, "wb") as fh:
            fh.write(data)
        rec = out.removesuffix(".safetensors") + ".json"
        with open(rec) as fh:
            record = json.load(fh)
        import hashlib

        # A forger who also fixes every digest the record holds: only the format check can stop it.
        record.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        if record.get("blake3"):
            import blake3

            record["blake3"] = blake3.blake3(data).hexdigest()
        with open(rec, "w") as fh:
            json.dump(record, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
