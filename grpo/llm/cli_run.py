"""The ``grpo-train`` run: the states, the policy and rewards, the trainer, `train` and `main`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from grpo.config import GRPOConfig
from grpo.engine.distributed import get_world_size, is_main_process, rank_batches, shutdown
from grpo.envs.protocol import TextEnvironment
from grpo.generation.worker import GenerationWorkerError
from grpo.llm._deps import require
from grpo.llm.cli_options import build_config, build_eval_options, parse_args
from grpo.llm.cli_outputs import (
    RunOutputs,
    SaveModels,
    StepMetrics,
    checkpoint_plan,
    open_outputs,
    save_model,
)
from grpo.llm.cli_rewards import build_rewards, load_callable
from grpo.llm.data import PromptBatches, PromptDataset
from grpo.llm.multiturn import ConversationReward, MultiTurnPolicy
from grpo.llm.policy import CausalLMPolicy
from grpo.llm.rewards import RewardFunctions
from grpo.trainer import GRPOTrainer
from grpo.training.callbacks import Callback
from grpo.training.completions_table import CompletionsTable

__all__ = [
    "RankBatches",
    "load_starts",
    "main",
    "train",
]

logger = logging.getLogger("grpo.llm")


def load_starts(path: str | Path, column: str = "start") -> list[Any]:
    """The start states of ``grpo-train --env --dataset PATH``: row i's ``column`` when the rows
    are records holding it, else the whole row (a record such as ``{"secret": 7}``, or a plain
    value: one JSON value per line). Files as `PromptDataset.load` reads them: ``.jsonl`` and
    ``.json`` with the standard library, ``.parquet`` / ``.csv`` / ``.tsv`` and ``save_to_disk``
    directories with ``datasets``.

    ValueError when some records hold ``column`` and others do not (naming the first without),
    or when there are no rows."""
    file = Path(path)
    suffix = file.suffix.lower()
    rows: list[Any]
    if not file.exists():
        raise FileNotFoundError(f"--dataset {str(file)!r} (the start states of --env) not found.")
    if file.is_file() and suffix in (".jsonl", ".json"):
        text = file.read_text(encoding="utf-8")
        try:
            rows = (
                json.loads(text)
                if suffix == ".json"
                else [json.loads(x) for x in text.splitlines() if x.strip()]
            )
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e.msg}); give one JSON value per line.") from e
        if not isinstance(rows, list):
            raise ValueError(f"{file} holds a JSON {type(rows).__name__}; expected a list of start states.")
    else:
        datasets = require("datasets")
        if file.is_dir():
            data = datasets.load_from_disk(str(file))
        else:
            builder = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}.get(suffix, "json")
            data = datasets.load_dataset(builder, data_files=str(file), split="train")
        rows = [dict(r) for r in (data["train"] if isinstance(data, Mapping) else data)]
    if not rows:
        raise ValueError(f"{file} holds no start states; give at least one row.")
    has = [isinstance(r, Mapping) and column in r for r in rows]
    if not any(has):
        return rows
    if not all(has):
        i = has.index(False)
        raise ValueError(
            f"{file}: row {i} has no {column!r} column ({rows[i]!r:.80}) but others do; give every row "
            f"one (--start-column names it), or none (each row is then a start)."
        )
    return [r[column] for r in rows]


class RankBatches:
    """This process's share of each global batch of a `PromptBatches` (identity on one process),
    with its state: registered as the trainer's ``"data"`` checkpoint component, the position in
    the data is saved with every checkpoint and a resumed run continues at the next batch."""

    def __init__(self, batches: PromptBatches) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        yield from rank_batches(self.batches.records, self.batches)  # a Sequence source: sharded

    def state_dict(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batches.load_state_dict(state)


def train(args: argparse.Namespace) -> dict[str, float]:
    """Run the training described by ``args`` (`parse_args`); return the last step's metrics."""
    transformers = require("transformers")
    records = _training_states(args)  # prompt records, or with --env the start states
    eval_states = None
    if args.eval_dataset is not None:  # read before any model is loaded: its errors come first
        eval_states = PromptDataset.load(args.eval_dataset, prompt_column=args.prompt_column).records
    make_env = None if args.env is None else load_callable(args.env, "--env")
    plan = _plan_steps(args, len(records))
    config = build_config(args, num_steps=plan.total)  # a decaying schedule: over this run
    ckpt = checkpoint_plan(args, config)
    trainer_config = (
        config if ckpt.directory is not None else dataclasses.replace(config, checkpoint_freq=None)
    )
    policy, rewards = _policy_and_rewards(args, config, transformers, make_env)
    trainer = GRPOTrainer(trainer_config, policy, rewards)  # the KL reference: policy.reference_policy()
    batches = PromptBatches(
        records, plan.global_batch, seed=int(config.seed or 0), epochs=None, drop_last=plan.drop_last
    )
    data = RankBatches(batches)
    trainer.register_checkpoint_state("data", data)  # no end: the same state for any --max-steps
    out_dir = Path(args.output_dir)
    if plan.main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    _log_plan(args, len(records), plan)
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        outputs = open_outputs(args, out_dir, stack) if plan.main_process else RunOutputs([], None)
        state = trainer.train(
            data,
            num_steps=plan.total,
            eval_states=eval_states,
            eval_every=None if eval_states is None else args.eval_every,
            eval_options=build_eval_options(args),
            callbacks=_callbacks(args, trainer, rewards, plan, outputs.wandb_run),
            sinks=outputs.sinks,
            progress="bar" if args.progress else False,
            checkpoint_dir=ckpt.directory,
            resume_from=ckpt.resume_from,
        )
        metrics = state.history[-1] if state.history else {}
        final = out_dir / "final_model"
        save_model(trainer, final, args, metrics)
    trainer.close()  # DeepSpeed's engines and groups are freed now, not at interpreter exit
    if isinstance(policy, MultiTurnPolicy):
        policy.close()  # the environment's tools and threads
    logger.info(
        "done: %d steps in %.1f s; final model in %s",
        trainer.step_count,
        time.perf_counter() - t_start,
        final,
    )
    return metrics


def _policy_and_rewards(
    args: argparse.Namespace,
    config: GRPOConfig,
    transformers: Any,
    make_env: Callable[[int], TextEnvironment] | None,
) -> tuple[CausalLMPolicy | MultiTurnPolicy, RewardFunctions | ConversationReward]:
    """The `CausalLMPolicy` and the ``--reward`` functions; with ``--env`` the `MultiTurnPolicy`
    playing ``make_env``'s episodes with it and the environment's `ConversationReward`
    (``--per-turn-credit``: turn-level credit discounted by ``config.gamma``)."""
    lm = build_policy(args, *_load_model(args, transformers))
    if make_env is None:
        return lm, build_rewards(args)
    policy = MultiTurnPolicy(lm, make_env, max_turns=args.max_turns, max_total_tokens=args.max_total_tokens)
    return policy, ConversationReward(per_turn=args.per_turn_credit, gamma=config.gamma)


def _training_states(args: argparse.Namespace) -> Sequence[Any]:
    """The states the steps draw from: the ``--dataset`` prompt records; with ``--env`` the start
    states, ``--dataset`` rows (`load_starts`) or the seeds ``0 .. --num-starts - 1``."""
    if args.env is None:
        return PromptDataset.load(args.dataset, prompt_column=args.prompt_column).records
    if args.dataset is None:
        return list(range(args.num_starts))
    return load_starts(args.dataset, args.start_column)


def _callbacks(
    args: argparse.Namespace,
    trainer: GRPOTrainer,
    rewards: RewardFunctions | ConversationReward,
    plan: _StepPlan,
    wandb_run: Any,
) -> list[Callback]:
    """The command's callbacks: its keys of each record and ``trainer_state`` (`StepMetrics`),
    the model saves (`SaveModels`) and, with ``--log-completions-every``, the completions table
    (rank 0: ``completions.jsonl``, and a W&B table with ``--use-wandb``)."""
    out_dir = Path(args.output_dir)
    callbacks: list[Callback] = [
        StepMetrics(rewards, plan.total, plan.per_epoch),
        SaveModels(trainer, out_dir, args),
    ]
    every = args.log_completions_every
    if every is not None and plan.main_process:
        callbacks.append(CompletionsTable(out_dir / "completions.jsonl", every=every, wandb_run=wandb_run))
    return callbacks


def _log_plan(args: argparse.Namespace, num_states: int, plan: _StepPlan) -> None:
    logger.info(
        "%d %s, %d a step: %d steps (%d epoch%s of %d steps%s)",
        num_states,
        "prompts" if args.env is None else "start states",
        plan.global_batch,
        plan.total,
        plan.epochs,
        "s" if plan.epochs > 1 else "",
        plan.per_epoch,
        "; --max-steps cycles the data" if args.max_steps is not None and plan.epochs > 1 else "",
    )


def _load_model(args: argparse.Namespace, transformers: Any) -> tuple[Any, Any]:
    """The model (in bfloat16 with ``--bf16``; wrapped in a LoRA adapter with ``--lora``) and tokenizer."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_name, dtype=dtype)
    if args.lora:
        peft = require("peft")
        targets = args.lora_target_modules
        lora_cfg = peft.LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=targets if targets == "all-linear" else [t for t in targets.split(",") if t],
            task_type="CAUSAL_LM",
        )
        torch.manual_seed(int(args.seed or 0))  # the adapter's random init (LoRA A) follows --seed
        model = peft.get_peft_model(model, lora_cfg)
    return model, tokenizer


def build_policy(args: argparse.Namespace, model: Any, tokenizer: Any) -> CausalLMPolicy:
    """The `CausalLMPolicy` with the generation and log-prob options of ``args``: the sampling
    flags become one `SamplingSettings` (named after its fields, so the flags are read by name)."""
    from grpo.llm.sampling_settings import SamplingSettings

    chat = {"auto": None, "yes": True, "no": False}[args.use_chat_template]
    sampling = SamplingSettings(**{name: getattr(args, name) for name in SamplingSettings.names()})
    return CausalLMPolicy(
        model,
        tokenizer,
        sampling,
        use_chat_template=chat,
        system_prompt=args.system_prompt,
        max_prompt_length=args.max_prompt_length,
        logprob_chunk_size=args.logprob_chunk_size or None,
        gradient_checkpointing=args.gradient_checkpointing,
        autocast=args.autocast,
        use_separate_reference_adapter=args.use_separate_reference_adapter,
    )


class _StepPlan(NamedTuple):
    main_process: bool
    global_batch: int  # prompts per step over all processes
    drop_last: bool
    per_epoch: int  # steps per pass over the dataset
    epochs: int
    total: int  # steps to train


def _plan_steps(args: argparse.Namespace, num_states: int) -> _StepPlan:
    """How many steps of how many prompts, over how many passes of the dataset.

    Under torchrun / accelerate launch each step draws a global batch of world * batch_size
    prompts (the same order on every rank: same seed) and each rank takes its shard; only full
    global batches are used, so every rank takes the same number of steps.
    """
    world = get_world_size()
    main_proc = is_main_process()
    global_batch = args.batch_size * world
    drop_last = world > 1
    per_epoch = num_states // global_batch if drop_last else -(-num_states // global_batch)
    epochs = args.num_epochs if args.max_steps is None else max(1, -(-args.max_steps // max(per_epoch, 1)))
    total = per_epoch * epochs
    if per_epoch == 0:
        raise ValueError(
            f"{num_states} states do not fill one global batch of {global_batch} "
            f"(--batch-size={args.batch_size} x {world} processes); use more states or a smaller "
            f"--batch-size."
        )
    if args.max_steps is not None:
        total = args.max_steps
    return _StepPlan(main_proc, global_batch, drop_last, per_epoch, epochs, total)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``grpo-train``."""
    # under torchrun / accelerate launch only rank 0 tells the story (warnings come from all)
    level = logging.INFO if is_main_process() else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        metrics = train(args)
    except GenerationWorkerError as e:  # its message says what failed and what to do; once
        raise SystemExit(f"grpo-train: error: GenerationWorkerError: {e}") from None
    shutdown()  # every rank done, then the process group is destroyed (no-op on one process)
    if is_main_process():  # the result on stdout (one JSON line); the log went to stderr
        final = str(Path(args.output_dir) / "final_model")
        sys.stdout.write(json.dumps({"final_model": final, **metrics}) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
