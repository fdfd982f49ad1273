"""NVFlare client of the digits job: the softmax regression of ``examples/digits/trainer.py``.

Runs inside NVFlare's simulator, in NVFlare's own virtual environment. The training math is the
example trainer's own functions, imported from its file (``--trainer``), so both systems run the
same code: the same data split and non-IID shards, the same seeds, the same SGD. Only the model
exchange differs: NVFlare's numpy recipe carries one array, so the weight (64 x 10) and the bias
(10) travel packed as one 65 x 10 float32 array (row 64 is the bias); FedAvg is elementwise, so the
packing changes nothing.

scikit-learn is not installed in NVFlare's environment: the trainer's ``digits_file()`` (which finds
scikit-learn's bundled ``digits.csv.gz``) is pointed at the file the benchmark passes (``--digits-data``,
found in the project's environment). ``trainer.py`` imports ``flare_airflow.client`` at the top; its
training functions never use it, so an empty stand-in module is registered for that import.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import types
from typing import Any

import numpy as np
import nvflare.client as flare
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.np.constants import NPConstants


def load_trainer(path: str, data: str) -> Any:
    if "flare_airflow.client" not in sys.modules:
        stub = types.ModuleType("flare_airflow.client")
        package = types.ModuleType("flare_airflow")
        package.client = stub  # type: ignore[attr-defined]
        sys.modules.setdefault("flare_airflow", package)
        sys.modules.setdefault("flare_airflow.client", stub)
    spec = importlib.util.spec_from_file_location("digits_trainer", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import the digits trainer from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.digits_file = lambda: pathlib.Path(data)
    return module


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", required=True, help="path of examples/digits/trainer.py")
    p.add_argument("--digits-data", required=True, help="path of scikit-learn's digits.csv.gz")
    p.add_argument("--num-sites", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--local-epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    trainer = load_trainer(args.trainer, args.digits_data)
    features = trainer.NUM_FEATURES

    x_train, x_test, y_train, y_test = trainer.load_split(args.seed)
    flare.init()
    site = flare.system_info()["site_name"]
    index = trainer.site_index(site, args.num_sites)
    shard = trainer.partition(y_train, args.num_sites, args.alpha, args.seed)[index]
    x, y = x_train[shard], y_train[shard]
    while flare.is_running():
        model = flare.receive()
        if model is None:  # the job is ending
            break
        packed = np.asarray(model.params[NPConstants.NUMPY_KEY], dtype=np.float32)
        w, b = packed[:features], packed[features]
        # The received global model's test accuracy (NVFlare's examples report it with the update).
        _, global_acc = trainer.loss_and_accuracy(w, b, x_test, y_test)
        # flare-airflow numbers rounds from 1, NVFlare from 0; the seed is the trainer's own formula.
        round_num = (model.current_round or 0) + 1
        seed = args.seed * 1_000_003 + round_num * 101 + index
        new_w, new_b = trainer.train(
            w, b, x, y, lr=args.lr, epochs=args.local_epochs, batch_size=args.batch_size, seed=seed
        )
        loss, acc = trainer.loss_and_accuracy(new_w, new_b, x, y)
        print(f"site {site} round {round_num}: {len(y)} samples, train loss {loss:.4f}, acc {acc:.4f}")
        flare.send(
            flare.FLModel(
                params={NPConstants.NUMPY_KEY: np.concatenate([new_w, new_b[None, :]]).astype(np.float32)},
                metrics={"accuracy": global_acc, "train_loss": loss, "train_accuracy": acc},
                meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(y)},
                current_round=model.current_round,
            )
        )


if __name__ == "__main__":
    main(sys.argv[1:])
