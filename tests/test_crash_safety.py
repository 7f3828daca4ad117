"""SIGKILL a training process at random moments; the newest complete checkpoint always loads.

Training runs in processes forked from a "zygote" (tests/reliability_toys.py zygote) that has
imported torch and grpo but computed nothing, so each of the >= 20 runs starts in milliseconds.
Each run resumes from the newest complete checkpoint, trains with a checkpoint every step, and is
killed with SIGKILL after a random delay (often inside save_checkpoint: fsync makes saves the
slowest part). After every kill the test checks that every ``step-*`` directory is complete, that
the newest loads, and that the next run starts from it. At the end the run is finished without
a kill and its weights are compared bitwise with an uninterrupted run of the same length.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest

from grpo.state.checkpoint import find_latest_checkpoint, list_checkpoints, manifest_problem
from tests.reliability_toys import resume

TOYS = Path(__file__).parent / "reliability_toys.py"
KILLS = 20


def _read_until(out: IO[str], pattern: str) -> tuple[re.Match[str], list[str]]:
    """Lines of ``out`` up to the one matching ``pattern`` (searched, so a torn line still matches)."""
    seen = []
    while True:
        line = out.readline()
        if not line:
            raise RuntimeError(f"zygote closed its output; lines so far: {seen[-5:]}")
        m = re.search(pattern, line)
        if m:
            return m, seen
        seen.append(line)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_sigkill_at_random_moments_never_leaves_a_half_written_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    rnd = random.Random(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    zygote = subprocess.Popen(
        [sys.executable, str(TOYS), "zygote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(240.0, zygote.kill)  # bound the whole test even if something hangs
    watchdog.start()
    assert zygote.stdin is not None
    assert zygote.stdout is not None

    def send(cmd: str) -> None:
        assert zygote.stdin is not None
        zygote.stdin.write(cmd + "\n")
        zygote.stdin.flush()

    try:
        _read_until(zygote.stdout, r"zygote ready")
        resumed_from = 0
        for _ in range(KILLS):
            send(f"run run {ckpt} 1000000 --save-every 1 --resume")
            m, _ = _read_until(zygote.stdout, r"child (\d+)")
            pid = int(m.group(1))
            m, _ = _read_until(zygote.stdout, r'\{"ready": (\d+)\}')
            assert int(m.group(1)) == resumed_from, "each run starts from the newest complete checkpoint"
            threading.Event().wait(rnd.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
            send(f"reap {pid}")
            m, lines = _read_until(zygote.stdout, r"reaped (-?\d+)")
            assert os.WIFSIGNALED(int(m.group(1)))
            assert os.WTERMSIG(int(m.group(1))) == signal.SIGKILL
            rows = []
            for line in lines:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue  # a line torn by the kill
            confirmed = [r["step"] for r in rows if r.get("saved")]

            # no step-* directory is ever incomplete, and the newest one loads
            for path in list_checkpoints(ckpt):
                assert manifest_problem(path) is None, path
            latest = find_latest_checkpoint(ckpt)
            if latest is None:
                assert not confirmed
                continue
            newest = resume(str(ckpt)).step_count
            assert newest >= max(confirmed, default=0)
            assert newest >= resumed_from
            resumed_from = newest
        assert resumed_from > 0

        # finish without a kill, and compare with an uninterrupted run of the same length
        total = resumed_from + 3
        send(f"run run {ckpt} {total} --save-every 1 --resume")
        m, _ = _read_until(zygote.stdout, r"done ([0-9a-f]+)")
        resumed_hash = m.group(1)
        send(f"run run {tmp_path / 'straight'} {total}")
        m, _ = _read_until(zygote.stdout, r"done ([0-9a-f]+)")
        assert m.group(1) == resumed_hash
        send("exit")
        zygote.wait(timeout=30)
    finally:
        watchdog.cancel()
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()
