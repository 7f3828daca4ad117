"""Run untrusted Python code (a model's) in a bubblewrap sandbox, resource-limited, fail closed.

Isolation is bubblewrap's (``bwrap``, the tool Flatpak runs applications in; Debian package
``bubblewrap``, at least version 0.8.0), found on ``PATH`` at run time. `run_python(code)` runs::

    bwrap --unshare-all --unshare-user --disable-userns --uid 65534 --gid 65534
          --die-with-parent --new-session --clearenv --cap-drop ALL --seccomp FD
          --ro-bind /usr /usr (+ /bin, /lib* as symlinks or read-only binds, + the interpreter's prefix)
          --proc /proc --dev /dev --remount-ro /dev --size DISK --tmpfs /tmp --file FD /tmp/main.py
          --remount-ro / --chdir /tmp
          PYTHON -I -S -c LAUNCHER

The launcher (trusted, the first Python code in the sandbox) sets the rlimits (CPU, address
space, file size, open files, processes, core dumps), writes one byte on a pipe that only it
holds, closes it, and runs ``/tmp/main.py``. The supervisor (this process) decides the result:

- setup: no byte on the launcher's pipe means the sandbox never started (bwrap refused, the
  interpreter could not start): `SandboxUnavailable`, whatever the code printed or returned;
- ``timeout``: its own clock passed ``wall_seconds`` (it kills bwrap; ``--die-with-parent`` and the
  PID namespace take every process in the sandbox with it);
- ``output_limit``: its own reader counted more than ``output_bytes``;
- ``cpu_limit``: the kernel's account of the sandbox's CPU time (``wait4``) reached ``cpu_seconds``;
- ``ok`` (exit status 0), ``error`` (another exit status), ``killed`` (a signal).

What each limit and isolation promise rests on, and the test that attacks it, is the table in
docs/sandbox.md. Where bwrap is missing, too old, or cannot create its namespaces (unprivileged
user namespaces disabled, a container's seccomp profile), `SandboxUnavailable` says what to
install or enable, and nothing runs: the code is never run unconfined.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from grpo.envs.seccomp import seccomp_program

if TYPE_CHECKING:
    from grpo.envs.tools import Tool

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "bwrap_version",
    "python_tool",
    "run_python",
]

MIN_BWRAP = (0, 8, 0)  # --disable-userns, --size
INSTALL_HINT = (
    "install bubblewrap >= 0.8.0 (Debian 12+/Ubuntu 24.04+: `apt-get install bubblewrap`; "
    "Fedora: `dnf install bubblewrap`; or build it from https://github.com/containers/bubblewrap)"
)
NOBODY = 65534  # as root, bwrap runs as nobody: the sandbox's user is never root outside it
_KILL_GRACE = 5.0  # seconds to drain the pipes after a kill

# The launcher: trusted code, the first to run in the sandbox. argv: limits, then the setup fd.
_LAUNCHER = r"""
import os, resource, sys
cpu, mem, fsize, nofile, nproc, ok = map(int, sys.argv[1:7])
for lim, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu), (resource.RLIMIT_AS, mem, mem),
                        (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                        (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(lim, (soft, hard))  # CPU: SIGKILL at the limit (pid 1 ignores SIGXCPU)
os.write(ok, b"1")
os.close(ok)
sys.argv = ["main.py"]
sys.path.insert(0, "/tmp")
with open("/tmp/main.py", "rb") as f:
    source = f.read()
exec(compile(source, "/tmp/main.py", "exec"), {"__name__": "__main__", "__file__": "/tmp/main.py",
                                              "__builtins__": __builtins__})
"""  # runpy.run_path would do the same at twice the start-up (its imports: ~40 ms here)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here (no bubblewrap, too old, namespaces not permitted).
    Nothing was run."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one `run_python` call.

    Args:
        cpu_seconds: CPU time of the program (RLIMIT_CPU); killed past it (status ``cpu_limit``).
        wall_seconds: real time; the whole sandbox is killed past it (status ``timeout``).
        memory_bytes: address space of each process (RLIMIT_AS); allocations past it fail.
        output_bytes: stdout + stderr kept; past it the sandbox is killed (``output_limit``).
        file_bytes: largest file the code may write (RLIMIT_FSIZE).
        disk_bytes: all files together: the size of the sandbox's ``/tmp`` (a tmpfs, in memory).
        open_files: file descriptors per process (RLIMIT_NOFILE).
        processes: processes or threads the program may start besides itself (RLIMIT_NPROC,
            counted in the sandbox's own user namespace). Memory in all is at most
            ``(processes + 1) * memory_bytes + disk_bytes``.
    """

    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_bytes: int = 512 * 2**20
    output_bytes: int = 10_000
    file_bytes: int = 2**20
    disk_bytes: int = 16 * 2**20
    open_files: int = 64
    processes: int = 0

    def __post_init__(self) -> None:
        for name in (
            "cpu_seconds",
            "wall_seconds",
            "memory_bytes",
            "output_bytes",
            "file_bytes",
            "disk_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits({name}={getattr(self, name)!r}): must be positive.")
        if self.open_files < 8 or self.processes < 0:
            raise ValueError(
                f"SandboxLimits(open_files={self.open_files}, processes={self.processes}): "
                "open_files must be at least 8 (the interpreter's own) and processes at least 0."
            )


SandboxStatus = Literal["ok", "error", "killed", "timeout", "cpu_limit", "output_limit"]


class SandboxResult(NamedTuple):
    """One run: ``output`` (stdout and stderr as they arrived, cut at the limit), ``returncode``
    (the program's exit status; 128 + the signal that ended it), ``status`` (decided by the
    supervisor, see the module docstring), wall ``seconds``, ``stdout`` alone (cut at the limit),
    and ``cpu_seconds`` (the kernel's account of the sandbox's CPU time)."""

    output: str
    returncode: int
    status: SandboxStatus
    seconds: float
    stdout: str = ""
    cpu_seconds: float = 0.0


def bwrap_version(bwrap: str) -> tuple[int, ...]:
    """The version ``bwrap --version`` prints (``bubblewrap 0.8.0`` -> ``(0, 8, 0)``)."""
    out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    if match is None:
        raise SandboxUnavailable(f"`{bwrap} --version` printed {out!r}, not a version; {INSTALL_HINT}.")
    return tuple(int(part or 0) for part in match.groups())


@functools.lru_cache(maxsize=8)
def _setup(path_env: str) -> tuple[str, bytes, tuple[str, ...]]:
    """bwrap's path (checked), the seccomp program, the fixed bind arguments. Cached per PATH."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"grpo.envs.sandbox needs Linux (bubblewrap); this is {sys.platform}.")
    bwrap = shutil.which("bwrap", path=path_env)
    if bwrap is None:
        raise SandboxUnavailable(f"no `bwrap` on PATH: {INSTALL_HINT}.")
    version = bwrap_version(bwrap)
    if version < MIN_BWRAP:
        found = ".".join(map(str, version))
        raise SandboxUnavailable(f"{bwrap} is bubblewrap {found}, older than 0.8.0: {INSTALL_HINT}.")
    try:
        program = seccomp_program()
    except ValueError as e:
        raise SandboxUnavailable(f"grpo.envs.sandbox: {e}") from e
    return bwrap, program, _binds()


@functools.lru_cache(maxsize=1)
def _interpreter() -> tuple[str, str]:
    """The interpreter the sandbox runs and its prefix: this process's base interpreter (not a
    virtual environment's link to it) where everyone may run it, else the system's ``python3``
    (as root, bwrap runs as nobody, who cannot enter e.g. ``/root/.pyenv``). The program gets the
    standard library only: ``-I -S``, no site-packages."""
    executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if _world_executable(executable):
        return executable, os.path.realpath(sys.base_prefix)
    for system in ("/usr/bin/python3", "/bin/python3"):
        if os.path.exists(system) and _world_executable(os.path.realpath(system)):
            return os.path.realpath(system), "/usr"
    raise SandboxUnavailable(
        f"no Python interpreter that the sandbox's user may run: {executable} is not executable by "
        "others, and there is no /usr/bin/python3 (install python3, or a Python outside a private home)."
    )


def _world_executable(path: str) -> bool:
    """Whether a user other than the owner may run ``path`` (others' x on it and every ancestor)."""
    parts = path.split("/")
    return all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o001 for i in range(1, len(parts) + 1))


def _binds() -> tuple[str, ...]:
    """Read-only views of the system's programs and libraries; nothing else of the host (no /etc,
    /home, /run, /tmp, /var: no Unix socket at a path is reachable). The interpreter's prefix is
    bound read-only where it lies outside /usr."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = _interpreter()[1]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    return tuple(args)


def run_python(code: str, limits: SandboxLimits | None = None, *, stdin: str = "") -> SandboxResult:
    """Run ``code`` as ``/tmp/main.py`` in the sandbox described in the module docstring.

    ``stdin`` is the program's standard input. Raises `SandboxUnavailable` where the sandbox
    cannot be set up; then nothing of ``code`` ran.
    """
    limits = limits or SandboxLimits()
    bwrap, program, binds = _setup(os.environ.get("PATH", os.defpath))
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(2)]
        for f, data in zip(files, (code, stdin), strict=True):
            f.write(data.encode())
            f.seek(0)
        seccomp_r, seccomp_w = os.pipe()
        os.write(seccomp_w, program)  # a few hundred bytes: fits the pipe's buffer
        os.close(seccomp_w)
        ok_r, ok_w = os.pipe()
        fds = (files[0].fileno(), seccomp_r, ok_w)
        command = _as_nobody(_command(bwrap, binds, limits, *fds))
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                command,
                stdin=files[1],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                pass_fds=fds,
                start_new_session=True,
            )
        except OSError as e:
            os.close(ok_r)
            raise SandboxUnavailable(f"cannot start {bwrap}: {e}; {INSTALL_HINT}.") from e
        finally:
            os.close(seccomp_r)
            os.close(ok_w)
        return _supervise(proc, ok_r, limits, start)


def _as_nobody(command: list[str]) -> list[str]:
    """As root, bwrap runs as nobody (util-linux's ``setpriv``; not Popen's ``user=``, which makes a
    large trainer process fork instead of vfork: ~40 ms a run here): the sandbox's user, mapped to
    the caller's, must not be root outside, where /proc/sys and the like trust uid 0."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
    if setpriv is None:
        raise SandboxUnavailable(
            "running as root, the sandbox needs util-linux's setpriv to start bwrap as nobody."
        )
    return [setpriv, "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "--", *command]


def _command(
    bwrap: str, binds: tuple[str, ...], limits: SandboxLimits, code: int, seccomp: int, ok: int
) -> list[str]:
    executable = _interpreter()[0]
    numbers = (limits.cpu_seconds, limits.memory_bytes, limits.file_bytes, limits.open_files)
    nproc = limits.processes + 1  # counted in the sandbox's own user namespace, where it is pid 1
    namespaces = ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
    process = [
        "--as-pid-1",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--seccomp",
        str(seccomp),
    ]
    hidden = [arg for name in ("keys", "key-users") for arg in ("--ro-bind", "/dev/null", f"/proc/{name}")]
    files = ["--proc", "/proc", *hidden, "--dev", "/dev", "--remount-ro", "/dev"]
    files += ["--size", str(limits.disk_bytes), "--tmpfs", "/tmp", "--file", str(code), "/tmp/main.py"]
    files += ["--remount-ro", "/", "--chdir", "/tmp", "--hostname", "sandbox"]
    env = {"HOME": "/tmp", "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"}
    env |= {f"{lib}_NUM_THREADS": "1" for lib in ("OMP", "OPENBLAS", "MKL")}  # no thread may start
    setenv = ["--clearenv", *(arg for name, value in env.items() for arg in ("--setenv", name, value))]
    launcher = [executable, "-I", "-S", "-c", _LAUNCHER, *map(str, numbers), str(nproc), str(ok)]
    return [bwrap, *namespaces, *process, *binds, *files, *setenv, *launcher]


def _supervise(
    proc: subprocess.Popen[bytes], ok_r: int, limits: SandboxLimits, start: float
) -> SandboxResult:
    """Read the pipes until the sandbox is gone, enforcing the wall-time and output limits."""
    reader = _Reader(proc, ok_r, limits.output_bytes)
    deadline = start + limits.wall_seconds
    killed_by: SandboxStatus | None = None
    try:
        while reader.open():
            left = deadline - time.monotonic()
            if left <= 0 and not killed_by:
                killed_by, deadline = "timeout", time.monotonic() + _KILL_GRACE
                _kill(proc)
                continue
            if left <= 0:
                break  # killed, yet something still holds the pipes: stop reading
            reader.read(left)
            if reader.overflow and not killed_by:
                killed_by, deadline = "output_limit", time.monotonic() + _KILL_GRACE
                _kill(proc)
    finally:
        reader.close()
        _kill(proc)  # nothing of the sandbox outlives the call (a no-op when it has exited)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = returncode = _exit_code(status)
    if not reader.started:
        raise SandboxUnavailable(
            f"the sandbox did not start (bwrap exit status {returncode}): "
            f"{reader.text(reader.stderr).strip()[:2000]!r}. Unprivileged user namespaces may be "
            "disabled (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0, "
            "Ubuntu's kernel.apparmor_restrict_unprivileged_userns=0) or forbidden by a container's "
            f"seccomp profile; {INSTALL_HINT}."
        )
    cpu = usage.ru_utime + usage.ru_stime
    verdict = killed_by or _status(returncode, cpu, limits)
    return SandboxResult(
        reader.text(reader.both),
        returncode,
        verdict,
        time.monotonic() - start,
        reader.text(reader.stdout),
        cpu,
    )


def _exit_code(status: int) -> int:
    """bwrap passes its program's exit status on (128 + the signal when one ended it)."""
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _status(returncode: int, cpu: float, limits: SandboxLimits) -> SandboxStatus:
    if returncode == 0:
        return "ok"
    if returncode == 128 + signal.SIGKILL and cpu >= 0.9 * limits.cpu_seconds:
        return "cpu_limit"  # the kernel kills at the limit; its tick-sampled account reads a little less
    return "killed" if returncode > 128 else "error"


class _Reader:
    """stdout, stderr, the launcher's setup pipe and bwrap's exit (a pidfd), read without threads."""

    def __init__(self, proc: subprocess.Popen[bytes], ok_r: int, limit: int) -> None:
        if proc.stdout is None or proc.stderr is None:  # cannot happen with PIPE; narrows the type
            raise RuntimeError("grpo.envs.sandbox: the child's pipes are missing.")
        self.selector = selectors.DefaultSelector()
        self.exit_fd = os.pidfd_open(proc.pid)
        self.names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", ok_r: "ok"}
        for fd in self.names:
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ)
        self.selector.register(self.exit_fd, selectors.EVENT_READ)
        self.limit, self.size, self.started, self.exited = limit, 0, False, False
        self.both, self.stdout, self.stderr = bytearray(), bytearray(), bytearray()

    def open(self) -> bool:
        """Until bwrap has exited and its output pipes are closed."""
        return not self.exited or any(name != "ok" for name in self.names.values())

    @property
    def overflow(self) -> bool:
        return self.size > self.limit

    def read(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            fd = key.fd
            if fd == self.exit_fd:
                self.exited = True
                self.selector.unregister(fd)
                continue
            with contextlib.suppress(BlockingIOError):
                block = os.read(fd, 65536)
                if block:
                    self._keep(self.names[fd], block)
                else:
                    self.selector.unregister(fd)
                    if self.names.pop(fd) == "ok":
                        os.close(fd)

    def _keep(self, name: str, block: bytes) -> None:
        if name == "ok":
            self.started = True
            return
        room = max(0, self.limit - len(self.both))
        self.size += len(block)
        self.both += block[:room]
        (self.stdout if name == "stdout" else self.stderr).extend(block[:room])

    def close(self) -> None:
        for fd, name in self.names.items():
            if name == "ok":
                os.close(fd)
        os.close(self.exit_fd)
        self.selector.close()

    def text(self, data: bytearray) -> str:
        return bytes(data[: self.limit]).decode("utf-8", errors="replace")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL bwrap's process group; its ``--die-with-parent`` child and PID namespace follow."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _signal_note(result: SandboxResult, limits: SandboxLimits) -> str:
    notes = {
        "error": f"exit code {result.returncode}",
        "timeout": f"timed out after {limits.wall_seconds:g} s",
        "cpu_limit": f"CPU time limit {limits.cpu_seconds} s",
        "killed": f"killed by signal {result.returncode - 128}",
        "output_limit": f"output cut at {limits.output_bytes} bytes",
    }
    if result.status == "killed" and result.returncode - 128 == signal.SIGXFSZ:
        return f"{notes['killed']} (file size limit {limits.file_bytes} bytes)"
    return notes[result.status]


def python_tool(limits: SandboxLimits | None = None, name: str = "python") -> Tool:
    """`run_python` as a `Tool` ``python(code: str)``: the output, followed by a line naming the
    exit status when it is not ``ok`` (e.g. ``[cpu_limit: CPU time limit 2 s]``)."""
    from grpo.envs.tools import Tool

    limits = limits or SandboxLimits()

    def python(code: str) -> str:
        result = run_python(code, limits)
        if result.status == "ok":
            return result.output
        return f"{result.output.rstrip()}\n[{result.status}: {_signal_note(result, limits)}]"

    return Tool(
        name,
        python,
        "runs a Python program in a sandbox and returns what it prints.",
        {"code": "the program"},
        timeout=limits.wall_seconds + 10.0,
    )
