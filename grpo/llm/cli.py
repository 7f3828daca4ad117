"""``grpo-train`` (and ``python -m grpo.llm``): GRPO fine-tuning of a Hugging Face causal LM.

    grpo-train --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl \
        --reward exact_match=1.0 --reward format=0.2 --num-generations 8 --output-dir out

Options follow seed 003 (``--model-name``, ``--batch-size``, ``--num-epochs``, ``--learning-rate``,
``--num-generations``, ``--max-new-tokens``, ``--kl-coef``, ``--clip-range``, ``--temperature``,
``--gradient-accumulation-steps``, ``--max-grad-norm``, ``--warmup-steps``, ``--output-dir``,
``--logging-steps``, ``--save-steps``, ``--use-wandb``, ``--device``, ...). ``--config FILE`` reads
the same options from YAML or JSON (keys with ``-`` or ``_``); options on the command line win.

Training runs on `GRPOTrainer.train` (`grpo.training.loop`): what the command adds to each step's
record (the reward functions' counters, ``completion/*``, ``throughput/tokens_per_s``, ``lr``) and
its checkpoints are callbacks; its outputs are metric sinks (`grpo.metrics.sinks`).

Writes ``<output-dir>/checkpoint-{step}/`` every ``--save-steps`` steps and
``<output-dir>/final_model/``: weights in safetensors plus the tokenizer, loadable with
``AutoModelForCausalLM.from_pretrained`` (full fine-tuning) or ``PeftModel.from_pretrained``
(``--lora``), and ``trainer_state.json`` (step, options, last metrics). Metrics go to
``<output-dir>/metrics.jsonl`` (appended, one `JSONLSink` line per logged step; non-finite values
as ``NaN`` / ``Infinity``), to the ``grpo.llm`` logger and to W&B with ``--use-wandb``, every
``--logging-steps`` steps and at the last step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from grpo.config import GRPOConfig
from grpo.engine.distributed import get_world_size, is_main_process, main_process_only, rank_batches, shutdown
from grpo.llm._deps import require
from grpo.llm.data import PromptDataset
from grpo.llm.policy import CausalLMPolicy
from grpo.llm.rewards import (
    Extractor,
    RewardFn,
    RewardFunctions,
    after_marker,
    boxed_answer,
    exact_match_reward,
    format_reward,
    last_number,
    overlong_penalty,
    tag_content,
)
from grpo.metrics.sinks import JSONLSink, LoggingSink, PeriodicSink, WandbSink
from grpo.trainer import GRPOTrainer
from grpo.training.callbacks import Callback, TrainState

__all__ = ["build_parser", "main", "parse_args", "train"]

logger = logging.getLogger("grpo.llm")


def build_parser() -> argparse.ArgumentParser:
    """The ``grpo-train`` argument parser (every option has help text and a default)."""
    p = argparse.ArgumentParser(
        prog="grpo-train",
        description="GRPO fine-tuning of a Hugging Face causal LM on a prompt dataset.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML or JSON file with any of these options (CLI wins).")
    _add_model_and_data_options(p)
    _add_lora_options(p)
    _add_generation_options(p)
    _add_training_options(p)
    _add_reward_options(p)
    _add_output_options(p)
    return p


def _add_model_and_data_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model-name", default=None, help="HF model name or local path (required).")
    g.add_argument(
        "--dataset", default=None, help="Prompts: .jsonl/.json file or a datasets.save_to_disk dir."
    )
    g.add_argument("--prompt-column", default="prompt", help="Column holding the prompt.")
    g.add_argument("--answer-column", default="answer", help="Column with the reference answer.")
    g.add_argument("--system-prompt", default=None, help="System message for chat-template prompts.")
    g.add_argument(
        "--use-chat-template",
        choices=["auto", "yes", "no"],
        default="auto",
        help="auto: chat prompts use the template, strings are raw; yes: wrap strings too.",
    )
    g.add_argument("--max-prompt-length", type=int, default=None, help="Keep the last N prompt tokens.")
    g.add_argument("--bf16", action="store_true", help="Load the model weights in bfloat16.")
    g.add_argument("--no-autocast", action="store_true", help="Disable bf16 autocast on CUDA.")
    g.add_argument("--gradient-checkpointing", action="store_true", help="Recompute activations in backward.")
    g.add_argument("--logprob-chunk-size", type=int, default=512, help="Tokens per LM-head chunk (0 = full).")


def _add_lora_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (PEFT)")
    g.add_argument(
        "--lora", action="store_true", help="Train a LoRA adapter; the reference is the base model."
    )
    g.add_argument("--lora-r", type=int, default=16, help="LoRA rank.")
    g.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha.")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout.")
    g.add_argument("--lora-target-modules", default="all-linear", help="Comma-separated module names.")


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--num-generations", type=int, default=4, help="G: completions per prompt.")
    g.add_argument("--max-new-tokens", type=int, default=256, help="Completion length limit.")
    g.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature (log-probs use it).")
    g.add_argument("--top-k", type=int, default=50, help="Top-k sampling (0 = off).")
    g.add_argument("--top-p", type=float, default=0.9, help="Nucleus sampling (1 = off).")
    g.add_argument("--min-p", type=float, default=0.0, help="Min-p sampling (0 = off).")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="Repetition penalty (1 = off).")


def _add_training_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=int, default=4, help="B: prompts per step.")
    g.add_argument("--num-epochs", type=int, default=1, help="Passes over the dataset.")
    g.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="Train this many steps, cycling the dataset as often as needed (overrides --num-epochs).",
    )
    g.add_argument("--learning-rate", type=float, default=1e-6, help="AdamW learning rate.")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay.")
    g.add_argument(
        "--kl-coef", type=float, default=0.04, help="beta: KL(pi || pi_ref) weight; 0 = no reference."
    )
    g.add_argument("--clip-range", type=float, default=0.2, help="eps: PPO ratio clip range.")
    g.add_argument("--clip-range-high", type=float, default=None, help="Upper clip eps (DAPO clip-higher).")
    g.add_argument("--num-iterations", type=int, default=1, help="mu: optimisation epochs per batch.")
    g.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="Split each step's prompts into this many forward/backward passes (must divide batch size).",
    )
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="Gradient-norm clip.")
    g.add_argument("--warmup-steps", type=int, default=0, help="Linear LR warmup over this many steps.")
    g.add_argument("--seed", type=int, default=0, help="Random seed.")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto.")


def _add_reward_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rewards")
    g.add_argument(
        "--reward",
        action="append",
        default=None,
        help="NAME[=WEIGHT], repeatable. NAME: exact_match, format, overlong, or module:function / "
        "path.py:function (f(prompts, completions, **columns) -> list[float|None]). "
        "Default: exact_match.",
    )
    g.add_argument(
        "--answer-extractor",
        default="last_number",
        help="exact_match extractor: last_number, boxed, after:MARKER (e.g. after:####), tag:NAME.",
    )
    g.add_argument("--format-pattern", default=None, help="Regex for the format reward.")
    g.add_argument("--format-tags", default="think,answer", help="Tags for the format reward.")
    g.add_argument("--overlong-cache", type=int, default=None, help="Soft over-length zone (tokens).")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output and logging")
    g.add_argument("--output-dir", default="./grpo_checkpoints", help="Where checkpoints go.")
    g.add_argument("--logging-steps", type=int, default=10, help="Log metrics every N steps.")
    g.add_argument("--save-steps", type=int, default=500, help="Save checkpoint-{step}/ every N steps.")
    g.add_argument("--no-progress", action="store_true", help="No progress bar.")
    g.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases.")
    g.add_argument("--wandb-project", default="grpo", help="W&B project.")
    g.add_argument("--wandb-run-name", default=None, help="W&B run name.")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Options from a YAML (.yaml/.yml) or JSON file, keys normalised to argparse dest names."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    data = require("yaml").safe_load(text) if p.suffix in (".yaml", ".yml") else json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of options, got {type(data).__name__}.")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; values from ``--config`` become defaults the command line overrides."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config is not None:
        values = load_config_file(pre.config)
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SystemExit(
                f"grpo-train: error: unknown option(s) {unknown} in {pre.config}; valid keys: "
                f"{sorted(known - {'help', 'config'})}"
            )
        if isinstance(values.get("reward"), str):
            values["reward"] = [values["reward"]]
        parser.set_defaults(**values)
    args = parser.parse_args(argv)
    if not args.model_name:
        parser.error("--model-name is required (on the command line or in --config).")
    if not args.dataset:
        parser.error("--dataset is required (a .jsonl/.json file or a datasets.save_to_disk directory).")
    if args.logging_steps < 1:
        parser.error(f"--logging-steps={args.logging_steps} must be >= 1.")
    if args.batch_size % args.gradient_accumulation_steps:
        parser.error(
            f"--gradient-accumulation-steps={args.gradient_accumulation_steps} must divide "
            f"--batch-size={args.batch_size}; each pass takes batch_size / steps prompts."
        )
    return args


def _extractor(spec: str) -> Extractor:
    if spec == "last_number":
        return last_number
    if spec == "boxed":
        return boxed_answer
    if spec.startswith("after:"):
        return after_marker(spec[len("after:") :])
    if spec.startswith("tag:"):
        return tag_content(spec[len("tag:") :])
    raise SystemExit(
        f"grpo-train: error: unknown --answer-extractor {spec!r}; use last_number, boxed, after:M, tag:T"
    )


def _load_callable(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py"):
        s = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if s is None or s.loader is None:
            raise SystemExit(f"grpo-train: error: cannot load reward file {module_name!r}")
        module = importlib.util.module_from_spec(s)
        s.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SystemExit(f"grpo-train: error: {spec!r}: {module_name} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def build_rewards(args: argparse.Namespace) -> RewardFunctions:
    """The `RewardFunctions` named by ``--reward`` (default: exact_match)."""
    fns: dict[str, RewardFn] = {}
    weights: dict[str, float] = {}
    for spec in args.reward or ["exact_match"]:
        name, weight = spec, 1.0
        head, sep, tail = spec.rpartition("=")
        if sep:
            try:
                name, weight = head, float(tail)
            except ValueError:
                name = spec
        if name == "exact_match":
            fn = exact_match_reward(args.answer_column, _extractor(args.answer_extractor))
        elif name == "format":
            fn = format_reward(args.format_pattern, tags=[t for t in args.format_tags.split(",") if t])
        elif name == "overlong":
            cache = args.overlong_cache or max(1, args.max_new_tokens // 4)
            fn = overlong_penalty(args.max_new_tokens, cache)
        elif ":" in name:
            fn = _load_callable(name)
            name = name.rpartition(":")[2]
        else:
            raise SystemExit(
                f"grpo-train: error: unknown --reward {name!r}; use exact_match, format, overlong or "
                "module:function"
            )
        fns[name] = fn
        weights[name] = weight
    return RewardFunctions(fns, weights)


def _save(
    policy: CausalLMPolicy, directory: Path, step: int, args: argparse.Namespace, metrics: dict[str, float]
) -> None:
    """Rank 0 writes the model and ``trainer_state.json``; every rank calls this and returns when
    the files are complete. Under ZeRO-3 every rank takes part in gathering the weights."""

    def write_state() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "args": vars(args), "metrics": metrics}
        text = json.dumps(state, indent=2, default=str)
        (directory / "trainer_state.json").write_text(text, encoding="utf-8")

    def write_all() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        policy.save_pretrained(str(directory))
        write_state()

    if policy.is_partitioned:
        policy.save_pretrained(str(directory))  # collective gather; rank 0 writes
        main_process_only(write_state, None)
    else:
        main_process_only(write_all, None)


class _StepMetrics(Callback):
    """What ``grpo-train`` adds to each step's record (`on_metrics`, before the sinks): the reward
    functions' ``last_metrics``, ``completion/tokens``, ``completion/mean_length``,
    ``throughput/tokens_per_s`` and ``lr`` (the learning rate after the step). `batches` wraps the
    source of batches to know each step's number of prompts."""

    def __init__(self, policy: CausalLMPolicy, rewards: RewardFunctions, group_size: int) -> None:
        self.policy = policy
        self.rewards = rewards
        self.group_size = group_size
        self.num_prompts = 0

    def batches(self, source: Iterable[list[Any]]) -> Iterator[list[Any]]:
        for batch in source:
            self.num_prompts = len(batch)
            yield batch

    def on_metrics(self, state: TrainState, metrics: dict[str, float]) -> None:
        metrics.update(self.rewards.last_metrics)
        tokens = float(self.policy.last_generation.get("completion_tokens", 0.0))
        metrics["completion/tokens"] = tokens
        metrics["completion/mean_length"] = tokens / max(self.num_prompts * self.group_size, 1)
        metrics["throughput/tokens_per_s"] = tokens / max(metrics["time/step"], 1e-9)
        optimizer = state.trainer.optimizer
        metrics["lr"] = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 0.0


class _SaveCheckpoints(Callback):
    """``<output-dir>/checkpoint-{step}/`` every ``--save-steps`` steps (0 = never). Runs on every
    process: `_save` is collective under DeepSpeed ZeRO-3, and rank 0 writes."""

    def __init__(self, policy: CausalLMPolicy, out_dir: Path, args: argparse.Namespace) -> None:
        self.policy = policy
        self.out_dir = out_dir
        self.args = args

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        every = self.args.save_steps
        if every and state.step % every == 0:
            path = self.out_dir / f"checkpoint-{state.step}"
            _save(self.policy, path, state.step, self.args, dict(metrics))


def _sinks(args: argparse.Namespace, out_dir: Path, stack: contextlib.ExitStack) -> list[PeriodicSink]:
    """Rank 0's sinks, each writing every ``--logging-steps`` steps and at the last step:
    ``metrics.jsonl`` (appended), a ``grpo.llm`` log line, and W&B with ``--use-wandb``. Closed
    (the W&B run finished) when ``stack`` exits."""
    jsonl = JSONLSink(out_dir / "metrics.jsonl", append=True)
    stack.callback(jsonl.close)
    inner: list[Any] = [jsonl, LoggingSink(logger, keys=("reward/mean", "kl/ref", "throughput/tokens_per_s"))]
    if args.use_wandb:
        try:
            wandb = WandbSink(project=args.wandb_project, name=args.wandb_run_name, config=vars(args))
        except ImportError as e:
            raise ImportError(f"--use-wandb needs Weights & Biases: {e}") from e
        stack.callback(wandb.close)
        inner.append(wandb)
    sinks = [PeriodicSink(s, args.logging_steps) for s in inner]
    for sink in sinks:
        stack.callback(sink.flush)  # a held record is written before its sink closes (LIFO)
    return sinks


def train(args: argparse.Namespace) -> dict[str, float]:
    """Run the training described by ``args``; return the last step's metrics."""
    transformers = require("transformers")
    dataset = PromptDataset.load(args.dataset, prompt_column=args.prompt_column)
    policy = _build_policy(args, *_load_model(args, transformers))
    rewards = build_rewards(args)
    config = _build_config(args)
    reference = policy.reference_policy() if args.kl_coef > 0 else None
    trainer = GRPOTrainer(config, policy, rewards, reference_policy=reference)
    plan = _plan_steps(args, dataset)
    out_dir = Path(args.output_dir)
    if plan.main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    logger.info(
        "%d prompts, %d a step: %d steps (%d epoch%s of %d steps%s)", len(dataset), plan.global_batch,
        plan.total, plan.epochs, "s" if plan.epochs > 1 else "", plan.per_epoch,
        "; --max-steps cycles the data" if args.max_steps is not None and plan.epochs > 1 else "",
    )  # fmt: skip
    step_metrics = _StepMetrics(policy, rewards, args.num_generations)
    # each global batch from the prompt list, cut into this rank's share (identity on one
    # process); train() takes this generator as an iterator of per-rank batches, used as is
    batches = step_metrics.batches(
        rank_batches(
            dataset.records,
            dataset.batches(plan.global_batch, seed=args.seed, epochs=plan.epochs, drop_last=plan.drop_last),
        )
    )
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sinks = _sinks(args, out_dir, stack) if plan.main_process else []
        state = trainer.train(
            batches,
            num_steps=plan.total,
            callbacks=[step_metrics, _SaveCheckpoints(policy, out_dir, args)],
            sinks=sinks,
            progress=False if args.no_progress else "bar",
        )
        metrics = state.history[-1] if state.history else {}
        final = out_dir / "final_model"
        _save(policy, final, trainer.step_count, args, metrics)
    trainer.close()  # DeepSpeed's engines and groups are freed now, not at interpreter exit
    logger.info(
        "done: %d steps in %.1f s; final model in %s",
        trainer.step_count,
        time.perf_counter() - t_start,
        final,
    )
    return metrics


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
        torch.manual_seed(args.seed)  # the adapter's random init (LoRA A) follows --seed
        model = peft.get_peft_model(model, lora_cfg)
    return model, tokenizer


def _build_policy(args: argparse.Namespace, model: Any, tokenizer: Any) -> CausalLMPolicy:
    """The `CausalLMPolicy` with the generation and log-prob options of ``args``."""
    chat = {"auto": None, "yes": True, "no": False}[args.use_chat_template]
    return CausalLMPolicy(
        model,
        tokenizer,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        use_chat_template=chat,
        system_prompt=args.system_prompt,
        max_prompt_length=args.max_prompt_length,
        logprob_chunk_size=args.logprob_chunk_size or None,
        gradient_checkpointing=args.gradient_checkpointing,
        autocast=not args.no_autocast,
    )


def _build_config(args: argparse.Namespace) -> GRPOConfig:
    """The `GRPOConfig` of the command's training options."""
    return GRPOConfig(
        group_size=args.num_generations,
        batch_size=args.batch_size,
        micro_batch_size=args.batch_size // args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        num_epochs_per_update=args.num_iterations,
        clip_epsilon=args.clip_range,
        clip_epsilon_high=args.clip_range_high,
        kl_coeff=args.kl_coef,
        max_grad_norm=args.max_grad_norm,
        warmup_steps=max(0, args.warmup_steps) * args.num_iterations,  # GRPO steps -> optimizer steps
        device=args.device,
        seed=args.seed,
    )


class _StepPlan(NamedTuple):
    main_process: bool
    global_batch: int  # prompts per step over all processes
    drop_last: bool
    per_epoch: int  # steps per pass over the dataset
    epochs: int
    total: int  # steps to train


def _plan_steps(args: argparse.Namespace, dataset: PromptDataset) -> _StepPlan:
    """How many steps of how many prompts, over how many passes of the dataset.

    Under torchrun / accelerate launch each step draws a global batch of world * batch_size
    prompts (the same order on every rank: same seed) and each rank takes its shard; only full
    global batches are used, so every rank takes the same number of steps.
    """
    world = get_world_size()
    main_proc = is_main_process()
    global_batch = args.batch_size * world
    drop_last = world > 1
    per_epoch = dataset.num_batches(global_batch, 1, drop_last=drop_last)
    epochs = args.num_epochs if args.max_steps is None else max(1, -(-args.max_steps // max(per_epoch, 1)))
    total = per_epoch * epochs
    if per_epoch == 0:
        raise ValueError(
            f"{len(dataset)} prompts do not fill one global batch of {global_batch} "
            f"(--batch-size={args.batch_size} x {world} processes); use more prompts or a smaller "
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
    metrics = train(args)
    shutdown()  # every rank done, then the process group is destroyed (no-op on one process)
    if is_main_process():  # the result on stdout (one JSON line); the log went to stderr
        final = str(Path(args.output_dir) / "final_model")
        sys.stdout.write(json.dumps({"final_model": final, **metrics}) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
