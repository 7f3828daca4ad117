"""``grpo-train`` (and ``python -m grpo.llm``): GRPO fine-tuning of a Hugging Face causal LM.

    grpo-train --model-name Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl \
        --reward exact_match=1.0 --reward format=0.2 --num-generations 8 --output-dir out
    grpo-train --config run.yaml --recipe dapo --resume          # a preset, continued exactly

Every option is a dataclass field, declared once, with its help text in the field's metadata
(`grpo.runtime.dataclass_args`): every `GRPOConfig` field (``--kl-coeff``, ``--policy-loss``,
``--fsdp``, ``--deepspeed``, ... a field added to `GRPOConfig` appears here by itself) and the
command's own options below (`ModelOptions`, `DataOptions`, `GenerationOptions`,
`RewardOptions`, `RunOptions`, `OutputOptions`, `EvaluationOptions`, `EnvironmentOptions`) and
the fields of `grpo.training.evaluation.EvalOptions` as ``--eval-*`` (``--eval-group-size``, ``--eval-ks``,
...). Seed 003's flags are spellings of the same options (`SEED_FLAGS`: ``--num-generations`` =
``--group-size``, ``--kl-coef`` = ``--kl-coeff``, ...), and ``--recipe NAME`` = ``--recipe-name``.
``--config FILE`` reads any of them from YAML or JSON (keys with ``-`` or ``_``; seed 001's
``adv_norm`` and ``use_kl_advantage_shaping`` too, `grpo.config.translate_seed_keywords`); a key
that is no option is refused with the name it probably meant. Precedence: `GRPOConfig` defaults
< this command's defaults (`CONFIG_DEFAULTS`) < the recipe < the config file < the command line.

Multi-turn episodes: ``--env module:factory`` (or ``path.py:factory``; ``factory(num_envs) ->
grpo.envs.TextEnvironment``) trains a `grpo.llm.multiturn.MultiTurnPolicy` around the causal LM
(``--max-turns``, ``--max-total-tokens``; ``--max-new-tokens`` per turn) on the environment's
`ConversationReward` (``--per-turn-credit``: turn-level credit discounted by ``--gamma``); the
states are start states, ``--dataset`` rows (`load_starts`) or the seeds ``0 .. --num-starts - 1``,
dealt and resumed like prompts. ``--reward`` and the other single-turn scoring options are
refused with ``--env`` (the environment scores the episodes), as is ``--eval-dataset``.

Training runs on `GRPOTrainer.train` (`grpo.training.loop`): ``step()`` reports the completion
lengths (``completion/*``) and ``optim/lr``; what the command adds to each step's record (the
reward functions' counters, ``throughput/tokens_per_s``), its model saves and the completions
table (``--log-completions-every``) are callbacks; its outputs are metric sinks
(`grpo.metrics.sinks`). With ``--eval-dataset`` and ``--eval-every N`` the run evaluates every N
steps (`grpo.training.evaluation.evaluate`: ``eval/reward/*``, ``eval/pass@k``, ``eval/maj@k``),
and those steps' records reach every sink whatever ``--logging-steps`` is.

Output, in ``<output-dir>``: ``checkpoint-{step}/`` every ``--save-steps`` steps and
``final_model/`` (`grpo.llm.checkpoint.save_llm_checkpoint`): the weights in safetensors plus
the tokenizer, loadable with ``AutoModelForCausalLM.from_pretrained`` (full fine-tuning) or
``PeftModel.from_pretrained`` (``--lora``: the adapter only), and ``trainer_state.json`` (step,
options, last metrics); ``completions.jsonl`` with ``--log-completions-every``; ``checkpoints/step-N/``
at the same steps and at the end: the trainer's checkpoint (weights, optimizer and LR-schedule
state, RNG streams, the data position; `grpo.state.checkpoint`), which ``--resume`` continues
bitwise as the uninterrupted run. Metrics go to ``metrics.jsonl`` (appended, one `JSONLSink` line
per logged step; a resumed run drops the lines after its checkpoint), to the ``grpo.llm`` logger
and to W&B with ``--use-wandb``, every ``--logging-steps`` steps and at the last step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import logging
import re
import sys
import time
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from grpo.algorithms.recipes import RECIPES, recipe_values
from grpo.config import GRPOConfig, suggest_fields, translate_seed_keywords
from grpo.engine.deepspeed import deepspeed_config_from
from grpo.engine.distributed import get_world_size, is_main_process, main_process_only, rank_batches, shutdown
from grpo.envs.protocol import TextEnvironment
from grpo.generation.worker import GenerationWorkerError
from grpo.llm._deps import require
from grpo.llm.checkpoint import save_llm_checkpoint
from grpo.llm.code_rewards import code_tests_reward
from grpo.llm.data import PromptBatches, PromptDataset
from grpo.llm.multiturn import ConversationReward, MultiTurnPolicy
from grpo.llm.policy import CausalLMPolicy
from grpo.llm.rewards import (
    Convention,
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
from grpo.runtime.dataclass_args import DataclassArgumentParser, ParsedValues
from grpo.state.checkpoint import find_latest_checkpoint
from grpo.trainer import GRPOTrainer
from grpo.training.callbacks import Callback, TrainState
from grpo.training.completions_table import CompletionsTable
from grpo.training.evaluation import EvalOptions

__all__ = [
    "CONFIG_DEFAULTS",
    "EVAL_PREFIX",
    "SEED_FLAGS",
    "CLIArgs",
    "DataOptions",
    "EnvironmentOptions",
    "EvaluationOptions",
    "GenerationOptions",
    "ModelOptions",
    "OutputOptions",
    "RewardOptions",
    "RunOptions",
    "build_config",
    "build_eval_options",
    "build_parser",
    "build_rewards",
    "load_starts",
    "main",
    "parse_args",
    "train",
]

logger = logging.getLogger("grpo.llm")


def _opt(default: Any, text: str, **more: Any) -> Any:
    """A dataclass field with its help text (and ``const``: the value when the flag is alone)."""
    return field(default=default, metadata={"help": text, **more})


@dataclass
class RunOptions:
    """How long to train, how the batch is split, and where to resume."""

    num_epochs: int = _opt(1, "Passes over the dataset.")
    max_steps: int | None = _opt(
        None, "Train this many steps, cycling the dataset as often as needed (replaces the epochs)."
    )
    gradient_accumulation_steps: int = _opt(
        1,
        "Split each optimizer step's prompts into this many forward/backward passes (sets "
        "micro_batch_size = mini-batch / this; must divide the mini-batch). The update is the same.",
    )
    resume: str | None = _opt(
        None,
        "Continue a run exactly from a trainer checkpoint: 'latest' (also the flag alone) = the "
        "newest under <output-dir>/checkpoints; or a checkpoint directory (a step-N directory, "
        "their root, or <output-dir>/checkpoint-N). Give the same options as the run that saved it.",
        const="latest",
        metavar="DIR|latest",
    )


@dataclass
class ModelOptions:
    """The model, its precision and memory settings, and the LoRA adapter."""

    model_name: str | None = _opt(None, "HF model name or local path (required).", metavar="NAME")
    bf16: bool = _opt(False, "Load the model weights in bfloat16.")
    autocast: bool = _opt(True, "bf16 autocast on CUDA.")
    gradient_checkpointing: bool = _opt(False, "Recompute activations in backward.")
    logprob_chunk_size: int = _opt(512, "Tokens per LM-head chunk (0 = the full logits at once).")
    lora: bool = _opt(False, "Train a LoRA adapter; the reference is the base model (adapter disabled).")
    lora_r: int = _opt(16, "LoRA rank.")
    lora_alpha: int = _opt(32, "LoRA alpha.")
    lora_dropout: float = _opt(0.0, "LoRA dropout.")
    lora_target_modules: str = _opt("all-linear", "Comma-separated module names, or all-linear.")
    use_separate_reference_adapter: bool = _opt(
        False,
        "LoRA with a KL term: keep a frozen copy of the starting adapter as the reference instead "
        "of the disabled adapter (for a model loaded with an adapter already trained).",
    )


@dataclass
class DataOptions:
    """The prompts and how they become model inputs."""

    dataset: str | None = _opt(
        None,
        "Prompts: a .jsonl/.json/.parquet/.csv file or a datasets.save_to_disk directory (required).",
        metavar="PATH",
    )
    prompt_column: str = _opt("prompt", "Column holding the prompt.")
    answer_column: str = _opt("answer", "Column with the reference answer.")
    system_prompt: str | None = _opt(None, "System message for chat-template prompts.")
    use_chat_template: Literal["auto", "yes", "no"] = _opt(
        "auto", "auto: chat prompts use the template, strings are raw; yes: wrap strings too."
    )
    max_prompt_length: int | None = _opt(None, "Keep the last N prompt tokens.")


@dataclass
class GenerationOptions:
    """Sampling of the completions (the log-probs use the same temperature)."""

    max_new_tokens: int = _opt(256, "Completion length limit (tokens).")
    min_new_tokens: int = _opt(0, "No end-of-sequence before this many tokens.")
    max_model_len: int | None = _opt(None, "Context window: prompt + completion tokens <= this.")
    temperature: float = _opt(0.7, "Sampling temperature (log-probs use it).")
    top_k: int = _opt(50, "Top-k sampling (0 = off).")
    top_p: float = _opt(0.9, "Nucleus sampling (1 = off).")
    min_p: float = _opt(0.0, "Min-p sampling (0 = off).")
    repetition_penalty: float = _opt(1.0, "Repetition penalty (1 = off).")
    generation_batch_size: int | None = _opt(
        None, "Completions per generate call (a multiple of the group size); none = all at once."
    )
    decoding: Literal["auto", "generate"] = _opt(
        "auto",
        "auto: a plain KV-cache sampling loop when only the temperature and min-new-tokens shape "
        "sampling (the tokens generate would draw, faster); generate: always Hugging Face generate.",
    )


@dataclass
class RewardOptions:
    """The reward functions."""

    reward: list[str] | None = field(
        default=None,
        metadata={
            "help": "NAME[=WEIGHT], one or more, repeatable. NAME: exact_match, format, overlong, "
            "code_tests (the completion's program run against --tests-column in the sandbox: the share "
            "of tests passed; needs bubblewrap), or "
            "module:function / path.py:function, a function written for grpo (f(prompts, completions, "
            "**columns)) or for TRL (f(completions, **kwargs), f(completions, solution, **kwargs), "
            "keyword-only parameters: prompts=, completions= (chat: message lists), completion_ids=, "
            "the dataset's columns as keywords, trainer_state=); see --reward-convention. "
            "none = exact_match."
        },
    )
    reward_convention: Convention = field(
        default="auto",
        metadata={
            "help": "How module:function rewards are called: auto (read from each signature), grpo "
            "(f(prompts, completions, **columns), completions as text) or trl (keywords; a chat "
            "prompt's completion as [{'role': 'assistant', 'content': text}])."
        },
    )
    answer_extractor: str = _opt(
        "last_number", "exact_match extractor: last_number, boxed, after:MARKER (e.g. after:####), tag:NAME."
    )
    format_pattern: str | None = _opt(None, "Regex for the format reward.")
    format_tags: str = _opt("think,answer", "Tags for the format reward.")
    overlong_cache: int | None = _opt(None, "Soft over-length zone (tokens); none = a quarter of the limit.")
    tests_column: str = _opt(
        "tests",
        "code_tests: the column with each prompt's tests, a list of assert statements or of "
        "{'input', 'output'} stdin/stdout pairs (grpo.llm.code_rewards).",
    )


@dataclass
class EnvironmentOptions:
    """Multi-turn episodes against a text environment (`grpo.llm.multiturn`): with ``--env`` the
    policy plays whole conversations and the states are the environment's start states."""

    env: str | None = _opt(
        None,
        "Train on multi-turn episodes: module:factory or path.py:factory, factory(num_envs) -> a "
        "grpo.envs.TextEnvironment (e.g. TextEnv(GuessingGame, num_envs)). The states are start "
        "states: --dataset rows (their --start-column, else the whole row) or the seeds "
        "0..--num-starts-1; the reward is the environment's (no --reward); --max-new-tokens is "
        "per turn.",
        metavar="SPEC",
    )
    max_turns: int = _opt(8, "With --env: turns per episode at most (then truncated).")
    max_total_tokens: int = _opt(
        1024, "With --env: tokens after the first prompt (the model's and the environment's) at most."
    )
    per_turn_credit: bool = _opt(
        False,
        "With --env: turn-level credit (each turn's tokens get the discounted return-to-go of its "
        "turn's rewards, discount --gamma per turn) instead of the cumulative episode reward.",
    )
    num_starts: int | None = _opt(
        None, "With --env and no --dataset: the start states are the integer seeds 0..N-1."
    )
    start_column: str = _opt("start", "With --env and --dataset: the column holding each row's start state.")


#: The name prefix of `EvalOptions`' options: ``--eval-group-size``, ``--eval-ks``, ...
EVAL_PREFIX = "eval_"


@dataclass
class EvaluationOptions:
    """What to evaluate on and when; how (group size, temperature, pass@k, ...) are the fields of
    `grpo.training.evaluation.EvalOptions`, added as ``--eval-<field>``. ``eval_answer`` is
    `EvalOptions.answer` given by name."""

    eval_dataset: str | None = _opt(
        None,
        "Held-out prompts, read like --dataset (same --prompt-column); needs --eval-every.",
        metavar="PATH",
    )
    eval_every: int | None = _opt(
        None,
        "Evaluate on --eval-dataset every N steps; the eval/* metrics join that step's record in "
        "every output, whatever --logging-steps is.",
    )
    eval_answer: str | None = _opt(
        None,
        "Final answer of a completion for eval/maj@k (needs --eval-ks): last_number, boxed, "
        "after:MARKER or tag:NAME, as --answer-extractor; none = no maj@k.",
    )


@dataclass
class OutputOptions:
    """Where the run writes, and what it reports."""

    output_dir: str = _opt("./grpo_checkpoints", "Where the checkpoints, final model and metrics go.")
    logging_steps: int = _opt(10, "Log metrics every N steps (and at the last step).")
    progress: bool = _opt(True, "A progress bar on stderr.")
    use_wandb: bool = _opt(False, "Log to Weights & Biases.")
    wandb_project: str = _opt("grpo", "W&B project.")
    wandb_run_name: str | None = _opt(None, "W&B run name.")
    log_completions_every: int | None = _opt(
        None,
        "Every N steps, each sample's prompt, completion, rewards and advantage to "
        "<output-dir>/completions.jsonl (and a W&B table with --use-wandb); none = never.",
    )


#: Seed 003's (and other) flags that are spellings of a GRPOConfig option, declared here only.
SEED_FLAGS: dict[str, tuple[str, ...]] = {
    "group_size": ("--num-generations",),
    "kl_coeff": ("--kl-coef",),
    "clip_epsilon": ("--clip-range",),
    "clip_epsilon_high": ("--clip-range-high",),
    "num_epochs_per_update": ("--num-iterations",),
    "checkpoint_freq": ("--save-steps",),
    "recipe_name": ("--recipe",),
    "async_staleness": ("--async",),
    "generation_engine": ("--engine",),
}

#: This command's defaults of GRPOConfig fields (an LLM run's, where GRPOConfig's suit small
#: policies); a recipe's values replace them, explicit options win over both.
CONFIG_DEFAULTS: dict[str, Any] = {
    "group_size": 4,
    "batch_size": 4,
    "learning_rate": 1e-6,
    "device": "auto",
    "seed": 0,
    "checkpoint_freq": 500,
}

_OPTION_GROUPS: tuple[tuple[str, type], ...] = (
    ("run", RunOptions),
    ("model and LoRA", ModelOptions),
    ("data", DataOptions),
    ("generation", GenerationOptions),
    ("rewards", RewardOptions),
    ("output and logging", OutputOptions),
    ("evaluation", EvaluationOptions),
    ("environment (multi-turn episodes)", EnvironmentOptions),
)
_CONFIG_TITLE = "GRPOConfig (the trainer; see grpo.config.GRPOConfig and docs/algorithms.md)"
_ALIAS_ATTRIBUTES = {flag[2:].replace("-", "_"): name for name, flags in SEED_FLAGS.items() for flag in flags}
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(GRPOConfig))


class CLIArgs(argparse.Namespace):
    """The resolved options: every field of the option dataclasses and of `GRPOConfig` (the
    recipe applied), and ``config`` (the ``--config`` path). Seed 003's names read the same
    values (``args.kl_coef`` is ``args.kl_coeff``, see `SEED_FLAGS`)."""

    def __getattr__(self, name: str) -> Any:
        target = _ALIAS_ATTRIBUTES.get(name)
        if target is None:
            raise AttributeError(f"grpo-train has no option {name!r}")
        return getattr(self, target)


def build_parser() -> DataclassArgumentParser:
    """The ``grpo-train`` parser: one option per field (help and default from the field)."""
    p = DataclassArgumentParser(
        prog="grpo-train",
        usage="grpo-train [--config FILE] [--recipe NAME] [--resume [DIR]] [OPTIONS]",
        description="GRPO fine-tuning of a Hugging Face causal LM on a prompt dataset. Bool options: "
        "--flag, --flag true|false or --no-flag; options that may be unset take 'none'.",
        hint=suggest_fields,
        translate=translate_seed_keywords,  # seed 001's adv_norm, use_kl_advantage_shaping in files
        allow_abbrev=False,  # an option is its whole name: no prefix of another knob
    )
    groups = {title: p.add_argument_group(title) for title, _ in _OPTION_GROUPS}
    config_group = p.add_argument_group(_CONFIG_TITLE)
    # GRPOConfig first: a field it shares with an option dataclass is its option (one flag)
    p.add_dataclass(
        GRPOConfig,
        group=config_group,
        aliases=SEED_FLAGS,
        defaults={k: v for k, v in CONFIG_DEFAULTS.items() if k in _CONFIG_FIELDS},
        choices={"recipe_name": [*sorted(RECIPES), None]},
    )
    for title, cls in _OPTION_GROUPS:
        p.add_dataclass(cls, group=groups[title])
    # --eval-answer (EvaluationOptions) is EvalOptions.answer by name
    p.add_dataclass(EvalOptions, group=groups["evaluation"], prefix=EVAL_PREFIX, exclude=("answer",))
    return p


def parse_args(argv: Sequence[str] | None = None) -> CLIArgs:
    """Parse ``argv`` (and its ``--config`` file), resolve the `GRPOConfig` (recipe, defaults,
    explicit options) and check everything a run needs before any model is loaded; errors exit
    with status 2 and say which option is wrong and how to fix it."""
    parser = build_parser()
    parsed = parser.parse(argv)
    v = parsed.values
    if not v.get("model_name"):
        parser.fail("--model-name is required (on the command line or in --config).")
    if not v.get("dataset") and not v.get("env"):
        parser.fail("--dataset is required (a .jsonl/.json/.parquet/.csv file or a save_to_disk dir).")
    for name in (
        "logging_steps",
        "num_epochs",
        "gradient_accumulation_steps",
        "eval_every",
        "log_completions_every",
        "max_turns",
        "max_total_tokens",
        "num_starts",
    ):
        if v[name] is not None and v[name] < 1:
            parser.fail(f"--{name.replace('_', '-')}={v[name]} must be >= 1.")
    if v["max_steps"] is not None and v["max_steps"] < 0:
        parser.fail(f"--max-steps={v['max_steps']} must be >= 0.")
    try:
        config = resolve_config(parsed)
        _extractor(v["answer_extractor"], "--answer-extractor")
        _check_evaluation(parsed, config)
        _check_environment(parsed, config)
    except (ValueError, TypeError) as e:
        parser.fail(str(e))
    args = CLIArgs(**{k: x for k, x in v.items() if k not in _CONFIG_FIELDS}, config=parsed.file)
    for k, x in config.to_dict().items():
        setattr(args, k, x)
    if config.lr_schedule != "constant" and "total_steps" not in parsed.explicit:
        args.total_steps = None  # set by train(): the run's optimizer steps
    return args


def _check_evaluation(parsed: ParsedValues, config: GRPOConfig) -> None:
    """``--eval-dataset`` and ``--eval-every`` come together, other ``--eval-*`` options only with
    them, and the `EvalOptions` fit ``config`` (each k of ``--eval-ks`` at most the evaluation's
    group size); `ValueError` naming the options otherwise."""
    v = parsed.values
    if v["eval_dataset"] is not None and v["eval_every"] is None:
        raise ValueError(
            "--eval-dataset needs --eval-every N too: evaluation needs the prompts and the period."
        )
    if v["eval_every"] is not None and v["eval_dataset"] is None:
        raise ValueError(
            "--eval-every needs --eval-dataset PATH too: evaluation needs the prompts and the period."
        )
    if v["eval_dataset"] is None:
        stray = sorted(n for n in parsed.explicit if n.startswith(EVAL_PREFIX))
        if stray:
            flags = ", ".join("--" + n.replace("_", "-") for n in stray)
            raise ValueError(f"{flags} set how to evaluate, but no --eval-dataset / --eval-every is given.")
        return
    if v["eval_answer"] is not None:
        _extractor(v["eval_answer"], "--eval-answer")
    options = build_eval_options(argparse.Namespace(**v))
    if options is not None:
        options.resolved_group_size(config)


#: Options that shape the single-turn path only: refused with ``--env`` (the environment's
#: rewards and start states replace them).
_SINGLE_TURN_ONLY = (
    *(f.name for f in dataclasses.fields(RewardOptions)),
    "prompt_column",
    "answer_column",
)
_ENV_ONLY = tuple(f.name for f in dataclasses.fields(EnvironmentOptions) if f.name != "env")


def _check_environment(parsed: ParsedValues, config: GRPOConfig) -> None:
    """Without ``--env`` no other option of `EnvironmentOptions`; with it, start states from one of
    ``--dataset`` / ``--num-starts``, no option of the single-turn rewards (the environment's
    `ConversationReward` replaces them, see `_SINGLE_TURN_ONLY`), no evaluation, the chat template
    on, no ``--min-new-tokens``, and ``--gamma`` other than 1 only with ``--per-turn-credit``.
    `ValueError` naming the options otherwise."""
    v = parsed.values
    if v["env"] is None:
        stray = sorted(n for n in parsed.explicit if n in _ENV_ONLY)
        if stray:
            raise ValueError(
                f"{_flags(stray)} set the multi-turn episodes, but no --env module:factory is given."
            )
        return
    if ":" not in v["env"]:
        raise ValueError(
            f"--env {v['env']!r}: expected module:factory or path/to/file.py:factory, where "
            f"factory(num_envs) returns a grpo.envs.TextEnvironment."
        )
    single = sorted(n for n in parsed.explicit if n in _SINGLE_TURN_ONLY)
    problems = {
        f"{_flags(single)} shape the single-turn rewards and prompts; with --env the reward is the "
        f"environment's (ConversationReward: the sum of its turn rewards, or --per-turn-credit) and "
        f"the states are its starts. Leave them out, or score inside the environment's step()": single,
        "--dataset and --num-starts both give the start states; give one": v["dataset"] and v["num_starts"],
        "--env needs start states: --dataset PATH (rows with a --start-column, else whole rows) or "
        "--num-starts N (the seeds 0..N-1)": not v["dataset"] and v["num_starts"] is None,
        "--eval-dataset is not available with --env (it evaluates prompts); leave it out and "
        "evaluate with grpo.training.evaluation.evaluate on start states": v["eval_dataset"],
        "--use-chat-template no: --env renders every turn with the tokenizer's chat template; "
        "use auto or yes": v["use_chat_template"] == "no",
        f"--min-new-tokens={v['min_new_tokens']} would ban the end-of-turn token at the start of "
        f"every turn; use 0 with --env": v["min_new_tokens"],
        f"--gamma={config.gamma} discounts turns only with --per-turn-credit (the cumulative episode "
        f"reward is the plain sum); add --per-turn-credit or leave --gamma at 1": config.gamma != 1.0
        and not v["per_turn_credit"],
    }
    for message, bad in problems.items():
        if bad:
            raise ValueError(message + ".")


def _flags(names: Sequence[str]) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


def build_eval_options(args: argparse.Namespace) -> EvalOptions | None:
    """The `EvalOptions` of the ``--eval-*`` options (``--eval-answer`` read as an extractor
    name); None without ``--eval-dataset``. `ValueError` for a value `EvalOptions` refuses."""
    if args.eval_dataset is None:
        return None
    values = {f.name: getattr(args, EVAL_PREFIX + f.name) for f in dataclasses.fields(EvalOptions) if f.init}
    spec = values.pop("answer")
    answer = None if spec is None else _extractor(spec, "--eval-answer")
    try:
        return EvalOptions(**values, answer=answer)
    except ValueError as e:
        raise ValueError(f"--eval-*: {e}") from None


def resolve_config(parsed: ParsedValues) -> GRPOConfig:
    """The `GRPOConfig` of parsed options: `CONFIG_DEFAULTS`, then the recipe (``--recipe``), then
    the explicit options. Derived here: ``micro_batch_size`` from ``--gradient-accumulation-steps``,
    ``loss_normaliser`` = ``--max-new-tokens`` for Dr. GRPO's aggregation when unset, and a
    stand-in ``total_steps`` for a decaying schedule (train() sets the run's own). With ``--env``
    the normaliser is ``--max-total-tokens`` (an episode's tokens)."""
    explicit = parsed.for_dataclass(GRPOConfig, explicit_only=True)
    if explicit.get("checkpoint_freq") == 0:
        explicit["checkpoint_freq"] = None  # --save-steps 0: never (as before)
    name = explicit.pop("recipe_name", None)
    recipe = recipe_values(name) if name is not None else {}
    values = {**{k: d for k, d in CONFIG_DEFAULTS.items() if k not in recipe}, **explicit}
    field_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    effective = {**field_defaults, **recipe, **values}
    if effective["loss_aggregation"] == "seq-mean-token-sum-norm" and effective["loss_normaliser"] is None:
        budget = "max_total_tokens" if parsed.values["env"] else "max_new_tokens"  # an episode's bound
        values["loss_normaliser"] = float(parsed.values[budget])
    if effective["lr_schedule"] != "constant" and effective["total_steps"] is None:
        values["total_steps"] = effective["warmup_steps"] + 1  # checked again with the real count
    gas = parsed.values["gradient_accumulation_steps"]
    if gas != 1 and "micro_batch_size" in explicit:
        raise ValueError("--gradient-accumulation-steps and --micro-batch-size set the same thing; give one.")
    try:
        config = GRPOConfig.recipe(name, **values) if name is not None else GRPOConfig(**values)
    except ValueError as e:
        if not recipe:
            raise
        from_recipe = ", ".join(f"{k}={x!r}" for k, x in recipe.items() if k not in explicit)
        raise ValueError(f"{e} (--recipe {name} set {from_recipe}; an option given here wins.)") from None
    if gas == 1:
        return config
    mini = config.resolved_mini_batch_size
    if mini % gas:
        raise ValueError(
            f"--gradient-accumulation-steps={gas} must divide the prompts of each optimizer step "
            f"(the mini-batch, {mini} of --batch-size={config.batch_size}); each pass takes mini-batch "
            f"/ steps prompts. Valid: {[d for d in range(1, mini + 1) if mini % d == 0]}."
        )
    return dataclasses.replace(config, micro_batch_size=mini // gas)


def build_config(args: argparse.Namespace, total_steps: int | None = None) -> GRPOConfig:
    """The `GRPOConfig` of resolved ``args`` (`parse_args`); ``total_steps`` fills an unset one."""
    values = {k: getattr(args, k) for k in _CONFIG_FIELDS}
    if values["total_steps"] is None and values["lr_schedule"] != "constant":
        values["total_steps"] = total_steps
    return GRPOConfig(**values)


# ---- rewards ---------------------------------------------------------------------------------------
def _extractor(spec: str, flag: str = "--answer-extractor") -> Extractor:
    """The extractor named ``spec`` (last_number, boxed, after:MARKER, tag:NAME); `ValueError`
    naming ``flag`` otherwise."""
    if spec == "last_number":
        return last_number
    if spec == "boxed":
        return boxed_answer
    if spec.startswith("after:") and len(spec) > len("after:"):
        return after_marker(spec[len("after:") :])
    if spec.startswith("tag:") and len(spec) > len("tag:"):
        return tag_content(spec[len("tag:") :])
    raise ValueError(
        f"unknown {flag} {spec!r}; use last_number, boxed, after:MARKER (e.g. after:####) or tag:NAME "
        f"(e.g. tag:answer)."
    )


def _load_callable(spec: str, flag: str = "--reward") -> Callable[..., Any]:
    """The callable ``attr`` of ``module:attr`` or ``path/to/file.py:attr`` (``flag`` names the
    option in the error)."""
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py"):
        s = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
        if s is None or s.loader is None:
            raise SystemExit(f"grpo-train: error: {flag}: cannot load the file {module_name!r}")
        module = importlib.util.module_from_spec(s)
        s.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SystemExit(f"grpo-train: error: {flag} {spec!r}: {module_name} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def build_rewards(args: argparse.Namespace) -> RewardFunctions:
    """The `RewardFunctions` named by ``--reward`` (default: exact_match); the module:function
    ones are called in ``--reward-convention`` (the ready rewards in their own, grpo's)."""
    fns: dict[str, RewardFn] = {}
    weights: dict[str, float] = {}
    conventions: dict[str, Convention] = {}
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
        elif name == "code_tests":
            fn = code_tests_reward(args.tests_column)
        elif ":" in name:
            fn = _load_callable(name)
            name = name.rpartition(":")[2]
            conventions[name] = args.reward_convention
        else:
            raise SystemExit(
                f"grpo-train: error: unknown --reward {name!r}; use exact_match, format, overlong, "
                "code_tests or module:function"
            )
        fns[name] = fn
        weights[name] = weight
    return _StepRewards(fns, weights, convention=conventions)


class _StepRewards(RewardFunctions):
    """`RewardFunctions` that keep the counters (``last_metrics``) of each call under the step
    count of ``trainer`` at the call: a training step's rewards are computed before its count goes
    up, an evaluation after step k at count k, so `step_counters` gives step k's own counters
    though the evaluation that follows it replaced ``last_metrics``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trainer: Any = None  # set by _StepMetrics when training starts
        self.counters: dict[int, dict[str, float]] = {}  # step count at the call -> its counters

    def compute_reward_components(
        self, states: Sequence[Any], actions: Sequence[Any]
    ) -> dict[str, list[float]]:
        out = super().compute_reward_components(states, actions)
        if self.trainer is not None:
            count = int(self.trainer.step_count)
            self.counters = {k: v for k, v in self.counters.items() if k >= count - 1}
            self.counters[count] = self.last_metrics
        return out

    def step_counters(self, step: int) -> dict[str, float]:
        """The counters of the call made for step ``step`` (the count after it), none if no call."""
        return self.counters.get(step - 1, {})


# ---- saving, metrics, data -------------------------------------------------------------------------
def _save(trainer: GRPOTrainer, directory: Path, args: argparse.Namespace, metrics: dict[str, float]) -> None:
    """The model (`save_llm_checkpoint`: the LoRA adapter only, or the whole model; the tokenizer)
    and ``trainer_state.json``, written by rank 0; every rank calls this and returns when the files
    are complete. Under ZeRO-3 and FSDP every rank takes part in gathering the weights. With
    ``--env`` the causal LM inside the `MultiTurnPolicy` is saved."""
    policy = trainer.policy.policy if isinstance(trainer.policy, MultiTurnPolicy) else trainer.policy
    policy = typing.cast(CausalLMPolicy, policy)  # train() built it
    target = _PolicyAtStep(policy, trainer.step_count)  # what save_llm_checkpoint reads of a trainer

    def write_state() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = {"step": trainer.step_count, "args": vars(args), "metrics": metrics}
        text = json.dumps(state, indent=2, default=str)
        (directory / "trainer_state.json").write_text(text, encoding="utf-8")

    def write_all() -> None:
        save_llm_checkpoint(target, directory)
        write_state()

    if policy.is_partitioned:
        save_llm_checkpoint(target, directory)  # collective gather; rank 0 writes
        main_process_only(write_state, None)
    else:
        main_process_only(write_all, None)


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


class _PolicyAtStep(NamedTuple):
    """The causal LM and the step count: a trainer to `save_llm_checkpoint` (its ``policy`` and
    ``step_count``), also when the trainer's policy is the `MultiTurnPolicy` around it."""

    policy: CausalLMPolicy
    step_count: int


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


class _StepMetrics(Callback):
    """What ``grpo-train`` adds to each step's record (`on_metrics`, before the sinks): the reward
    functions' counters of the step's own call (``reward/<name>/applicable``, ...; not those of an
    evaluation after it) and ``throughput/tokens_per_s`` = ``completion/tokens / time/step``.
    It also keeps ``rewards.trainer_state`` (what TRL's reward functions get as
    ``trainer_state``): ``global_step`` (steps done), ``max_steps`` and ``epoch`` (passes over the
    dataset done, fractional). With ``--env`` (a `ConversationReward`) there are no counters.
    """

    def __init__(
        self, rewards: RewardFunctions | ConversationReward, max_steps: int, steps_per_epoch: int
    ) -> None:
        self.rewards = rewards
        self.steps_per_epoch = max(steps_per_epoch, 1)
        self.trainer_state = types.SimpleNamespace(global_step=0, max_steps=max_steps, epoch=0.0)
        if isinstance(rewards, RewardFunctions):
            rewards.trainer_state = self.trainer_state

    def _at(self, step: int) -> None:
        self.trainer_state.global_step = step
        self.trainer_state.epoch = step / self.steps_per_epoch

    def on_train_start(self, state: TrainState) -> None:
        self._at(state.step)  # a resumed run starts at its checkpoint's step
        if isinstance(self.rewards, _StepRewards):
            self.rewards.trainer = state.trainer

    def on_metrics(self, state: TrainState, metrics: dict[str, float]) -> None:
        if isinstance(self.rewards, _StepRewards):
            metrics.update(self.rewards.step_counters(state.step))
        elif isinstance(self.rewards, RewardFunctions):
            metrics.update(self.rewards.last_metrics)
        if "completion/tokens" in metrics:
            metrics["throughput/tokens_per_s"] = metrics["completion/tokens"] / max(
                metrics["time/step"], 1e-9
            )

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        self._at(state.step)


class _SaveModels(Callback):
    """``<output-dir>/checkpoint-{step}/`` (the model, loadable with ``from_pretrained``) every
    ``--save-steps`` steps. Runs on every process: `_save` is collective under ZeRO-3 and FSDP."""

    def __init__(self, trainer: GRPOTrainer, out_dir: Path, args: argparse.Namespace) -> None:
        self.trainer = trainer
        self.out_dir = out_dir
        self.args = args

    def on_step_end(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        every = self.args.checkpoint_freq
        if every and state.step % every == 0:
            _save(self.trainer, self.out_dir / f"checkpoint-{state.step}", self.args, dict(metrics))


class _LoggingPeriod(PeriodicSink):
    """`PeriodicSink` that also writes every record holding evaluation results (``eval/*``), so
    an evaluation reaches the outputs whatever ``--logging-steps`` is."""

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        super().write(metrics, step)  # written, or held in place of the one held before
        if any(k.startswith("eval/") for k in metrics):
            self.flush()  # the held record is this one


class _Outputs(NamedTuple):
    sinks: list[PeriodicSink]
    wandb_run: Any  # the W&B run with --use-wandb (for the completions table), else None


def _outputs(args: argparse.Namespace, out_dir: Path, stack: contextlib.ExitStack) -> _Outputs:
    """Rank 0's sinks, each writing every ``--logging-steps`` steps, at each evaluation and at
    the last step: ``metrics.jsonl`` (appended), a ``grpo.llm`` log line, and W&B with
    ``--use-wandb``. Closed (the W&B run finished) when ``stack`` exits."""
    jsonl = JSONLSink(out_dir / "metrics.jsonl", append=True)
    stack.callback(jsonl.close)
    inner: list[Any] = [jsonl, LoggingSink(logger, keys=("reward/mean", "kl/ref", "throughput/tokens_per_s"))]
    wandb_run = None
    if args.use_wandb:
        try:
            wandb = WandbSink(project=args.wandb_project, name=args.wandb_run_name, config=vars(args))
        except ImportError as e:
            raise ImportError(f"--use-wandb needs Weights & Biases: {e}") from e
        stack.callback(wandb.close)
        inner.append(wandb)
        wandb_run = getattr(wandb, "run", None)
    sinks: list[PeriodicSink] = [_LoggingPeriod(s, args.logging_steps) for s in inner]
    for sink in sinks:
        stack.callback(sink.flush)  # a held record is written before its sink closes (LIFO)
    return _Outputs(sinks, wandb_run)


# ---- checkpoints and resume ------------------------------------------------------------------------
class _Checkpointing(NamedTuple):
    directory: Path | None  # train(checkpoint_dir=...): None = no trainer checkpoints
    resume_from: Path | None


def _checkpointing(args: argparse.Namespace, config: GRPOConfig) -> _Checkpointing:
    """Where the trainer's checkpoints go (``<output-dir>/checkpoints``; none under DeepSpeed, whose
    partitioned optimizer state they cannot hold, or with ``--save-steps none``) and which one
    ``--resume`` loads; refused before any model is loaded when it cannot be found."""
    root = Path(args.output_dir) / "checkpoints"
    deepspeed = deepspeed_config_from(config.deepspeed) is not None
    if args.resume is not None and deepspeed:
        raise SystemExit(
            "grpo-train: error: --resume needs the trainer's checkpoints, which DeepSpeed ZeRO cannot "
            "write (its optimizer state is partitioned); train with --deepspeed off (or FSDP: --fsdp)."
        )
    directory = None if deepspeed or config.checkpoint_freq is None else root
    if args.resume is None:
        if directory is not None and is_main_process() and any(root.glob("step-*")):
            logger.warning(
                "%s holds checkpoints of an earlier run; this run starts anew (--resume continues "
                "one) and its checkpoints go beside them.",
                root,
            )
        return _Checkpointing(directory, None)
    path = _resume_path(args.resume, root)
    if find_latest_checkpoint(path) is None:
        raise SystemExit(
            f"grpo-train: error: --resume {args.resume}: no complete trainer checkpoint in {path}; "
            f"give a step-N directory or their root (the run's <output-dir>/checkpoints), or run "
            f"without --resume."
        )
    return _Checkpointing(directory, path)


def _resume_path(spec: str, root: Path) -> Path:
    """``latest`` -> ``root``; ``.../checkpoint-N`` (a model save of this command) -> the trainer
    checkpoint of step N under ``root``; anything else as given."""
    if spec == "latest":
        return root
    path = Path(spec)
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    if match and not path.joinpath("state.json").exists():
        step_dir = path.parent / "checkpoints" / f"step-{int(match.group(1)):08d}"
        if step_dir.is_dir():
            return step_dir
    return path


# ---- the run ---------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> dict[str, float]:
    """Run the training described by ``args`` (`parse_args`); return the last step's metrics."""
    transformers = require("transformers")
    records = _training_states(args)  # prompt records, or with --env the start states
    eval_states = None
    if args.eval_dataset is not None:  # read before any model is loaded: its errors come first
        eval_states = PromptDataset.load(args.eval_dataset, prompt_column=args.prompt_column).records
    make_env = None if args.env is None else _load_callable(args.env, "--env")
    plan = _plan_steps(args, len(records))
    per_step = build_config(args, total_steps=10**9).optimizer_steps_per_step
    config = build_config(args, total_steps=plan.total * per_step)  # a decaying schedule: this run
    ckpt = _checkpointing(args, config)
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
        outputs = _outputs(args, out_dir, stack) if plan.main_process else _Outputs([], None)
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
        _save(trainer, final, args, metrics)
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
    lm = _build_policy(args, *_load_model(args, transformers))
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
    """The command's callbacks: its keys of each record and ``trainer_state`` (`_StepMetrics`),
    the model saves (`_SaveModels`) and, with ``--log-completions-every``, the completions table
    (rank 0: ``completions.jsonl``, and a W&B table with ``--use-wandb``)."""
    out_dir = Path(args.output_dir)
    callbacks: list[Callback] = [
        _StepMetrics(rewards, plan.total, plan.per_epoch),
        _SaveModels(trainer, out_dir, args),
    ]
    every = args.log_completions_every
    if every is not None and plan.main_process:
        callbacks.append(CompletionsTable(out_dir / "completions.jsonl", every=every, wandb_run=wandb_run))
    return callbacks


def _log_plan(args: argparse.Namespace, num_states: int, plan: _StepPlan) -> None:
    logger.info(
        "%d %s, %d a step: %d steps (%d epoch%s of %d steps%s)", num_states,
        "prompts" if args.env is None else "start states", plan.global_batch,
        plan.total, plan.epochs, "s" if plan.epochs > 1 else "", plan.per_epoch,
        "; --max-steps cycles the data" if args.max_steps is not None and plan.epochs > 1 else "",
    )  # fmt: skip


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


def _build_policy(args: argparse.Namespace, model: Any, tokenizer: Any) -> CausalLMPolicy:
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
