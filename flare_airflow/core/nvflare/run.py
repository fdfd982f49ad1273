"""Run an unmodified NVFlare Client API script as a flare-airflow trainer.

    python -m flare_airflow.core.nvflare.run [--params-exchange numpy|pytorch] [--transfer FULL|DIFF] SCRIPT [ARG ...]

What a job with ``trainer.nvflare`` launches (``launchers/trainer.py`` puts this module in front of
the script, for every backend: a process, a pod, a SLURM job). It puts the ``nvflare`` stand-in
(``shim/``) first on the path, also in ``PYTHONPATH`` so that processes the script starts see it;
prints what the script keeps across rounds (:mod:`.state_check`); and runs the script as
``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARG ...`` would set them.

The stand-in takes precedence over an ``nvflare`` installed in the trainer's environment: the real
Client API talks to a FLARE client process through a pipe, and there is none under flare-airflow.
The real package's other modules (models, utilities, recipes) stay importable.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from flare_airflow.core.envvars import FLARE_NVFLARE_PARAMS_EXCHANGE, FLARE_NVFLARE_TRANSFER
from flare_airflow.core.nvflare.state_check import check_file

SHIM_DIR = Path(__file__).resolve().parent / "shim"
MODULE = "flare_airflow.core.nvflare.run"
CONTRACT_NOTE = (
    "nvflare.client (flare-airflow compatibility): this process runs ONE round of one site; "
    "state kept in memory across rounds starts afresh each round (docs/coming-from-nvflare.md)"
)


def wrapper_argv(params_exchange: str, transfer: str) -> list[str]:
    """The arguments that put this runner between the interpreter and the script."""
    return ["-m", MODULE, "--params-exchange", params_exchange, "--transfer", transfer]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-exchange", choices=("numpy", "pytorch"), default="numpy")
    parser.add_argument("--transfer", choices=("FULL", "DIFF"), default="FULL")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    script = Path(options.script)
    if not script.is_file():
        parser.exit(2, f"{MODULE}: trainer script {script} does not exist\n")
    os.environ[FLARE_NVFLARE_PARAMS_EXCHANGE] = options.params_exchange
    os.environ[FLARE_NVFLARE_TRANSFER] = options.transfer
    shim = str(SHIM_DIR)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH")) if p)
    print(CONTRACT_NOTE, file=sys.stderr, flush=True)
    for finding in check_file(script):
        print(f"nvflare.client (flare-airflow): {finding.describe(str(script))}", file=sys.stderr, flush=True)
    # As `python SCRIPT`: the script's directory first (its sibling modules), then the stand-in.
    sys.path[:1] = [str(script.resolve().parent), shim]
    sys.argv = [str(script), *options.args]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
