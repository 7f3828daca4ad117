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
    (``out/accelerate_env.json``); records the ZeRO stage the trainer ran with and whether the
    policy's and the reference copy's weights ended up partitioned (ZeRO-3)."""
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
    from grpo.engine.deepspeed import is_partitioned

    trainer = built[0]
    reference = trainer._reference_module()  # None for LoRA (the adapter disabled)
    ran = {
        "stage": trainer.deepspeed_stage,
        "partitioned": trainer.policy.is_partitioned,
        "reference_partitioned": None if reference is None else is_partitioned(reference),
    }
    (out / f"stage-rank{rank}.json").write_text(json.dumps(ran))


def zero3_policy_worker(rank: int, world: int, out: Path) -> None:
    """`GRPOTrainer` + `CausalLMPolicy` under ZeRO-3 (the config in ``out/zero3.json``) with
    ``max_new_tokens`` 2 on rank 0 and 6 on rank 1, as when one rank's completions all stop early:
    generation must keep the ranks in step (in ``step`` and in ``evaluate``). Then
    ``save_pretrained`` on every rank; rank 0 also
    writes the gathered weights (``gathered.pt``) for comparison. Writes ``zero3-rank{r}.json``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings

    model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out / "model")
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=6), logprob_chunk_size=3)
    reward = RewardFunctions({"score": char_score})
    config = GRPOConfig(
        group_size=2, batch_size=2, seed=0, learning_rate=0.01, deepspeed=str(out / "zero3.json")
    )
    trainer = GRPOTrainer(config, policy, reward)
    lengths = []
    for step in range(2):
        prompts = [f"{rank}{step}+{i}=" for i in range(2)]
        trainer.step(prompts, max_new_tokens=2 if rank == 0 else 6)
        lengths.append(policy.last_generation["completion_tokens"])
    evaluation = trainer.evaluate([f"{rank}+{i}=" for i in range(2)], max_new_tokens=2 + 4 * rank)
    policy.save_pretrained(str(out / "saved"))
    with trainer.gathered_weights():
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, out / "gathered.pt")
    result = {
        "partitioned": policy.is_partitioned,
        "completion_tokens": lengths,
        "eval_reward": evaluation["eval/reward/mean"],
    }
    (out / f"zero3-rank{rank}.json").write_text(json.dumps(result))
