"""Softmax regression on scikit-learn's bundled digits, one federated site per process.

The same script trains (task ``train``: local SGD from the received global model) and evaluates
(task ``evaluate``: accuracy of the global model on the held-out split). It needs numpy,
scikit-learn and the Client API only -- no Airflow.

Data: 20 % of the digits are held out (stratified, seeded); the rest is split across
``--num-sites`` sites non-IID with a Dirichlet(alpha) draw per class. Site ``site-K`` gets shard
K-1. Everything is seeded, so two runs give bitwise-identical models. A site that keeps its shard
on its own disk (``--export-site SITE PATH`` writes it) sets ``DIGITS_SITE_DATA`` to that file in
its site policy; the trainer then reads that file instead.

Run ``python trainer.py --init-model PATH`` to write a zero-initialised model.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import os
import pathlib
import sys
from collections.abc import Callable

import numpy as np
from safetensors.numpy import save_file

import flare_airflow.client as flare

NUM_FEATURES = 64
SITE_DATA_ENV = "DIGITS_SITE_DATA"
DATA_FILE_ENV = "DIGITS_DATA_FILE"
NUM_CLASSES = 10


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-sites", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (smaller = less IID)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-model", help="write a zero-initialised model to this path and exit")
    p.add_argument(
        "--export-site",
        nargs=2,
        metavar=("SITE", "PATH"),
        help="write SITE's training shard to PATH (.npz) and exit: the data a site keeps on its own disk",
    )
    return p.parse_args(argv)


def digits_file() -> pathlib.Path:
    """scikit-learn's bundled copy of the UCI digits (what ``load_digits`` reads).

    Read directly: importing scikit-learn costs ~2 s per process, paid by every site job. An image
    without scikit-learn (``docker/Dockerfile.trainer``) names its copy of the file in
    ``DIGITS_DATA_FILE``.
    """
    data_file = os.environ.get(DATA_FILE_ENV)
    if data_file:
        return pathlib.Path(data_file)
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("this example needs scikit-learn installed (for its bundled digits data)")
    return pathlib.Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"


def load_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stratified, seeded split: 20 % of each class held out for evaluating the global model."""
    with gzip.open(digits_file(), "rt") as fh:
        data = np.loadtxt(fh, delimiter=",")
    x, y = (data[:, :-1] / 16.0).astype(np.float32), data[:, -1].astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for cls in range(NUM_CLASSES):
        idx = rng.permutation(np.flatnonzero(y == cls))
        test[idx[: round(0.2 * len(idx))]] = True
    return x[~test], x[test], y[~test], y[test]


def partition(y: np.ndarray, num_sites: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Dirichlet non-IID split: for each class, its samples are divided by a Dirichlet(alpha) draw."""
    rng = np.random.default_rng(seed)
    shards: list[list[int]] = [[] for _ in range(num_sites)]
    for cls in range(NUM_CLASSES):
        idx = np.flatnonzero(y == cls)
        rng.shuffle(idx)
        share = rng.dirichlet(np.full(num_sites, alpha))
        cuts = (np.cumsum(share)[:-1] * len(idx)).astype(int)
        for site, part in enumerate(np.split(idx, cuts)):
            shards[site].extend(part.tolist())
    return [np.sort(np.array(s, dtype=np.int64)) for s in shards]


def site_index(site: str, num_sites: int) -> int:
    try:
        index = int(site.rsplit("-", 1)[1]) - 1
    except (IndexError, ValueError):
        index = -1
    if not 0 <= index < num_sites:
        raise SystemExit(f"site name {site!r} must be site-1 .. site-{num_sites} for this example")
    return index


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def loss_and_accuracy(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    p = softmax(x @ w + b)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    return loss, float((p.argmax(axis=1) == y).mean())


def train(
    w: np.ndarray,
    b: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    seed: int,
    on_epoch: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    onehot = np.eye(NUM_CLASSES, dtype=np.float32)[y]
    for epoch in range(epochs):
        if on_epoch is not None and epoch:
            on_epoch(epoch, w, b)
        order = rng.permutation(len(y))
        for start in range(0, len(y), batch_size):
            batch = order[start : start + batch_size]
            xb, tb = x[batch], onehot[batch]
            grad = (softmax(xb @ w + b) - tb) / len(batch)
            w = w - np.float32(lr) * (xb.T @ grad)
            b = b - np.float32(lr) * grad.sum(axis=0)
    if on_epoch is not None:
        on_epoch(epochs, w, b)
    return w.astype(np.float32), b.astype(np.float32)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.init_model:
        save_file(
            {"weight": np.zeros((NUM_FEATURES, NUM_CLASSES), np.float32), "bias": np.zeros(NUM_CLASSES, np.float32)},
            args.init_model,
        )
        return 0
    x_train, x_test, y_train, y_test = load_split(args.seed)
    if args.export_site:
        site, path = args.export_site
        shard = partition(y_train, args.num_sites, args.alpha, args.seed)[site_index(site, args.num_sites)]
        np.savez(path, x=x_train[shard], y=y_train[shard])
        return 0
    model = flare.receive()
    w, b = model.params["weight"], model.params["bias"]
    if flare.is_evaluate():
        loss, acc = loss_and_accuracy(w, b, x_test, y_test)
        print(f"global model after round {model.current_round}: test accuracy {acc:.4f}, test loss {loss:.4f}")
        flare.send(flare.FLModel(metrics={"accuracy": acc, "loss": loss}))
        return 0
    hp = flare.get_hparams()
    data_file = os.environ.get(SITE_DATA_ENV)
    if data_file:  # the site's own data, where its admin put it (its site policy sets the variable)
        with np.load(data_file) as data:
            x, y = data["x"], data["y"]
        print(f"site {model.site}: training data from {data_file}")
    else:
        shard = partition(y_train, args.num_sites, args.alpha, args.seed)[site_index(model.site or "", args.num_sites)]
        x, y = x_train[shard], y_train[shard]
    epochs = int(hp.get("local_epochs", 5))

    def log_epoch(epoch: int, w_now: np.ndarray, b_now: np.ndarray) -> None:
        # The training loss after each local epoch, for the experiment tracker (docs/tracking.md):
        # one series per site, steps continuing across rounds.
        step = ((model.current_round or 1) - 1) * epochs + epoch
        flare.log_metric("epoch_train_loss", loss_and_accuracy(w_now, b_now, x, y)[0], step=step)

    seed = args.seed * 1_000_003 + (model.current_round or 0) * 101 + site_index(model.site or "", args.num_sites)
    new_w, new_b = train(
        w,
        b,
        x,
        y,
        lr=float(hp.get("lr", 0.5)),
        epochs=epochs,
        batch_size=int(hp.get("batch_size", 32)),
        seed=seed,
        on_epoch=log_epoch,
    )
    loss, acc = loss_and_accuracy(new_w, new_b, x, y)
    print(f"site {model.site} round {model.current_round}: {len(y)} samples, train loss {loss:.4f}, acc {acc:.4f}")
    flare.send(
        flare.FLModel(
            params={"weight": new_w, "bias": new_b},
            metrics={"train_loss": loss, "train_accuracy": acc},
            meta={"num_samples": len(y)},
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
