"""What each process of the 2-process `grpo-train` test runs (module level: spawn pickles it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def record_prompts(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """A reward (``--reward path.py:record_prompts``) that appends this rank's prompts of the step
    to ``$GRPO_TEST_OUT/prompts-rank{RANK}.jsonl`` and scores completion length."""
    out = Path(os.environ["GRPO_TEST_OUT"]) / f"prompts-rank{os.environ['RANK']}.jsonl"
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(sorted({str(p) for p in prompts})) + "\n")
    return [float(len(c)) for c in completions]


def char_score(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """A reward that differs between completions (so the advantages, and the update, are not 0)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def cli_worker(rank: int, world: int, out: Path) -> None:
    """``grpo-train`` with the arguments in ``out/args.json`` on this rank."""
    from grpo.llm.cli import main

    os.environ["GRPO_TEST_OUT"] = str(out)
    (out / f"prompts-rank{rank}.jsonl").unlink(missing_ok=True)  # a rerun starts clean
    if rank == 0:
        shutil.rmtree(out / "run", ignore_errors=True)
    args = json.loads((out / "args.json").read_text())
    if main(args) != 0:
        raise RuntimeError(f"grpo-train returned non-zero on rank {rank}")


def deepspeed_cli_worker(rank: int, world: int, out: Path) -> None:
    """`cli_worker` with the variables ``accelerate launch`` exports for a DeepSpeed config
    (``out/accelerate_env.json``); records the ZeRO stage the trainer ran with."""
    import grpo.llm.cli as cli

    os.environ.update(json.loads((out / "accelerate_env.json").read_text()))
    built: list[Any] = []
    original = cli.GRPOTrainer

    class Recording(original):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    cli.GRPOTrainer = Recording  # type: ignore[misc]
    try:
        cli_worker(rank, world, out)
    finally:
        cli.GRPOTrainer = original  # type: ignore[misc]
    ds = built[0]._deepspeed
    (out / f"stage-rank{rank}.json").write_text(json.dumps(None if ds is None else ds.stage))
