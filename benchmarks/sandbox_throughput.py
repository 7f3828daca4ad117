"""Sandboxed executions per second (issue 43): grpo.envs.sandbox on this machine's cores.

    python benchmarks/sandbox_throughput.py [--runs 80] [--threads 1 2 4 8] [--busy]

Prints, as JSON lines:

- the start-up cost, serial medians: ``bwrap`` alone (the same namespaces and binds, running
  ``true``), the interpreter alone (``python -I -S -c pass``), and one whole `run_python("pass")`;
- trivial runs per second (`run_python("pass")`) with 1, 2, 4, 8 threads submitting;
- programs with 10 tests per second (`grpo.llm.code_rewards.run_tests`): 10 ``assert f(x) ==
  literal`` tests (one sandbox run per program) and 10 stdin/stdout tests (ten runs per program);
- with ``--busy``, the trivial rate again beside one process spinning on a core (a trainer's
  stand-in), the threads alternating with the quiet measurement.

The machine's load (``os.getloadavg``) is printed before and after each figure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.envs.sandbox import SandboxLimits, _interpreter, _setup, run_python
from grpo.llm.code_rewards import CodeTests, run_tests

LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=20.0, memory_bytes=256 * 2**20)
SOLUTION = "def f(x):\n    return x * x\n\nimport sys\nif not sys.stdin.isatty():\n    pass\n"
ASSERTS = CodeTests(asserts=tuple(f"assert f({i}) == {i * i}" for i in range(10)))
IO_CODE = "x = int(input())\nprint(x * x)\n"
IO = CodeTests(io=tuple((f"{i}\n", f"{i * i}\n") for i in range(10)))


def emit(**record: object) -> None:
    print(json.dumps({**record, "load": [round(x, 2) for x in os.getloadavg()]}), flush=True)


def serial_median(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def startup(n: int) -> None:
    bwrap, _, binds = _setup(os.environ.get("PATH", os.defpath))
    python = _interpreter()[0]
    bare = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", *binds]
    bare += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "/usr/bin/true"]
    emit(
        figure="startup_s",
        what="bwrap alone",
        median=serial_median(lambda: subprocess.run(bare, check=True), n),
    )
    interp = [python, "-I", "-S", "-c", "pass"]
    emit(
        figure="startup_s", what="python -I -S alone", median=serial_median(lambda: subprocess.run(interp), n)
    )
    emit(
        figure="startup_s",
        what="run_python('pass')",
        median=serial_median(lambda: run_python("pass", LIMITS), n),
    )


def rate(job: Callable[[], object], runs: int, threads: int) -> float:
    """Jobs per second with ``threads`` submitting ``runs`` jobs."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        start = time.perf_counter()
        list(pool.map(lambda _: job(), range(runs)))
        return runs / (time.perf_counter() - start)


def trivial() -> None:
    result = run_python("pass", LIMITS)
    if result.status != "ok":
        raise RuntimeError(f"the trivial program failed: {result}")


def ten_tests(code: str, tests: CodeTests) -> Callable[[], object]:
    def job() -> None:
        (outcome,) = run_tests([code], [tests], LIMITS, workers=1)
        if outcome.passed != 10:
            raise RuntimeError(f"the 10-test program failed: {outcome}")

    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=80)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--busy", action="store_true")
    args = parser.parse_args()
    emit(figure="machine", cores=os.cpu_count(), python=sys.version.split()[0])
    startup(max(10, args.runs // 4))
    for k in args.threads:
        emit(figure="trivial_runs_per_s", threads=k, rate=rate(trivial, args.runs, k))
    for name, code, tests in (("10_asserts", SOLUTION, ASSERTS), ("10_stdin_stdout", IO_CODE, IO)):
        for k in (2, 4):  # programs at a time; each stdin/stdout program runs its 10 tests in turn
            n = max(8, args.runs // (10 if tests.io else 1))
            emit(figure="programs_per_s", tests=name, threads=k, rate=rate(ten_tests(code, tests), n, k))
    if args.busy:
        best = max(args.threads)
        for side in ("quiet", "busy", "quiet", "busy"):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if side == "busy" else None
            try:
                emit(
                    figure="trivial_runs_per_s", side=side, threads=best, rate=rate(trivial, args.runs, best)
                )
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()


if __name__ == "__main__":
    main()
