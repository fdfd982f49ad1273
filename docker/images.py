"""Build the project's images, cached by content: ``make images`` runs this.

Each image is tagged ``localhost/flare-airflow/<name>:<content hash>`` (and ``:latest``); the hash
covers the Dockerfile, every file of the build context, the base image's ID and the build arguments.
When an image with that tag exists nothing is built, so a warm ``make test`` rebuilds nothing.

The build context is staged in a temporary directory with only what the Dockerfiles copy (never
``.venv`` or an Airflow home), plus the machine's extra CA certificates
(``/usr/local/share/ca-certificates/*.crt``) for the build stages' downloads when a proxy re-signs
registry traffic; the certificates are not part of the hash and never reach a final image.

Usage: ``python docker/images.py [--engine podman|docker] [--base-image IMAGE] [NAME ...]``
(names: trainer, airflow, postgres; default all). Prints ``NAME=TAG`` per image on stdout. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
DEFAULT_BASE_IMAGE = "localhost/debian:bookworm"
REPOSITORY = "localhost/flare-airflow"
IMAGES = {
    "trainer": DOCKER_DIR / "Dockerfile.trainer",
    "airflow": DOCKER_DIR / "Dockerfile.airflow",
    "postgres": DOCKER_DIR / "Dockerfile.postgres",  # for docker/compose.yaml where no registry is reachable
}
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


def content_hash(name: str, base_id: str, base_image: str) -> str:
    digest = hashlib.sha256()
    for part in (name, base_image, base_id, UV_VERSION):
        digest.update(part.encode() + b"\0")
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


def build(engine: str, name: str, base_image: str, base_id: str) -> str:
    tag = f"{REPOSITORY}/{name}:{content_hash(name, base_id, base_image)}"
    if image_id(engine, tag) is None:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"flare-image-{name}-") as context:
            stage_context(Path(context))
            argv = [
                engine,
                "build",
                "-f",
                str(IMAGES[name]),
                "-t",
                tag,
                "--build-arg",
                f"BASE_IMAGE={base_image}",
                "--build-arg",
                f"UV_VERSION={UV_VERSION}",
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"one of {', '.join(IMAGES)} (default: all)")
    parser.add_argument("--engine", default=None, help="podman or docker (default: $CONTAINER_ENGINE, podman, docker)")
    parser.add_argument("--base-image", default=os.environ.get("BASE_IMAGE") or DEFAULT_BASE_IMAGE)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(IMAGES))
    if unknown:
        parser.error(f"unknown image {', '.join(unknown)}: choose from {', '.join(IMAGES)}")
    try:
        engine = args.engine or default_engine()
        base_id = ensure_base(engine, args.base_image)
        for name in args.names or list(IMAGES):
            print(f"{name}={build(engine, name, args.base_image, base_id)}", flush=True)
    except (ImageBuildError, subprocess.CalledProcessError) as exc:
        print(f"images.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
