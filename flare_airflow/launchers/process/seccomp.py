"""The seccomp filter of a confined trainer: no process may inspect or steer another.

bwrap leaves the trainer its own PID namespace, so the worker and every process outside are
invisible to it; inside, bwrap's own init (PID 1) has the trainer's uid and could be attached with
``ptrace``. Attaching it gains nothing the trainer lacks, but a trainer has no business debugging
processes, and the rule "the trainer cannot ptrace anything" is one a site admin can check. So
``ptrace``, ``process_vm_readv``/``process_vm_writev`` (reading another process's memory) and
``pidfd_getfd`` (taking another process's file descriptors) fail with ``EPERM``.

The program is classic BPF, written here instead of pulling in libseccomp: four syscalls on three
architectures. A syscall of an architecture not listed passes (the filter then only does not add
its rule there; the user namespace without capabilities still holds).
"""

from __future__ import annotations

import errno
import os
import struct

# <linux/audit.h> AUDIT_ARCH_* and the syscall numbers of <asm/unistd*.h> for each.
_X32 = 0x40000000  # x86_64's x32 ABI: its own numbers, with this bit set
_DENIED: dict[int, tuple[int, ...]] = {
    # x86_64: ptrace, process_vm_readv, process_vm_writev, pidfd_getfd; and their x32 numbers
    0xC000003E: (101, 310, 311, 438, _X32 | 521, _X32 | 539, _X32 | 540, _X32 | 438),
    0x40000003: (26, 347, 348, 438),  # i386 (32-bit programs on x86_64)
    0xC00000B7: (117, 270, 271, 438),  # aarch64
}

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_DENY = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO | EPERM


def _program() -> list[tuple[int, int, int, int]]:
    """``(code, jt, jf, k)`` instructions; ``jt``/``jf`` are relative forward jumps."""
    body: list[tuple[int, int, int, int]] = []
    blocks = list(_DENIED.items())
    # Layout: [ld arch] then per arch: [jeq arch ? 0 : skip] [ld nr] [jeq nr -> deny]... [ret allow];
    # then [ret allow] for other arches and the shared [ret deny] last.
    sizes = [2 + len(nrs) + 1 for _, nrs in blocks]
    total = 1 + sum(sizes) + 2
    deny_at = total - 1
    body.append((_LD_W_ABS, 0, 0, _ARCH))
    for (arch, nrs), size in zip(blocks, sizes, strict=True):
        body.append((_JEQ_K, 0, size - 1, arch))
        body.append((_LD_W_ABS, 0, 0, _NR))
        for nr in nrs:
            here = len(body)
            body.append((_JEQ_K, deny_at - here - 1, 0, nr))
        body.append((_RET_K, 0, 0, _ALLOW))
    body.append((_RET_K, 0, 0, _ALLOW))
    body.append((_RET_K, 0, 0, _DENY))
    assert len(body) == total
    return body


def filter_bytes() -> bytes:
    """The filter as bwrap's ``--seccomp FD`` reads it: an array of ``struct sock_filter``."""
    return b"".join(struct.pack("=HBBI", *insn) for insn in _program())


def filter_fd() -> int:
    """A readable file descriptor holding :func:`filter_bytes`, at offset 0 (the caller closes it)."""
    fd = os.memfd_create("flare-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, filter_bytes())
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
