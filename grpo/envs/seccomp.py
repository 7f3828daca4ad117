"""The seccomp filter the sandbox loads (bubblewrap's ``--seccomp FD``): a classic BPF program.

Namespaces leave a few kernel objects shared with the host or unbounded by rlimits; the filter
makes their system calls fail with EPERM instead, as Docker's and Flatpak's default profiles do:

- the kernel keyrings (``add_key``, ``request_key``, ``keyctl``): not namespaced, so the caller's
  session keyring and the user keyring would be read, written and carried from run to run;
- System V IPC (``shm*``, ``sem*``, ``msg*``) and POSIX message queues (``mq_*``): memory that no
  process's address space holds, so RLIMIT_AS does not bound it;
- ``memfd_create``/``memfd_secret``: anonymous files outside the size-limited ``/tmp``;
- ``userfaultfd``, ``bpf``, ``perf_event_open``, ``io_uring_*``: large kernel attack surface that
  no test program needs.

On x86_64 the x32 ABI (system call numbers with bit 30 set) is refused as a whole, and a process
of another architecture (a 32-bit call gate) is killed: the numbers below are the native ones.
"""

from __future__ import annotations

import errno
import platform
import struct

__all__ = ["BLOCKED_SYSCALLS", "seccomp_program"]

BLOCKED_SYSCALLS = (
    "add_key", "request_key", "keyctl",
    "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    "memfd_create", "memfd_secret", "userfaultfd", "bpf", "perf_event_open",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip

# (AUDIT_ARCH value, {name: number}) from the kernel's unistd headers.
_X86_64 = dict(
    zip(BLOCKED_SYSCALLS, (248, 249, 250, 29, 30, 31, 67, 64, 65, 66, 220, 68, 69, 70, 71,
                           240, 241, 242, 243, 244, 245, 319, 447, 323, 321, 298, 425, 426, 427), strict=True)
)  # fmt: skip
_AARCH64 = dict(
    zip(BLOCKED_SYSCALLS, (217, 218, 219, 194, 196, 195, 197, 190, 193, 191, 192, 186, 189, 188, 187,
                           180, 181, 182, 183, 184, 185, 279, 447, 282, 280, 241, 425, 426, 427), strict=True)
)  # fmt: skip
_ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}

_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000  # SECCOMP_RET_*
_X32_BIT = 0x40000000


def seccomp_program(machine: str | None = None) -> bytes:
    """The filter as the bytes of a ``struct sock_filter[]`` (8 bytes per instruction).

    ``machine`` defaults to ``platform.machine()``. Raises ValueError for an architecture whose
    system call numbers are not listed here (the sandbox then refuses to run).
    """
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise ValueError(f"no seccomp filter for architecture {machine!r} (known: {sorted(_ARCHES)}).")
    arch, numbers = _ARCHES[machine]
    checks: list[tuple[int, int]] = [(_JGE, _X32_BIT)] if machine == "x86_64" else []
    checks += [(_JEQ, numbers[name]) for name in BLOCKED_SYSCALLS]
    program = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _KILL), (_LD_ABS, 0, 0, 0)]
    for i, (op, value) in enumerate(checks):  # jump over the remaining checks and the ALLOW
        program.append((op, len(checks) - i, 0, value))
    program += [(_RET, 0, 0, _ALLOW), (_RET, 0, 0, _ERRNO | errno.EPERM)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
