"""One run of an async (k >= 1) training that the test kills with SIGKILL and resumes.

    python tests/data/async_kill_run.py MODEL_DIR OUT_DIR NUM_STEPS K

A tiny causal LM trains on `PromptBatches` (registered, so checkpoints hold the data position)
with a generation worker k steps ahead, a checkpoint every step (all kept), and a JSONL sink that
records which prompts each step trained on (``data/id0``, ``data/id1``). Each step's completions
(token ids, texts, policy versions) go to ``OUT_DIR/completions/step-N.json`` (a redone step
rewrites its file), and each attempt appends its worker's pid to ``OUT_DIR/worker_pids.txt`` and
the step it starts at (0, or the step of the checkpoint it resumed) to ``OUT_DIR/starts.txt``.
Started again, it resumes from the newest checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo import GRPOConfig, GRPOTrainer
from grpo.llm import CausalLMPolicy, PromptBatches, RewardFunctions
from grpo.llm.sampling_settings import SamplingSettings
from grpo.metrics.sinks import JSONLSink
from grpo.training.callbacks import Callback, TrainState

RECORDS = [{"prompt": f"{i % 10}+{i // 10}=", "id": i} for i in range(30)]


class TrainedIds(Callback):
    """Adds the ids of the prompts the step trained on to its record."""

    def __init__(self, out: Path) -> None:
        self.out = out / "completions"
        self.out.mkdir(parents=True, exist_ok=True)

    def on_train_start(self, state: TrainState) -> None:
        with (self.out.parent / "starts.txt").open("a") as f:
            f.write(f"{state.trainer.step_count}\n")

    def on_metrics(self, state: TrainState, metrics: dict[str, float]) -> None:
        batch: Any = state.trainer.last_batch  # type: ignore[attr-defined]
        for j, s in enumerate(batch.states):
            metrics[f"data/id{j}"] = float(s["id"])
        flat = [c for g in batch.actions for c in g] if isinstance(batch.actions[0], list) else batch.actions
        completions = [{"ids": c.token_ids.tolist(), "text": c.text} for c in flat]
        versions = batch.policy_versions.tolist()
        text = json.dumps({"completions": completions, "versions": versions})
        (self.out / f"step-{state.trainer.step_count}.json").write_text(text)


def main() -> None:
    model_dir, out, num_steps, k = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = CausalLMPolicy(
        AutoModelForCausalLM.from_pretrained(model_dir), tok, SamplingSettings(max_new_tokens=4)
    )
    reward = RewardFunctions(lambda prompts, completions: [float(c.count("1")) for c in completions])
    cfg = GRPOConfig(
        group_size=2, batch_size=2, learning_rate=1e-3, seed=0, checkpoint_freq=1,
        generation_engine="worker", async_staleness=k,
    )  # fmt: skip
    trainer = GRPOTrainer(cfg, policy, reward)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "worker_pids.txt").open("a") as f:
        f.write(f"{trainer.collector.engine.inner.pid}\n")  # type: ignore[attr-defined]
    batches = PromptBatches(RECORDS, 2, shuffle=True, seed=0, epochs=None)
    trainer.register_checkpoint_state("data", batches)
    ckpt = out / "checkpoints"
    resume = ckpt if (ckpt / "latest").exists() else None
    try:
        trainer.train(
            batches, num_steps, checkpoint_dir=ckpt, resume_from=resume, progress=False,
            sinks=[JSONLSink(out / "metrics.jsonl")], callbacks=[TrainedIds(out)],
        )  # fmt: skip
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
