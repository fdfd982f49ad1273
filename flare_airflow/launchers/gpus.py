"""Per-host GPU allocation for local-process site jobs (NVFlare's GPU resource manager, locally).

Airflow pools bound how many of a site's jobs run at once; this module picks *which* devices a
job gets, so that no GPU is ever handed to two running jobs -- also across Airflow workers on the
same host. Each GPU has a lock file under a host-wide directory; a lease holds an exclusive
``flock`` on its GPUs' files. The kernel drops a lock when its holder exits however it exits
(success, crash, SIGKILL), so a dead job can never leak a GPU.

When ``nvidia-smi`` is on PATH, GPUs with the most free memory are preferred (LazyLLM's idle-GPU
selection) and GPUs with less free memory than ``mem_per_gpu_in_GiB`` are never chosen; without
it, the host's GPU count comes from the caller (the site's declared capacity).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from flare_airflow.core.envvars import FLARE_GPU_LOCK_DIR
from flare_airflow.core.errors import FlareAirflowError

DEFAULT_LOCK_DIR = "/tmp/flare-airflow-gpus"  # noqa: S108 - host-wide by design; override per deployment
LOCK_DIR_ENV = FLARE_GPU_LOCK_DIR
_POLL = 0.2


class GpuAllocationError(FlareAirflowError):
    """Not enough suitable GPUs on this host (or the request can never be met)."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    free_mib: int | None = None
    total_mib: int | None = None


def query_gpus(nvidia_smi: str | None = None) -> list[GpuInfo] | None:
    """The host's GPUs from ``nvidia-smi``, or ``None`` when it is not installed."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,memory.free,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise GpuAllocationError(f"nvidia-smi failed: {exc}") from exc
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            gpus.append(GpuInfo(int(parts[0]), int(float(parts[1])), int(float(parts[2]))))
        except (IndexError, ValueError) as exc:
            raise GpuAllocationError(f"unexpected nvidia-smi output line {line!r}") from exc
    return gpus


@dataclass
class GpuLease:
    """GPUs held by one job; ``release()`` (or process exit) frees them."""

    devices: list[int]
    _fds: list[int] = field(default_factory=list, repr=False)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(d) for d in self.devices)

    def release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        # A lease dropped without release() must not hold its GPUs until the process exits.
        self.release()

    def __enter__(self) -> GpuLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class GpuAllocator:
    """Hands out GPUs of this host to jobs, never one GPU to two jobs at once.

    :param num_gpus: GPUs on this host when ``nvidia-smi`` is absent (the site's declared capacity).
    :param lock_dir: host-wide directory of lock files (env ``FLARE_GPU_LOCK_DIR`` overrides the default).
    :param nvidia_smi: path of ``nvidia-smi`` (default: looked up on PATH).
    """

    def __init__(self, num_gpus: int | None = None, lock_dir: str | None = None, nvidia_smi: str | None = None):
        self.num_gpus = num_gpus
        self.lock_dir = Path(lock_dir or os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)
        self.nvidia_smi = nvidia_smi

    @property
    def _fix(self) -> str:
        return (
            f"the lock directory must be a directory writable by every Airflow worker user of this host "
            f"(set {LOCK_DIR_ENV} to choose another)"
        )

    def _ensure_lock_dir(self) -> None:
        """Create the lock directory, or say exactly why it cannot be used."""
        try:
            self.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o1777)
        except FileExistsError:
            raise GpuAllocationError(
                f"the GPU lock directory {self.lock_dir} exists but is not a directory; remove it or {self._fix}"
            ) from None
        except OSError as exc:
            raise GpuAllocationError(
                f"cannot create the GPU lock directory {self.lock_dir}: {exc.strerror or exc}; {self._fix}"
            ) from None
        if not os.access(self.lock_dir, os.W_OK | os.X_OK):
            raise GpuAllocationError(
                f"the GPU lock directory {self.lock_dir} is not writable by this user (uid {os.getuid()}); {self._fix}"
            )

    def _candidates(self, mem_per_gpu_gib: float | None) -> list[int]:
        gpus = query_gpus(self.nvidia_smi)
        if gpus is None:
            if self.num_gpus is None:
                raise GpuAllocationError("no nvidia-smi on this host and no GPU count declared for the site")
            return list(range(self.num_gpus))
        need_mib = None if mem_per_gpu_gib is None else mem_per_gpu_gib * 1024
        usable = [g for g in gpus if need_mib is None or g.free_mib is None or g.free_mib >= need_mib]
        # Most free memory first; ties by index so the choice is stable.
        usable.sort(key=lambda g: (-(g.free_mib or 0), g.index))
        return [g.index for g in usable]

    def try_acquire(self, count: int, mem_per_gpu_gib: float | None = None) -> GpuLease | None:
        """Lock ``count`` free GPUs now, or return ``None`` if not enough are free."""
        if count <= 0:
            return GpuLease(devices=[])
        self._ensure_lock_dir()
        lease = GpuLease(devices=[])
        for index in self._candidates(mem_per_gpu_gib):
            path = self.lock_dir / f"gpu-{index}.lock"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                lease.release()
                raise GpuAllocationError(
                    f"cannot open the GPU lock file {path}: {exc.strerror or exc}; {self._fix}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            lease.devices.append(index)
            lease._fds.append(fd)
            if len(lease.devices) == count:
                lease.devices.sort()
                return lease
        lease.release()
        return None

    def acquire(self, count: int, mem_per_gpu_gib: float | None = None, timeout: float | None = None) -> GpuLease:
        """Lock ``count`` GPUs, waiting up to ``timeout`` seconds (forever if ``None``) for them."""
        total = len(self._candidates(mem_per_gpu_gib))
        if count > total:
            raise GpuAllocationError(
                f"a job asks for {count} GPU(s) but this host has only {total} suitable "
                f"(mem_per_gpu_in_GiB={mem_per_gpu_gib}); it could never run here"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            lease = self.try_acquire(count, mem_per_gpu_gib)
            if lease is not None:
                return lease
            if deadline is not None and time.monotonic() >= deadline:
                raise GpuAllocationError(f"{count} GPU(s) did not become free within {timeout:g}s")
            time.sleep(_POLL)
