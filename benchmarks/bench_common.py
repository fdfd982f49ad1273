"""Helpers shared by the benchmarks: statistics, markdown tables, machine details, failures."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

MIB = 1 << 20
GB = 1e9  # throughput is reported in GB/s = 10^9 bytes per second


class BenchmarkFailed(RuntimeError):
    """A benchmark could not measure what it claims to measure (a task failed, a result is wrong)."""


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only the markdown report."""
    print(message, file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """``min-max`` of the repetitions, so the reader sees the noise next to the median."""
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / GB if seconds > 0 else float("inf")


def rotate(items: Sequence[Any], rep: int) -> list[Any]:
    """Rotate the order of side-by-side cases each repetition, so no case always runs first."""
    k = rep % len(items)
    return [*items[k:], *items[:k]]


@dataclass
class Table:
    """A markdown table with an optional heading and notes under it."""

    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""] if self.title else []
        lines.append("| " + " | ".join(self.header) + " |")
        lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.header))) + "|")
        lines.extend("| " + " | ".join(row) + " |" for row in self.rows)
        if self.notes:
            lines.append("")
            lines.extend(self.notes)
        return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _meminfo_gib(key: str) -> str:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def filesystem_of(path: str) -> tuple[str, str]:
    """``(mount point, fs type)`` of the mount that holds ``path`` (from /proc/mounts)."""
    path = os.path.realpath(path)
    best = ("/", "unknown")
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt, fstype = parts[1], parts[2]
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, fstype)
    except OSError:
        pass
    return best


def _git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10).stdout
        return rev + (" (working tree has uncommitted changes)" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_table(tmp_dir: str) -> Table:
    flags = _cpu_flags()
    simd = [f for f in ("avx2", "avx512f", "sha_ni") if f in flags]
    mount, fstype = filesystem_of(tmp_dir)
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 0
    table = Table("Machine", ["item", "value"])
    table.add("date (UTC)", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"))
    table.add("CPU", _cpu_model())
    table.add("CPU flags that matter here", ", ".join(simd) or "none of avx2/avx512f/sha_ni")
    table.add("cores", f"{os.cpu_count()} logical, {affinity} usable by this process")
    table.add("RAM", f"{_meminfo_gib('MemTotal')} total, {_meminfo_gib('MemAvailable')} available at start")
    table.add("load average at start", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    table.add("transparent huge pages", _read("/sys/kernel/mm/transparent_hugepage/enabled"))
    table.add("kernel", platform.release())
    table.add("python", sys.version.split()[0])
    table.add("numpy", _version("numpy"))
    table.add("safetensors", _version("safetensors"))
    table.add("apache-airflow", _version("apache-airflow"))
    table.add("flare-airflow", f"{_version('flare-airflow')}, git {_git_revision()}")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var)
        table.add(f"`{var}`", f"`{value}` (set in the environment; left as is)" if value is not None else "unset")
    table.add("temporary files", f"{tmp_dir} on {mount} ({fstype})")
    return table


@dataclass
class CpuSnapshot:
    """Machine-wide busy/steal CPU time and our own (process tree) CPU time, to expose foreign load."""

    wall: float
    busy: float
    steal: float
    ours: float

    @classmethod
    def take(cls) -> CpuSnapshot:
        import resource
        import time

        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user)
        idle = fields[3] + fields[4]
        steal = fields[7] if len(fields) > 7 else 0
        busy = sum(fields[:8]) - idle - steal
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        ours = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
        return cls(time.monotonic(), busy / tick, steal / tick, ours)

    def foreign_load(self, end: CpuSnapshot) -> str:
        wall = end.wall - self.wall
        other = max(0.0, (end.busy - self.busy) - (end.ours - self.ours))
        steal = end.steal - self.steal
        return (
            f"{other / wall:.2f} cores busy with other processes on average ({other:.0f} CPU-s over {wall:.0f} s); "
            f"hypervisor steal {steal / wall:.2f} cores"
        )


# --- memory probes (Linux), stdlib only: NVFlare's venv imports them too (nvflare_jobs/aggregate.py) ---


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_hwm() -> bool:
    """Reset the RSS high-water mark (VmHWM, what ru_maxrss reports) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def rss_baseline() -> tuple[bool, int]:
    """Reset the high-water mark; return (whether that worked, the KiB a later VmHWM is measured from)."""
    reset = reset_hwm()
    return reset, status_kib("VmRSS") if reset else status_kib("VmHWM")
