"""Checkpoints across process counts: saved by 2 processes, resumed on 1, and the other way round.

Uses `GRPOTrainer.save_checkpoint` / `load_checkpoint` (grpo/state/checkpoint/); skipped until that
module exists. Batch sizes in the config are per process: the 1-process run has batch_size 8, the
2-process run 4 per process (the same global batch), so loading across the two warns that the
configs differ in batch_size, and the run still continues exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("grpo.state.checkpoint")

from tests.distributed_toys import (
    CHECKPOINT_SCENARIO,
    LOCAL_B,
    STEPS,
    build,
    checkpoint_worker,
    data,
    launch,
    params,
    run_steps,
)

WORLD = 2
pytestmark = pytest.mark.multiprocess  # 2 spawned processes; .ci/run runs it after the README command


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: Path = tmp_path_factory.mktemp("dist-ckpt")
    d = data(CHECKPOINT_SCENARIO, WORLD)
    tr = build(CHECKPOINT_SCENARIO, WORLD * LOCAL_B)
    run_steps(tr, d, slice(None), range(3))
    tr.save_checkpoint(out / "ckpt1")  # type: ignore[attr-defined]
    run_steps(tr, d, slice(None), range(3, STEPS))
    ref = params(tr)
    launch(checkpoint_worker, out, world=WORLD)
    ranks = [torch.load(out / f"ckpt-rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return {"ref": ref, "ranks": ranks, "out": out, "data": d}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    for k in a:
        err = (a[k] - b[k]).abs().max().item()
        assert err <= atol, f"{k}: max |diff| = {err:.3g} > {atol}"


def test_checkpoint_saved_by_two_processes_resumes_on_one(run: dict[str, Any]) -> None:
    tr = build(CHECKPOINT_SCENARIO, WORLD * LOCAL_B)
    with pytest.warns(UserWarning, match="batch_size"):
        tr.load_checkpoint(run["out"] / "ckpt2")  # type: ignore[attr-defined]
    assert tr.step_count == 3
    run_steps(tr, run["data"], slice(None), range(3, STEPS))
    close(params(tr), run["ranks"][0]["uninterrupted"])
    close(params(tr), run["ref"])


def test_checkpoint_saved_by_one_process_resumes_on_two(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        assert rank["step_count"] == 3
        close(rank["resumed_from1"], run["ref"])
        close(rank["resumed_from1"], run["ranks"][0]["uninterrupted"])


def test_two_processes_write_one_checkpoint(run: dict[str, Any]) -> None:
    # every rank called save_checkpoint; only rank 0 wrote, so exactly one step directory exists
    names = sorted(p.name for p in (run["out"] / "ckpt2").iterdir() if not p.name.startswith("."))
    assert [n for n in names if n.startswith("step-")] == ["step-00000003"]
