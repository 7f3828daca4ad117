"""The generation worker lives no longer than its trainer, and leaves nothing behind.

`grpo.generation.worker.serve` calls `exit_with_trainer` first. From then on the worker removes
``leftover`` (the trainer's saved copy of the model, ``$TMPDIR/grpo-worker-*``) and exits at once
(`abandon`) when the trainer process is gone, whatever killed it:

- Linux: the kernel sends the worker `DEATH_SIGNAL` when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``). The handler acts only when the parent *process* is gone
  (``os.getppid()`` changed): the kernel also sends it when the parent *thread* that started the
  worker exits while the trainer lives on.
- The trainer may have died before the signal was armed (the worker spends seconds importing
  torch): `exit_with_trainer` checks ``os.getppid()`` after arming it.
- Everywhere: the worker's reader thread sees the pipe's EOF and calls `abandon` when it comes
  before the policy was built (`grpo.generation.worker._read_commands`).

What the worker cannot do: clean up when it is killed itself (SIGKILL) before it built its policy
and removed the copy. Its trainer does that (`WorkerEngine`'s clean-up). When nobody can (the
trainer killed while it saves the copy, before the worker exists, or both killed at once), the copy
is removed by the next `owned_temp_dir` in the same temporary directory: each copy's directory holds
a ``.owner`` file that its trainer keeps locked (``flock``) for as long as it lives, and the kernel
drops the lock however the trainer ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType

__all__ = [
    "DEATH_SIGNAL",
    "abandon",
    "exit_with_trainer",
    "owned_temp_dir",
    "private_progress_lock",
    "remove_abandoned_dirs",
    "remove_owned_dir",
]

_OWNER = ".owner"
_leases: dict[str, int] = {}  # directory -> the descriptor that holds its .owner lock

DEATH_SIGNAL = signal.SIGUSR1  # not SIGTERM: the trainer's terminate() keeps its plain meaning
_PR_SET_PDEATHSIG = 1


def abandon(leftover: str | None) -> None:
    """The trainer is gone: remove ``leftover`` (a directory, or None) and exit the process now
    (``os._exit``: no reply, no traceback, no clean-up handlers that would wait for the trainer)."""
    if leftover is not None:
        shutil.rmtree(leftover, ignore_errors=True)
    os._exit(1)


def _set_parent_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)``; False where it is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0


def exit_with_trainer(trainer_pid: int, leftover: str | None) -> None:
    """Arm the worker to `abandon` ``leftover`` and exit when the trainer (pid ``trainer_pid``, the
    worker's parent) dies; `abandon` now when it already has. Call it in the worker's main thread."""

    def on_parent_death(signum: int, frame: FrameType | None) -> None:
        if os.getppid() != trainer_pid:  # the trainer process, not only its starting thread, died
            abandon(leftover)

    if threading.current_thread() is threading.main_thread():
        signal.signal(DEATH_SIGNAL, on_parent_death)
        _set_parent_death_signal(DEATH_SIGNAL)
    if os.getppid() != trainer_pid:  # it died before the signal was armed
        abandon(leftover)


def private_progress_lock() -> None:
    """Give tqdm (the progress bars of ``from_pretrained``) a thread lock in this process.

    By default tqdm's first bar creates a ``multiprocessing.RLock``: a named semaphore registered
    with the trainer's resource tracker, which the worker shares. A worker killed with SIGKILL
    never unregisters it, and the trainer then prints "resource_tracker: There appear to be 1
    leaked semaphore objects" at exit. The worker starts no processes, so a thread lock suffices.
    """
    with contextlib.suppress(ImportError):
        from tqdm import tqdm  # type: ignore[import-untyped]

        tqdm.set_lock(threading.RLock())


def owned_temp_dir(prefix: str) -> str:
    """A new directory ``$TMPDIR/<prefix>*`` whose ``.owner`` file this process keeps locked until
    `remove_owned_dir` (or its death); first removes the abandoned ones (`remove_abandoned_dirs`)."""
    remove_abandoned_dirs(prefix)
    directory = tempfile.mkdtemp(prefix=prefix)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, no later sweep
        return directory
    staging = os.path.join(directory, _OWNER + ".new")
    fd = os.open(staging, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(staging, os.path.join(directory, _OWNER))  # visible only once locked
    _leases[directory] = fd
    return directory


def remove_owned_dir(directory: str | None) -> None:
    """Remove ``directory`` (idempotent) and release its `owned_temp_dir` lock."""
    if directory is None:
        return
    shutil.rmtree(directory, ignore_errors=True)
    fd = _leases.pop(directory, None)
    if fd is not None:
        os.close(fd)


def remove_abandoned_dirs(prefix: str) -> list[str]:
    """Remove the ``$TMPDIR/<prefix>*`` directories whose ``.owner`` lock nobody holds (their
    trainer died); the ones removed. Directories without an ``.owner`` file are left alone."""
    try:
        import fcntl
    except ImportError:
        return []
    removed = []
    for path in Path(tempfile.gettempdir()).glob(prefix + "*"):
        try:
            fd = os.open(path / _OWNER, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its trainer lives
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
        finally:
            os.close(fd)
    return removed
