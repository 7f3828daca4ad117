"""Run untrusted Python code (a model's) in a separate, resource-limited, isolated process.

`run_python(code, limits)` writes ``code`` to ``main.py`` in a fresh temporary directory and runs
it there, Linux only, in this order::

    unshare --mount --net --ipc --uts --pid --fork --mount-proc [--user --map-root-user]
      stage 1 (namespace root): mounts private; the work dir bind-mounted read-write; every other
              mount (/, /proc, /sys, /dev, ...) remounted read-only; /run and /dev/shm covered by
              empty read-only tmpfs (hides the Unix sockets there); then privileges dropped: as
              real root, setuid/setgid to nobody (65534); as a user, no capabilities after exec
              (SECBIT_NOROOT); no_new_privs in both cases; exec stage 2
      stage 2: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC = 1 (no new
              process or thread), RLIMIT_CORE = 0; cwd = the work dir; run main.py

What that gives, each tested in tests/test_tools.py: no network (an empty network namespace: no
interface but a down loopback); CPU time (an infinite loop is killed at ``cpu_seconds``); memory
(an allocation past ``memory_bytes`` of address space raises MemoryError); no fork or thread (a
fork bomb gets EAGAIN); no write outside the work dir (read-only file system); wall time
(``wall_seconds``, then the process group is killed: catches ``sleep``); output (at most
``output_bytes`` of stdout + stderr are kept; past that the process is killed). Processes outside
the sandbox cannot be signalled (own PID namespace).

What it does not give: reads are not restricted beyond the sandbox user's file permissions (as a
non-root user the code can read that user's files, e.g. the home directory, and print them into
the model's context); the kernel is shared (a kernel exploit escapes, as from any container). It
needs ``unshare`` (util-linux) and namespaces: as root, or with unprivileged user namespaces
enabled (some distributions disable them, e.g. Ubuntu 24.04's AppArmor restriction). Where setup
fails, `SandboxUnavailable` is raised and nothing runs: the code is never run unconfined.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, NamedTuple

from grpo.envs.tools import Tool

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "python_tool", "run_python"]

NOBODY = 65534
SETUP_FAILED = 125

# Stage 1 runs as root of the new namespaces, before any untrusted code: trusted, may use ctypes.
_STAGE1 = r"""
import ctypes, os, sys
work, stage2, mode, prefix, staging = sys.argv[1:6]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
OPTS = {"nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC, "noatime": 1024, "nodiratime": 2048,
        "relatime": 1 << 21}

def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")

def unescape(path):
    return path.encode().decode("unicode_escape")

try:
    mount(None, "/", None, REC | PRIVATE)
    for d in ("/run", "/var/run", "/dev/shm"):
        if os.path.isdir(d) and not os.path.islink(d):
            mount("tmpfs", d, "tmpfs", NOSUID | NODEV | NOEXEC | RDONLY, "size=16k,mode=755")
    mount(work, work, None, BIND)
    if mode == "root":  # nobody must reach the interpreter: cover the first closed ancestor of its
        parts = prefix.strip("/").split("/")  # prefix with a tmpfs that holds only the prefix
        closed = next((p for p in ("/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1))
                       if not os.stat(p).st_mode & 0o001), None)
        if closed is not None:
            mount(prefix, staging, None, BIND | REC)
            mount("tmpfs", closed, "tmpfs", NOSUID | NODEV, "size=64k,mode=755")
            os.makedirs(prefix, mode=0o755)
            mount(staging, prefix, None, BIND | REC)
    for line in open("/proc/self/mountinfo").read().splitlines():
        fields = line.split()
        point, opts = unescape(fields[4]), fields[5].split(",")
        if point == work or "ro" in opts:
            continue
        flags = REMOUNT | BIND | RDONLY | sum(OPTS.get(o, 0) for o in set(opts))
        mount(None, point, None, flags)
except OSError as e:
    print(f"grpo sandbox setup failed: {e}", flush=True)
    os._exit(125)
child = os.fork()
if child == 0:  # the untrusted side: drop privileges, then stage 2
    try:
        if mode == "root":
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        elif libc.prctl(28, 0x2F, 0, 0, 0) != 0:  # PR_SET_SECUREBITS: NOROOT, NO_SETUID_FIXUP, locked
            raise OSError(ctypes.get_errno(), "PR_SET_SECUREBITS")
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        os.execv(sys.executable, [sys.executable, "-I", "-u", "-c", stage2, work, *sys.argv[6:]])
    except OSError as e:
        print(f"grpo sandbox setup failed: {e}", flush=True)
    os._exit(125)
status = os.waitpid(child, 0)[1]
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""

# Stage 2 runs unprivileged, sets its own limits, then runs the untrusted main.py.
_STAGE2 = r"""
import os, resource, runpy, sys
work, cpu, mem, fsize = sys.argv[1], *map(int, sys.argv[2:5])
for lim, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                        (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, 64, 64),
                        (resource.RLIMIT_NPROC, 1, 1), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(lim, (soft, hard))  # CPU: SIGXCPU at the limit, SIGKILL a second later
os.chdir(work)
sys.argv = ["main.py"]
sys.path.insert(0, work)
runpy.run_path("main.py", run_name="__main__")
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here (no Linux, no ``unshare``, namespaces not permitted)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one `run_python` call.

    Args:
        cpu_seconds: CPU time (RLIMIT_CPU); the process is killed past it.
        wall_seconds: real time; the process group is killed past it (catches sleeping code).
        memory_bytes: address space (RLIMIT_AS); allocations past it raise MemoryError.
        output_bytes: stdout + stderr kept; past it the process is killed.
        file_bytes: largest file the code may write in its work dir (RLIMIT_FSIZE).
    """

    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 10_000
    file_bytes: int = 2**20

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "output_bytes", "file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits({name}={getattr(self, name)!r}): must be positive.")


SandboxStatus = Literal["ok", "error", "timeout", "killed", "output_limit"]


class SandboxResult(NamedTuple):
    """One run: ``output`` (stdout and stderr, cut at the limit), ``returncode`` (128 + the
    signal when a limit killed it; negative when the sandbox was killed from outside for the
    wall-time or output limit), ``status``, wall ``seconds``."""

    output: str
    returncode: int
    status: SandboxStatus
    seconds: float


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in the sandbox described in the module docstring.

    Raises `SandboxUnavailable` (before running anything) where the sandbox cannot be set up.
    """
    limits = limits or SandboxLimits()
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        raise SandboxUnavailable(
            f"grpo.envs.sandbox needs Linux with the unshare command (util-linux); this is {sys.platform} "
            f"with unshare at {shutil.which('unshare')}."
        )
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-", ignore_cleanup_errors=True) as tmp:
        top = os.path.realpath(tmp)
        work, staging = os.path.join(top, "work"), os.path.join(top, "python")
        os.mkdir(work)
        os.mkdir(staging)
        Path(work, "main.py").write_text(code)
        root = os.geteuid() == 0
        if root:  # the code runs as nobody: its work dir must be its own
            os.chmod(top, 0o755)
            for path in (work, os.path.join(work, "main.py")):
                os.chown(path, NOBODY, NOBODY)
        return _run(_command(work, staging, limits, root), work, limits)


def _command(work: str, staging: str, limits: SandboxLimits, root: bool) -> list[str]:
    namespaces = ["--mount", "--net", "--ipc", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child"]
    user = [] if root else ["--user", "--map-root-user"]
    numbers = [str(int(limits.cpu_seconds)), str(int(limits.memory_bytes)), str(int(limits.file_bytes))]
    mode, prefix = ("root" if root else "user"), os.path.realpath(sys.base_prefix)
    stage1 = [sys.executable, "-I", "-c", _STAGE1, work, _STAGE2, mode, prefix, staging, *numbers]
    return ["unshare", *namespaces, *user, *stage1]


def _run(command: list[str], work: str, limits: SandboxLimits) -> SandboxResult:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work}
    env |= {f"{lib}_NUM_THREADS": "1" for lib in ("OMP", "OPENBLAS", "MKL")}  # no thread may start
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=work,
        env=env,
        start_new_session=True,
    )
    if proc.stdout is None:  # cannot happen with stdout=PIPE; narrows the type
        raise RuntimeError("grpo.envs.sandbox: the child's stdout pipe is missing.")
    chunks: list[bytes] = []
    overflow = threading.Event()
    reader = threading.Thread(target=_read, args=(proc, proc.stdout, chunks, limits.output_bytes, overflow))
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc)
        proc.wait()
    reader.join()
    proc.stdout.close()
    output = b"".join(chunks)[: limits.output_bytes].decode("utf-8", errors="replace")
    if proc.returncode == SETUP_FAILED and output.startswith("grpo sandbox setup failed"):
        raise SandboxUnavailable(f"{output.strip()} (see grpo.envs.sandbox for what it needs).")
    status = _status(proc.returncode, timed_out, overflow.is_set())
    return SandboxResult(output, proc.returncode, status, time.monotonic() - start)


def _read(
    proc: subprocess.Popen[bytes],
    stream: IO[bytes],
    chunks: list[bytes],
    limit: int,
    overflow: threading.Event,
) -> None:
    """Collect up to ``limit`` bytes; past that, kill the process (and drain what is left)."""
    size = 0
    while block := stream.read1(65536):  # type: ignore[attr-defined]
        if size <= limit:
            chunks.append(block)
        size += len(block)
        if size > limit and not overflow.is_set():
            overflow.set()
            _kill(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)


def _status(returncode: int, timed_out: bool, overflow: bool) -> SandboxStatus:
    if timed_out:
        return "timeout"
    if overflow:
        return "output_limit"
    if returncode == 0:
        return "ok"
    return "killed" if returncode < 0 or returncode > 128 else "error"


def _signal_note(returncode: int, limits: SandboxLimits) -> str:
    signum = -returncode if returncode < 0 else returncode - 128
    if signum in (signal.SIGXCPU, signal.SIGKILL):
        return f"killed by signal {signum} (CPU time limit {limits.cpu_seconds} s)"
    if signum == signal.SIGXFSZ:
        return f"killed by signal {signum} (file size limit {limits.file_bytes} bytes)"
    return f"killed by signal {signum}"


def python_tool(limits: SandboxLimits | None = None, name: str = "python") -> Tool:
    """`run_python` as a `Tool` ``python(code: str)``: the output, followed by a line naming the
    exit status when it is not ``ok`` (e.g. ``[killed: CPU time limit 2 s]``)."""
    limits = limits or SandboxLimits()

    def python(code: str) -> str:
        result = run_python(code, limits)
        if result.status == "ok":
            return result.output
        notes = {
            "error": f"exit code {result.returncode}",
            "timeout": f"timed out after {limits.wall_seconds:g} s",
            "killed": _signal_note(result.returncode, limits),
            "output_limit": f"output cut at {limits.output_bytes} bytes",
        }
        return f"{result.output.rstrip()}\n[{result.status}: {notes[result.status]}]"

    return Tool(
        name,
        python,
        "runs a Python program in a sandbox and returns what it prints.",
        {"code": "the program"},
        timeout=limits.wall_seconds + 10.0,
    )
