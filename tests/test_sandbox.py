"""grpo.envs.sandbox: the bubblewrap sandbox, attacked (tests/sandbox_attacks.py) as the user
running pytest and as an unprivileged user, each verdict checked outside the sandbox; its
fail-closed paths (bwrap missing, too old, namespaces off, no privilege to create them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from grpo.envs.sandbox import SandboxLimits, SandboxUnavailable, python_tool, run_python
from grpo.envs.tools import ToolBox
from tests.sandbox_attacks import ATTACKS

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, **limits: Any) -> Any:
    return run_python(code, SandboxLimits(**{"cpu_seconds": 2, "wall_seconds": 10, **limits}))


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_contained(name: str) -> None:
    ATTACKS[name](_run)


@pytest.fixture(scope="module")
def standalone() -> Iterator[Path]:
    """The sandbox and the attacks copied where any user may read them (the checkout may not be)."""
    with tempfile.TemporaryDirectory() as tmp:
        top = Path(tmp)
        for rel in ("grpo/envs/sandbox.py", "grpo/envs/seccomp.py", "tests/sandbox_attacks.py"):
            (top / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, top / rel)
        for path in [top, *top.rglob("*")]:
            path.chmod(0o755)
        yield top / "tests" / "sandbox_attacks.py"


def _python_for_others() -> str:
    for candidate in (os.path.realpath(sys._base_executable), "/usr/bin/python3"):  # type: ignore[attr-defined]
        parts = candidate.split("/")
        if os.path.exists(candidate) and all(
            os.stat("/".join(parts[:i]) or "/").st_mode & 0o001 for i in range(1, len(parts) + 1)
        ):
            return candidate
    pytest.skip("no Python interpreter that an unprivileged user may run")


def _as_nobody(*command: str) -> list[str]:
    if os.geteuid() != 0:
        pytest.skip(
            f"pytest runs unprivileged (uid {os.geteuid()}): the in-process attacks are the unprivileged run"
        )
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv (util-linux) to switch to an unprivileged user")
    return ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--", *command]


@pytest.mark.usefixtures("sandbox")
def test_attacks_as_an_unprivileged_user(standalone: Path) -> None:
    out = subprocess.run(
        _as_nobody(_python_for_others(), str(standalone)),
        capture_output=True, text=True, timeout=300, check=True, cwd="/", env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert report["uid"] == 65534
    assert report["results"] == dict.fromkeys(ATTACKS), report["results"]


def _probe(standalone: Path, *wrapper: str) -> dict[str, str]:
    out = subprocess.run(
        [*wrapper, _python_for_others(), str(standalone), "probe"],
        capture_output=True, text=True, timeout=60, check=False, cwd="/", env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result: dict[str, str] = json.loads(out.stdout)
    return result


def test_fail_closed_without_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        SandboxUnavailable,
        match=r"no `bwrap` on PATH: install bubblewrap >= 0.8.0 .*apt-get install bubblewrap",
    ):
        run_python("print(1)")


def test_fail_closed_on_an_old_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bubblewrap 0.4.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"is bubblewrap 0\.4\.1, older than 0\.8\.0: install"):
        run_python("print(1)")


@pytest.mark.usefixtures("sandbox")
def test_fail_closed_with_user_namespaces_off(standalone: Path) -> None:
    """Inside an outer bwrap with --disable-userns, as an unprivileged uid: no namespace can be made."""
    outer = [
        "bwrap", "--unshare-user", "--disable-userns", "--uid", "1000", "--gid", "1000",
        "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--ro-bind", str(standalone.parent.parent), str(standalone.parent.parent), "--",
    ]  # fmt: skip
    result = _probe(standalone, *outer)
    assert result["raised"] == "SandboxUnavailable", result
    assert "the sandbox did not start" in result["message"]
    assert "user namespaces" in result["message"]


@pytest.mark.usefixtures("sandbox")
def test_fail_closed_as_root_without_capabilities(standalone: Path) -> None:
    """Root without CAP_SETUID/CAP_SYS_ADMIN (a rootless container's root): SandboxUnavailable."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop root's capabilities")
    caps = ["setpriv", "--bounding-set", "-all", "--inh-caps", "-all", "--ambient-caps", "-all", "--"]
    result = _probe(standalone, *caps)
    assert result["raised"] == "SandboxUnavailable", result
    assert "install bubblewrap" in result["message"]


@pytest.mark.usefixtures("sandbox")
def test_status_is_the_supervisors() -> None:
    r = _run("import os\nprint('grpo sandbox setup failed', flush=True)\nos._exit(125)")
    assert (r.status, r.returncode, r.output) == ("error", 125, "grpo sandbox setup failed\n")
    r = run_python("import sys\nprint(input()[::-1])\nprint('warn', file=sys.stderr)", stdin="abc\n")
    assert (r.status, r.stdout, sorted(r.output.splitlines())) == ("ok", "cba\n", ["cba", "warn"])


@pytest.mark.usefixtures("sandbox")
def test_runs_in_its_own_tmp() -> None:
    r = _run(
        "import os\nopen('out.txt', 'w').write('hi')\n"
        "print(os.getcwd(), open('out.txt').read(), sorted(os.listdir()))"
    )
    assert (r.status, r.returncode) == ("ok", 0)
    assert r.output == "/tmp hi ['main.py', 'out.txt']\n"


@pytest.mark.usefixtures("sandbox")
def test_python_tool_through_a_toolbox() -> None:
    box = ToolBox([python_tool(SandboxLimits(cpu_seconds=1, wall_seconds=5))])
    code = "print(sum(range(10)))\\nraise SystemExit(3)"
    (message,) = box.respond(
        f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>'
    )
    assert message["content"] == "45\n[error: exit code 3]"


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match=r"SandboxLimits\(disk_bytes=0\): must be positive"):
        SandboxLimits(disk_bytes=0)
    with pytest.raises(ValueError, match="open_files must be at least 8"):
        SandboxLimits(open_files=2)
