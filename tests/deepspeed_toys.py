"""What each process of the 2-process DeepSpeed tests runs (module level: spawn pickles it), and
how the tests start processes and guard DeepSpeed's op build cache.

The scenarios of `tests.distributed_toys` (same states, noise and policies), trained with a
DeepSpeed ZeRO config on every rank; the results are compared with one process without DeepSpeed.
`launch` and `run_command` kill every process a test started when it times out; `stale_lock_problem`
names a build lock that a killed build left behind (which would make each test wait until its
timeout).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo.engine.deepspeed import DeepSpeedBackend
from tests.distributed_toys import (
    LOCAL_B,
    SCENARIOS,
    STEPS,
    build,
    data,
    kill_tree,
    params,
    run_steps,
)
from tests.distributed_toys import launch as dist_launch

DS_SCENARIOS = ["bandit_deferred", "bandit_zero_var", "bandit_poison", "seq_deferred", "seq_known"]
# label -> DeepSpeed config; *-offload: optimizer state on the CPU, stepped by DeepSpeedCPUAdam
ZERO_CONFIGS: dict[str, dict[str, Any]] = {
    "zero1": {"zero_optimization": {"stage": 1}, "gradient_clipping": "auto"},
    "zero2": {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"},
    "zero2-offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero3": {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": "auto",
    },
    # ZeRO-3 with the weights and the optimizer state offloaded to the CPU (ZeRO-Infinity's layout)
    "zero3-offload": {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        }
    },
}


def one_cpu_info_per_process() -> None:
    """Keep py-cpuinfo's answer for the rest of this process (its own function, called once).

    Each `DeepSpeedCPUAdam` asks `cpuinfo.get_cpu_info()` for the CPU's vendor, and py-cpuinfo
    answers from a Python subprocess it starts: 1.5-3 s per optimizer, 10 optimizers per rank in
    `ds_worker` (measured with cProfile, 2026-11-28). The CPU does not change within a process."""
    import functools

    import cpuinfo  # type: ignore[import-untyped]

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def ds_worker(rank: int, world: int, out: Path) -> None:
    """Every scenario of DS_SCENARIOS under each of ZERO_CONFIGS; writes ``ds-rank{r}.pt``. Then
    `zero3_uneven_worker` (``uneven-rank{r}.pt``).

    Two costs of building 25 DeepSpeed engines that no assertion reads are paid once per process:
    py-cpuinfo's subprocess (`one_cpu_info_per_process`), and the full garbage collection that
    each ZeRO-3 engine runs while it lays out its partitions (~1 s over the objects of torch,
    DeepSpeed and the test modules): `gc.freeze` leaves the objects that exist before the first
    engine out of every later collection."""
    import gc

    one_cpu_info_per_process()
    gc.freeze()
    rows = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    res: dict[str, Any] = {}
    for label, config in ZERO_CONFIGS.items():
        path = out / f"{label}-rank{rank}.json"  # each rank its own: read before the group exists
        path.write_text(json.dumps(config))
        for name in DS_SCENARIOS:
            assert name in SCENARIOS
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tr = build(name, LOCAL_B, deepspeed=str(path))
                assert isinstance(tr.backend, DeepSpeedBackend)
                assert tr.backend.stage == config["zero_optimization"]["stage"]
                d = data(name, world)
                metrics = run_steps(tr, d, rows, range(STEPS))
                with tr.gathered_weights():  # ZeRO-3: the full weights on every rank
                    weights = params(tr)
            res[f"{name}/{label}"] = {
                "params": weights,
                "metrics": metrics,
                "non_finite": tr.non_finite_steps,
                "optimizer": type(tr.optimizer).__name__,
            }
    torch.save(res, out / f"ds-rank{rank}.pt")
    # the ZeRO-3 refusal of uneven batches, in these processes rather than 2 more (an error other
    # than the refusal is written down for its own test to report, not raised for every test here)
    try:
        zero3_uneven_worker(rank, world, out)
    except Exception as e:
        torch.save({"message": f"raised {e!r}", "unchanged": None}, out / f"uneven-rank{rank}.pt")


def zero3_uneven_worker(rank: int, world: int, out: Path) -> None:
    """ZeRO-3 with one state fewer on rank 1: ``step`` must raise on every rank before any
    forward (which would hang: each forward all-gathers weights); writes ``uneven-rank{r}.pt``."""
    path = out / f"zero3-rank{rank}.json"  # no process group yet: the trainer joins it
    path.write_text(json.dumps(ZERO_CONFIGS["zero3"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = build("bandit_deferred", LOCAL_B, deepspeed=str(path))
    assert isinstance(tr.backend, DeepSpeedBackend)
    d = data("bandit_deferred", world)
    n = LOCAL_B - rank  # rank 1 gets one state fewer
    rows = slice(rank * LOCAL_B, rank * LOCAL_B + n)
    with tr.gathered_weights():
        before = params(tr)
    message = ""
    try:
        tr.step(d["states"][0, rows], noise=d["noise"][0, rows])
    except ValueError as e:
        message = str(e)
    with tr.gathered_weights():
        after = params(tr)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    torch.save({"message": message, "unchanged": unchanged}, out / f"uneven-rank{rank}.pt")


# ---- DeepSpeed's JIT-built ops, and processes that cannot outlive a test ------------------------
# DeepSpeed builds its C++ ops (shm_comm for every CPU run, cpu_adam for the optimizer offload) the
# first time they are used, with torch.utils.cpp_extension, into TORCH_EXTENSIONS_DIR (the tests
# point it at the checkout's .torch_extensions/, see tests/conftest.py). A build holds the file
# ``<dir>/<op>/lock`` open while it compiles and removes it at the end; every other process waits,
# without a time limit, until the file is gone. A build that is killed leaves the file behind.

#: a lock file this old that no process holds open is left over from a killed build
STALE_LOCK_MINUTES = 5.0


def extensions_dir() -> Path:
    """Where torch builds and finds DeepSpeed's ops (``TORCH_EXTENSIONS_DIR``, else torch's default)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def lock_holders(path: Path) -> list[int] | None:
    """PIDs of the processes that have ``path`` open (from /proc); None where /proc is missing."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(path)
    holders = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == target for fd in (d / "fd").iterdir()):
                holders.append(int(d.name))
        except OSError:  # gone, or not ours to inspect
            continue
    return holders


def build_locks(root: Path | None = None) -> list[tuple[Path, float, list[int] | None]]:
    """Each lock file under the extensions directory: (path, age in seconds, holders)."""
    root = extensions_dir() if root is None else root
    found = []
    for path in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}):
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        found.append((path, age, lock_holders(path)))
    return found


def is_stale(age: float, holders: list[int] | None) -> bool:
    """No process holds it and it is older than STALE_LOCK_MINUTES (an hour without /proc)."""
    if holders is None:
        return age > 3600.0
    return not holders and age > STALE_LOCK_MINUTES * 60.0


def stale_lock_problem(root: Path | None = None) -> str | None:
    """The message naming each stale build lock and the command that removes it; None if none."""
    stale = [(p, age) for p, age, holders in build_locks(root) if is_stale(age, holders)]
    if not stale:
        return None
    listed = "; ".join(f"{p} ({age / 60:.0f} min old, held open by no process)" for p, age in stale)
    return (
        f"stale torch extension build lock: {listed}. A build of a DeepSpeed op was killed and left "
        f"its lock file; every DeepSpeed test would wait for it to disappear until the test's "
        f"timeout (300-420 s). Remove it and rerun: rm {' '.join(shlex.quote(str(p)) for p, _ in stale)}"
    )


def describe_locks(root: Path | None = None) -> str:
    """One line on the build locks present (for a timeout's message)."""
    locks = build_locks(root)
    if not locks:
        return f"no op build lock in {extensions_dir() if root is None else root}"
    parts = []
    for path, age, holders in locks:
        who = "holders unknown" if holders is None else f"held by pids {holders}" if holders else "no holder"
        parts.append(f"{path} ({age:.0f} s old, {who}; if stale: rm {shlex.quote(str(path))})")
    return "op build lock(s) present: " + "; ".join(parts)


def run_command(cmd: list[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, capture_output=True, text=True)` whose timeout kills the launcher and
    every worker it started (``subprocess.run`` kills only the launcher: torchrun's workers would
    live on), then raises `TimeoutError` naming the op build locks present."""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, err = proc.communicate()
            raise TimeoutError(
                f"{' '.join(cmd[:6])} ... did not finish within {timeout:.0f} s; it and its workers "
                f"were killed. {describe_locks()}.\n--- stderr (end) ---\n{err[-3000:]}"
            ) from None
        except BaseException:
            kill_tree(proc.pid)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(fn: Callable[[int, int, Path], None], out: Path, world: int = 2, timeout: float = 90.0) -> None:
    """`tests.distributed_toys.launch` whose timeout also removes the op build locks the killed
    workers left and names the locks present (a worker may be waiting for a build)."""
    dist_launch(fn, out, world, timeout, on_timeout=_lock_note)


def _lock_note(started: float) -> str:
    removed = _remove_locks_left_since(started)
    note = f"Removed the build lock(s) the killed workers left: {removed}. " if removed else ""
    return note + describe_locks() + "."


def _remove_locks_left_since(started: float) -> list[str]:
    """Remove the build locks created since ``started`` that no process holds any more (their
    builder was just killed by us); the names of those removed."""
    removed = []
    for path, age, holders in build_locks():
        if holders == [] and time.time() - age >= started - 1.0:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(str(path))
    return removed


def hung_build_worker(rank: int, world: int, out: Path) -> None:
    """A worker stuck in an op build: it holds the op's lock file open (as torch's FileBaton does),
    starts a "compiler" process, writes both pids to ``hung-rank{r}.json`` and never returns."""
    lock_dir = extensions_dir() / "fake_op"
    lock_dir.mkdir(parents=True, exist_ok=True)
    os.open(lock_dir / "lock", os.O_CREAT | os.O_EXCL)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (out / f"hung-rank{rank}.json").write_text(json.dumps({"worker": os.getpid(), "child": child.pid}))
    time.sleep(600)


def shutdown_worker(rank: int, world: int, out: Path) -> None:
    """A trainer (DeepSpeed ZeRO-3 when ``out/zero3.json`` exists, else the trainer's own sync)
    takes a step, then `grpo.engine.distributed.shutdown`; once the script lets the trainer and the policy
    go, no gloo thread may be left for interpreter exit. Writes ``threads-rank{r}.json``: the
    names of this process's threads then, and whether the group is still initialised."""
    import gc

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.engine.distributed import shutdown
    from grpo.policies import categorical_mlp

    ds = out / "zero3.json"
    config = GRPOConfig(group_size=4, batch_size=2, seed=0, deepspeed=str(ds) if ds.exists() else "off")
    policy = categorical_mlp(4, 3, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(config, policy, lambda s, a: (a == 0).float())
        trainer.step(torch.randn(2, 4))
    assert (isinstance(trainer.backend, DeepSpeedBackend) and trainer.backend.stage == 3) is ds.exists()
    shutdown(trainer)
    del trainer, policy
    gc.collect()
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.exists() else []
    report = {"threads": names, "initialised": torch.distributed.is_initialized()}
    (out / f"threads-rank{rank}.json").write_text(json.dumps(report))
