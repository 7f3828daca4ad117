"""Attacks on grpo.envs.sandbox, each judged from outside the sandbox (standard library only).

Each attack is a function ``attack(run)`` that sets up something on the host (a listening socket,
a key in the caller's keyring, a process, a world-writable directory, a secret), runs an attacking
program through ``run(code, **limits) -> SandboxResult``, then checks the host: the socket
accepted nothing, the keyring is unchanged, the process lives, no file appeared. It raises
AssertionError naming what got through.

tests/test_sandbox.py runs them in-process (as the user running pytest, root in CI) and, through
``python tests/sandbox_attacks.py``, as an unprivileged user: run as a script, this file imports
grpo.envs.sandbox from the checkout without importing the grpo package (which needs torch) and
prints one JSON object ``{attack name: null or the failure}``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Run = Callable[..., Any]
ATTACKS: dict[str, Callable[[Run], None]] = {}
_libc = ctypes.CDLL(None, use_errno=True)
KEY_SPEC_SESSION, KEY_SPEC_USER = -3, -4


def attack(fn: Callable[[Run], None]) -> Callable[[Run], None]:
    ATTACKS[fn.__name__] = fn
    return fn


def _nothing_accepted(server: socket.socket) -> bool:
    server.setblocking(False)
    return not select.select([server], [], [], 0.2)[0]


@contextlib.contextmanager
def _listening(family: int, address: Any, kind: int = socket.SOCK_STREAM) -> Iterator[socket.socket]:
    server = socket.socket(family, kind)
    try:
        server.bind(address)
        if kind == socket.SOCK_STREAM:
            server.listen(8)
        yield server
    finally:
        server.close()


_CONNECT = """
import socket
try:
    s = socket.socket(socket.{family}, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect({address!r})
    s.sendall(b"escaped")
    print("CONNECTED")
except OSError as e:
    print("refused", e)
"""


@attack
def tcp_to_host_loopback(run: Run) -> None:
    with _listening(socket.AF_INET, ("127.0.0.1", 0)) as server:
        r = run(_CONNECT.format(family="AF_INET", address=server.getsockname()))
        assert _nothing_accepted(server), "a TCP connection reached the host's loopback"
        assert "CONNECTED" not in r.output, r.output


@attack
def udp_to_host_and_internet(run: Run) -> None:
    with _listening(socket.AF_INET, ("127.0.0.1", 0), socket.SOCK_DGRAM) as server:
        port = server.getsockname()[1]
        code = (
            "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"for a in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n        s.sendto(b'escaped', a)\n    except OSError as e:\n        print(e)\n"
        )
        run(code)
        assert _nothing_accepted(server), "a UDP datagram reached the host"


@attack
def tcp_to_the_internet(run: Run) -> None:
    r = run(_CONNECT.format(family="AF_INET", address=("1.1.1.1", 80)))
    assert "CONNECTED" not in r.output, r.output
    assert "Network is unreachable" in r.output, r.output


@attack
def unix_socket_world_writable_in_tmp(run: Run) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        os.chmod(tmp, 0o777)
        path = os.path.join(tmp, "X0")
        with _listening(socket.AF_UNIX, path) as server:
            os.chmod(path, 0o777)  # like X11's, PostgreSQL's, MySQL's sockets
            r = run(_CONNECT.format(family="AF_UNIX", address=path))
            assert _nothing_accepted(server), f"the code connected to {path}"
            assert "CONNECTED" not in r.output, r.output


@attack
def unix_socket_of_the_caller(run: Run) -> None:
    home = Path.home() if os.access(Path.home(), os.W_OK) else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=home) as tmp:  # 0700, like ssh-agent's and tmux's
        path = os.path.join(tmp, "agent.sock")
        with _listening(socket.AF_UNIX, path) as server:
            os.chmod(path, 0o600)
            r = run(_CONNECT.format(family="AF_UNIX", address=path))
            assert _nothing_accepted(server), f"the code connected to the caller's own {path}"
            assert "CONNECTED" not in r.output, r.output


@attack
def abstract_unix_socket(run: Run) -> None:
    name = f"\0grpo-attack-{secrets.token_hex(4)}"
    with _listening(socket.AF_UNIX, name) as server:
        r = run(_CONNECT.format(family="AF_UNIX", address=name))
        assert _nothing_accepted(server), "the code reached an abstract socket of the host"
        assert "CONNECTED" not in r.output, r.output


def _keys(keyring: int) -> bytes:
    buf = ctypes.create_string_buffer(4096)
    n = _libc.syscall(250, 13, keyring, buf, 4096)  # KEYCTL_READ of a keyring: its key ids
    return buf.raw[: max(n, 0)]


def _add_key(description: bytes, payload: bytes, keyring: int) -> int:
    return int(_libc.syscall(248, b"user", description, payload, len(payload), ctypes.c_int(keyring)))


_KEYRING_ATTACK = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(open("/proc/self/status").read().count("Seccomp"), flush=True)
for ring in (-3, -4, -5):  # session, user, user-session keyrings
    n = libc.syscall(248, b"user", b"planted", b"{nonce}", {size}, ctypes.c_int(ring))
    print("add_key", ring, n, ctypes.get_errno())
buf = ctypes.create_string_buffer(4096)
found = libc.syscall(250, 10, -3, b"user", b"{description}", 0)  # KEYCTL_SEARCH
print("search", found, ctypes.get_errno())
if found > 0:
    libc.syscall(250, 2, found, b"overwritten", 11)  # KEYCTL_UPDATE
    libc.syscall(250, 11, found, buf, 4096)
    print("READ", buf.value)
for name in ("/proc/keys", "/proc/key-users"):
    try:
        print(open(name).read())
    except OSError as e:
        print(name, e)
"""


@attack
def keyring_of_the_caller(run: Run) -> None:
    description, nonce = f"grpo-secret-{secrets.token_hex(4)}", secrets.token_hex(8)
    key = _add_key(description.encode(), nonce.encode(), KEY_SPEC_SESSION)
    if key < 0:
        return  # no keyring for this caller (keyctl refused): nothing to leak
    before = (_keys(KEY_SPEC_SESSION), _keys(KEY_SPEC_USER))
    code = _KEYRING_ATTACK.format(nonce=secrets.token_hex(8), size=16, description=description)
    r = run(code)
    buf = ctypes.create_string_buffer(64)
    _libc.syscall(250, 11, key, buf, 64)  # KEYCTL_READ
    assert buf.value == nonce.encode(), "the code overwrote a key of the caller's session keyring"
    assert (_keys(KEY_SPEC_SESSION), _keys(KEY_SPEC_USER)) == before, (
        "the code added a key to the caller's keyrings"
    )
    assert nonce not in r.output, r.output
    assert description not in r.output, r.output
    _libc.syscall(250, 3, key)  # KEYCTL_REVOKE


@attack
def keyring_between_runs(run: Run) -> None:
    nonce = secrets.token_hex(8)
    run(_KEYRING_ATTACK.format(nonce=nonce, size=16, description="planted"))
    r = run(_KEYRING_ATTACK.format(nonce="x" * 16, size=16, description="planted"))
    assert nonce not in r.output, "a key planted by one run was read by the next"


@attack
def files_between_runs(run: Run) -> None:
    nonce = secrets.token_hex(8)
    run(
        "import os\nfor d in ('/tmp', '/dev/shm', '/', '.'):\n"
        f"  try: open(os.path.join(d, '{nonce}'), 'w').write('x')\n  except OSError: pass"
    )
    r = run("import os\nprint([os.listdir(d) for d in ('/tmp', '/dev/shm', '/', '.')])")
    assert nonce not in r.output, "a file written by one run was seen by the next"


_IPC_ATTACK = """
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
got = 0
for _ in range(8):  # 8 x 32 MiB segments, each touched then detached: held by no address space
    shm = libc.shmget(0, 32 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if shm < 0:
        print("shmget", os.strerror(ctypes.get_errno()))
        break
    addr = libc.shmat(shm, None, 0)
    ctypes.memset(addr, 1, 32 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
    got += 32
print("shm MiB", got)
calls = (("memfd", lambda: os.memfd_create("x")), ("msgget", lambda: libc.msgget(0, 0o1600)),
         ("semget", lambda: libc.semget(0, 1, 0o1600)),
         ("mq_open", lambda: libc.syscall(240, b"/q", 0o100 | 2, 0o600, None)))
for name, call in calls:
    try:
        n = call()
        print(name, n, os.strerror(ctypes.get_errno()) if n == -1 else "CREATED")
    except OSError as e:
        print(name, e)
"""


@attack
def sysv_and_posix_ipc_memory(run: Run) -> None:
    r = run(_IPC_ATTACK, memory_bytes=64 * 2**20)
    assert "shm MiB 0" in r.output, r.output
    assert "CREATED" not in r.output, r.output
    assert r.output.count("Operation not permitted") == 5, r.output


_FALLOCATE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open("/tmp/big", os.O_CREAT | os.O_WRONLY)
n = libc.fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(256 << 20))  # FALLOC_FL_KEEP_SIZE
print("fallocate", n, os.strerror(ctypes.get_errno()))
os.close(fd)
os.unlink("/tmp/big")
written = 0
try:
    for i in range(1000):
        with open(f"/tmp/f{i}", "wb") as f:
            f.write(b"x" * (1 << 20))
        written += 1
except OSError as e:
    print(e)
print("MiB", written)
"""


@attack
def disk_fallocate_and_many_files(run: Run) -> None:
    r = run(_FALLOCATE, file_bytes=2**20, disk_bytes=16 * 2**20)  # 256 MiB past file_bytes
    assert "fallocate -1 File too large" in r.output, r.output
    r = run(_FALLOCATE, file_bytes=2**30, disk_bytes=16 * 2**20)  # 256 MiB past disk_bytes
    assert "fallocate -1 No space left on device" in r.output, r.output
    assert "No space left on device" in r.output.splitlines()[-2], r.output
    assert int(r.output.split("MiB")[-1]) < 16, r.output


@attack
def write_host_files(run: Run) -> None:
    core_pattern = Path("/proc/sys/kernel/core_pattern")
    core = core_pattern.read_text()  # a global setting that only root may write (as the sandbox
    with tempfile.TemporaryDirectory() as tmp:  # of a root caller could, mapped to uid 0)
        os.chmod(tmp, 0o777)  # only the sandbox, not file permissions, may stop these writes
        target = os.path.join(tmp, "escaped")
        writes = [
            (target, "x"),
            ("/etc/escaped", "x"),
            ("/usr/escaped", "x"),
            ("/dev/shm/escaped", "x"),
            (str(core_pattern), core.strip() + ".grpo-attack"),
            ("/proc/sys/kernel/hostname", "escaped"),
        ]
        try:
            r = run(
                f"for p, text in {writes!r}:\n    try:\n        open(p, 'w').write(text)\n"
                "        print('WROTE', p)\n    except OSError as e:\n        print(e)"
            )
        finally:
            if core_pattern.read_text() != core and os.geteuid() == 0:
                core_pattern.write_text(core)  # undo what got through before failing below
                raise AssertionError(f"the code wrote the host's {core_pattern}")
        assert not os.path.exists(target), "a host file was written"
        assert not os.path.exists("/etc/escaped"), "a host file was written"
        assert socket.gethostname() != "escaped", "the code renamed the host"
        assert "WROTE" not in r.output.replace("WROTE /proc/sys/kernel/hostname", ""), r.output


@attack
def read_host_secrets(run: Run) -> None:
    nonce = secrets.token_hex(8)
    home = Path.home() if os.access(Path.home(), os.W_OK) else Path(tempfile.gettempdir())
    with tempfile.NamedTemporaryFile("w", dir=home, suffix=".secret") as f:
        f.write(nonce)
        f.flush()
        os.environ["GRPO_ATTACK_SECRET"] = nonce
        try:
            r = run(
                "import os\nprint(dict(os.environ))\n"
                f"for p in ({f.name!r}, '/etc/shadow', '/etc/passwd', '/proc/1/environ'):\n"
                "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(e)"
            )
        finally:
            del os.environ["GRPO_ATTACK_SECRET"]
    assert nonce not in r.output, "a host secret (file or environment) was read"
    assert "root:" not in r.output, r.output


@attack
def signal_host_processes(run: Run) -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        code = (
            "import os, signal, ctypes\n"
            f"for pid in ({victim.pid}, {os.getpid()}, -1, 0, os.getppid()):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL) if pid != 0 else None\n"
            "    except OSError as e:\n        print(pid, e)\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"print('ptrace', libc.ptrace(16, {victim.pid}, 0, 0), ctypes.get_errno())\n"
            "print(sorted(os.listdir('/proc'))[:3])\nos.kill(0, signal.SIGKILL)"
        )
        run(code, processes=1)
        time.sleep(0.1)
        assert victim.poll() is None, "the code killed a host process"
    finally:
        victim.kill()
        victim.wait()


@attack
def nothing_outlives_the_run(run: Run) -> None:
    marker = f"1000.{secrets.randbelow(10**9):09d}"
    code = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\nprint('parent done')"
    )
    run(code, processes=2)
    time.sleep(0.2)
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(pid)
    assert not alive, f"a process of the sandbox outlived the run: {alive}"


@attack
def fork_bomb_threads_and_nested_namespaces(run: Run) -> None:
    r = run(
        "import os\nn = 0\ntry:\n    while True:\n        os.fork() or os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print(n, e)"
    )
    assert "Resource temporarily unavailable" in r.output, r.output
    r = run("import threading\nthreading.Thread(target=print).start()")
    assert "can't start new thread" in r.output, r.output
    r = run(
        "import ctypes\nprint(ctypes.CDLL(None, use_errno=True).unshare(0x10000000), ctypes.get_errno())"
    )  # CLONE_NEWUSER
    assert r.output.split()[0] == "-1", r.output


@attack
def memory_and_open_files(run: Run) -> None:
    r = run("x = bytearray(1 << 30)", memory_bytes=64 * 2**20)
    assert r.status == "error", r.output
    assert r.output.rstrip().endswith("MemoryError"), r.output
    r = run(
        "import os\nfds = []\ntry:\n    while True: fds.append(os.open('/dev/null', 0))\n"
        "except OSError as e:\n    print(len(fds), e)",
        open_files=32,
    )
    assert "Too many open files" in r.output, r.output
    assert int(r.output.split()[0]) < 32, r.output


@attack
def status_forgery(run: Run) -> None:
    r = run(
        "import os, sys\nprint('grpo sandbox setup failed: fake', flush=True)\n"
        "print('bwrap: fake', file=sys.stderr, flush=True)\nos._exit(125)"
    )
    assert (r.status, r.returncode) == ("error", 125), r
    r = run("import os, time\nos.close(1); os.close(2)\ntime.sleep(30)", wall_seconds=1)
    assert r.status == "timeout", r
    r = run("import os\nos._exit(137)")  # looks like SIGKILL; still not a limit the supervisor saw
    assert r.status == "killed", r
    assert r.cpu_seconds < 1, r


@attack
def cpu_wall_and_output_limits(run: Run) -> None:
    r = run("while True: pass", cpu_seconds=1, wall_seconds=60)
    assert r.status == "cpu_limit", r
    assert r.cpu_seconds >= 0.9, r
    r = run("import time\ntime.sleep(60)", wall_seconds=0.5)
    assert r.status == "timeout", r
    assert r.seconds < 10, r
    r = run("import sys\nwhile True: sys.stderr.write('x' * 4096)", output_bytes=1000)
    assert r.status == "output_limit", r
    assert r.output == "x" * 1000, r


@attack
def seccomp_bypass_x32(run: Run) -> None:
    if os.uname().machine != "x86_64":
        return
    r = run(
        "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
        "print(l.syscall(0x40000000 | 250, 0, -3, 0), ctypes.get_errno())"
    )
    assert r.output.split() == ["-1", str(errno.EPERM)], r.output


def run_all(run: Run) -> dict[str, str | None]:
    """Every attack; ``{name: None}`` for one that was contained, else what got through."""
    results: dict[str, str | None] = {}
    for name, fn in ATTACKS.items():
        try:
            fn(run)
            results[name] = None
        except AssertionError as e:
            results[name] = f"got through: {e}"
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}"
    return results


def _import_sandbox(root: Path) -> Any:
    """grpo.envs.sandbox from ``root`` without the grpo package's __init__ (which imports torch)."""
    import importlib
    import types

    for name, sub in (("grpo", "grpo"), ("grpo.envs", "grpo/envs")):
        module = types.ModuleType(name)
        module.__path__ = [str(root / sub)]
        sys.modules[name] = module
    return importlib.import_module("grpo.envs.sandbox")


def main(argv: list[str]) -> None:
    """``sandbox_attacks.py``: every attack, as JSON; ``sandbox_attacks.py probe``: one trivial
    run, as JSON ``{"status": ...}`` or ``{"raised": type name, "message": ...}``."""
    sandbox = _import_sandbox(Path(__file__).resolve().parent.parent)

    def _run(code: str, **limits: Any) -> Any:
        return sandbox.run_python(
            code, sandbox.SandboxLimits(**{"cpu_seconds": 2, "wall_seconds": 10, **limits})
        )

    if argv[1:] == ["probe"]:
        try:
            r = _run("print('ran')")
            print(json.dumps({"status": r.status, "output": r.output}))
        except Exception as e:
            print(json.dumps({"raised": type(e).__name__, "message": str(e)}))
        return
    print(json.dumps({"uid": os.getuid(), "results": run_all(_run)}))


if __name__ == "__main__":
    main(sys.argv)
