"""The per-host GPU allocator: exclusive leases across racing processes, idle-GPU preference
with a (fake, named as such) nvidia-smi, and release on every exit path."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flare_airflow.launchers.gpus import GpuAllocationError, GpuAllocator, query_gpus

FAKE_NVIDIA_SMI = """#!/bin/sh
# Fake nvidia-smi for tests: index, free MiB, total MiB (the query flags are ignored).
cat <<'CSV'
{rows}
CSV
"""


@pytest.fixture
def fake_smi(tmp_path: pathlib.Path):
    def make(rows: list[tuple[int, int, int]]) -> pathlib.Path:
        folder = tmp_path / "fake-bin"
        folder.mkdir(exist_ok=True)
        exe = folder / "nvidia-smi"
        exe.write_text(FAKE_NVIDIA_SMI.format(rows="\n".join(f"{i}, {free}, {total}" for i, free, total in rows)))
        exe.chmod(0o755)
        return exe

    return make


def test_leases_are_exclusive_and_released(tmp_path: pathlib.Path) -> None:
    alloc = GpuAllocator(num_gpus=3, lock_dir=str(tmp_path / "locks"))
    first = alloc.acquire(2)
    assert first.devices == [0, 1] and first.cuda_visible_devices == "0,1"
    assert alloc.try_acquire(2) is None
    second = alloc.acquire(1)
    assert second.devices == [2]
    first.release()
    with alloc.acquire(2) as third:
        assert third.devices == [0, 1]
    assert alloc.acquire(2).devices == [0, 1]  # released by the context manager
    assert alloc.acquire(0).cuda_visible_devices == ""


def test_a_request_larger_than_the_host_fails_at_once(tmp_path: pathlib.Path) -> None:
    alloc = GpuAllocator(num_gpus=2, lock_dir=str(tmp_path / "locks"))
    started = time.monotonic()
    with pytest.raises(GpuAllocationError, match=r"asks for 3 GPU.*only 2 suitable"):
        alloc.acquire(3)
    assert time.monotonic() - started < 1


def test_waiting_for_a_busy_gpu_times_out_with_a_reason(tmp_path: pathlib.Path) -> None:
    alloc = GpuAllocator(num_gpus=1, lock_dir=str(tmp_path / "locks"))
    held = alloc.acquire(1)
    with pytest.raises(GpuAllocationError, match=r"did not become free within 0\.5s"):
        alloc.acquire(1, timeout=0.5)
    held.release()
    assert alloc.acquire(1, timeout=0.5).devices == [0]


def test_prefers_gpus_with_most_free_memory_and_honours_mem_per_gpu(tmp_path: pathlib.Path, fake_smi) -> None:
    smi = fake_smi([(0, 1000, 16000), (1, 15000, 16000), (2, 8000, 16000), (3, 15000, 16000)])
    assert [g.index for g in query_gpus(str(smi))] == [0, 1, 2, 3]
    alloc = GpuAllocator(lock_dir=str(tmp_path / "locks"), nvidia_smi=str(smi))
    lease = alloc.acquire(2)
    assert lease.devices == [1, 3]  # the two idlest; ties broken by index
    # 7.5 GiB free needed: GPU 0 (1000 MiB) never qualifies; 1 and 3 are taken; 2 remains.
    assert alloc.acquire(1, mem_per_gpu_gib=7.5).devices == [2]
    with pytest.raises(GpuAllocationError, match="only 3 suitable"):
        alloc.acquire(4, mem_per_gpu_gib=7.5)


def test_nvidia_smi_on_path_is_used(tmp_path: pathlib.Path, fake_smi, monkeypatch) -> None:
    smi = fake_smi([(0, 100, 16000), (1, 9000, 16000)])
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    assert GpuAllocator(num_gpus=8, lock_dir=str(tmp_path / "l")).acquire(1).devices == [1]


RACER = """
import json, sys, time
from flare_airflow.launchers.gpus import GpuAllocator
alloc = GpuAllocator(lock_dir=sys.argv[1], nvidia_smi=sys.argv[2])
with alloc.acquire(1, timeout=60) as lease:
    start = time.time()
    time.sleep(0.3)
    end = time.time()
print(json.dumps({"device": lease.devices[0], "start": start, "end": end}))
"""


def test_many_processes_racing_never_share_a_gpu(tmp_path: pathlib.Path, fake_smi) -> None:
    smi = fake_smi([(i, 16000, 16000) for i in range(3)])
    locks = tmp_path / "locks"
    procs = [
        subprocess.Popen([sys.executable, "-c", RACER, str(locks), str(smi)], stdout=subprocess.PIPE, text=True)
        for _ in range(9)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        results.append(json.loads(out))
    assert {r["device"] for r in results} <= {0, 1, 2}
    for i, a in enumerate(results):
        for b in results[i + 1 :]:
            if a["device"] == b["device"]:
                assert a["end"] <= b["start"] or b["end"] <= a["start"], (a, b)


HOLDER = """
import os, sys, time
from flare_airflow.launchers.gpus import GpuAllocator
lease = GpuAllocator(num_gpus=1, lock_dir=sys.argv[1]).acquire(1)
print("held", flush=True)
if sys.argv[2] == "crash":
    raise RuntimeError("trainer crashed")
if sys.argv[2] == "exit":
    sys.exit(0)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["exit", "crash", "sigkill"])
def test_every_exit_path_frees_the_gpu(tmp_path: pathlib.Path, how: str) -> None:
    locks = tmp_path / "locks"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(locks), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    alloc = GpuAllocator(num_gpus=1, lock_dir=str(locks))
    if how == "sigkill":
        assert alloc.try_acquire(1) is None  # really held while the job runs
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert alloc.acquire(1, timeout=5).devices == [0]


def test_site_runner_gives_the_trainer_its_devices_and_releases_them(tmp_path: pathlib.Path, monkeypatch) -> None:
    from flare_airflow.core.failure_record import read_failure
    from flare_airflow.core.model import FLModel, write_artifact
    from flare_airflow.site_task.runner import run_site
    from flare_airflow.site_task.spec import SiteRun

    monkeypatch.setenv("FLARE_GPU_LOCK_DIR", str(tmp_path / "locks"))
    import numpy as np

    global_model = tmp_path / "global.safetensors"
    write_artifact(global_model, FLModel(params={"w": np.zeros(2, np.float32)}))
    script = tmp_path / "t.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            import flare_airflow.client as flare
            m = flare.receive()
            open(sys.argv[1], "w").write(os.environ["CUDA_VISIBLE_DEVICES"])
            if sys.argv[2] == "crash":
                sys.exit(5)
            flare.send(flare.FLModel(params=m.params, meta={"num_samples": 1}))
            """
        )
    )
    seen = tmp_path / "seen.txt"
    for mode in ("ok", "crash"):
        run = SiteRun(
            job="j", run_id="r", round=1, total_rounds=1, site="site-1", task="train",
            argv=[sys.executable, str(script), str(seen), mode], global_model=str(global_model),
            output=str(tmp_path / f"{mode}.safetensors"),
            assign_gpus=True, num_gpus=2, gpu_capacity=3,
        )  # fmt: skip
        held = GpuAllocator(num_gpus=3, lock_dir=str(tmp_path / "locks")).acquire(1, timeout=5)  # another job: GPU 0
        rc, _ = run_site(run, handle_signals=False)
        assert seen.read_text() == "1,2"
        held.release()
        with GpuAllocator(num_gpus=3, lock_dir=str(tmp_path / "locks")).acquire(3, timeout=2) as everything:
            assert everything.devices == [0, 1, 2]  # the runner released its two
        if mode == "crash":
            assert rc != 0 and "exit code 5" in (read_failure(tmp_path / "crash.safetensors") or "")
        else:
            assert rc == 0


@pytest.mark.parametrize(
    ("lock_dir", "message"),
    [
        ("{tmp}/a-file", "the GPU lock directory {tmp}/a-file exists but is not a directory; remove it"),
        ("{tmp}/a-file/locks", "cannot create the GPU lock directory {tmp}/a-file/locks: Not a directory"),
        # /proc/sys refuses writes even to root: a lock directory nobody on this host can use.
        ("/proc/sys", "the GPU lock directory /proc/sys is not writable by this user"),
    ],
)
def test_an_unusable_lock_directory_is_named_with_what_to_do(
    tmp_path: pathlib.Path, lock_dir: str, message: str
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(GpuAllocationError) as info:
        GpuAllocator(num_gpus=1, lock_dir=lock_dir.format(tmp=tmp_path)).acquire(1, timeout=1)
    assert message.format(tmp=tmp_path) in str(info.value)
    assert "FLARE_GPU_LOCK_DIR" in str(info.value)
