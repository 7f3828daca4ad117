"""The options of ``grpo-train`` and their checks (`grpo.llm.cli` tells the whole command).

Every option is a dataclass field with its help text in the metadata: the `GRPOConfig` fields and
the command's own (`RunOptions`, `ModelOptions`, ...). `parse_args` reads the command line and the
``--config`` file, resolves the `GRPOConfig` (`resolve_config`: defaults < recipe < file < command
line) and checks everything a run needs before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo.algorithms.recipes import RECIPES, recipe_values
from grpo.config import SPELLINGS, GRPOConfig, optimizer_steps_per_step
from grpo.llm.cli_rewards import extractor_from_spec
from grpo.llm.rewards import Convention
from grpo.llm.sampling_settings import REMOVED_SETTINGS
from grpo.runtime.dataclass_args import DataclassArgumentParser, ParsedValues
from grpo.training.evaluation import EvalOptions

__all__ = [
    "CONFIG_DEFAULTS",
    "CONFIG_FIELDS",
    "EVAL_PREFIX",
    "OPTION_GROUPS",
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
    "parse_args",
    "resolve_config",
]


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

OPTION_GROUPS: tuple[tuple[str, type], ...] = (
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
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(GRPOConfig))


class CLIArgs(argparse.Namespace):
    """The resolved options: every field of the option dataclasses and of `GRPOConfig` (the
    recipe applied, under the field's name: ``args.kl_coeff``, whichever spelling was given),
    and ``config`` (the ``--config`` path)."""


def build_parser() -> DataclassArgumentParser:
    """The ``grpo-train`` parser: one option per field (help and default from the field)."""
    p = DataclassArgumentParser(
        prog="grpo-train",
        usage="grpo-train [--config FILE] [--recipe NAME] [--resume [DIR]] [OPTIONS]",
        description="GRPO fine-tuning of a Hugging Face causal LM on a prompt dataset. Bool options: "
        "--flag, --flag true|false or --no-flag; options that may be unset take 'none'.",
        spellings=SPELLINGS,  # seed 003's --kl-coef, seed 001's adv_norm, ...: grpo.config
        removed=REMOVED_SETTINGS,  # --decoding: refused with why
        allow_abbrev=False,  # an option is its whole name: no prefix of another knob
    )
    groups = {title: p.add_argument_group(title) for title, _ in OPTION_GROUPS}
    config_group = p.add_argument_group(_CONFIG_TITLE)
    # GRPOConfig first: a field it shares with an option dataclass is its option (one flag)
    p.add_dataclass(
        GRPOConfig,
        group=config_group,
        defaults={k: v for k, v in CONFIG_DEFAULTS.items() if k in CONFIG_FIELDS},
        choices={"recipe_name": [*sorted(RECIPES), None]},
    )
    for title, cls in OPTION_GROUPS:
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
        extractor_from_spec(v["answer_extractor"], "--answer-extractor")
        _check_evaluation(parsed, config)
        _check_environment(parsed, config)
    except (ValueError, TypeError) as e:
        parser.fail(str(e))
    args = CLIArgs(**{k: x for k, x in v.items() if k not in CONFIG_FIELDS}, config=parsed.file)
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
        extractor_from_spec(v["eval_answer"], "--eval-answer")
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
    answer = None if spec is None else extractor_from_spec(spec, "--eval-answer")
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


def build_config(args: argparse.Namespace, num_steps: int | None = None) -> GRPOConfig:
    """The `GRPOConfig` of resolved ``args`` (`parse_args`). A decaying learning-rate schedule
    without ``--total-steps`` decays over the run: ``total_steps`` = ``num_steps`` x the optimizer
    steps of one step (`grpo.config.optimizer_steps_per_step`); without ``num_steps`` it stays unset
    (and `GRPOConfig` asks for it)."""
    values = {k: getattr(args, k) for k in CONFIG_FIELDS}
    if values["total_steps"] is None and values["lr_schedule"] != "constant" and num_steps is not None:
        batch, mini = values["batch_size"], values["mini_batch_size"]
        values["total_steps"] = num_steps * optimizer_steps_per_step(
            batch, mini, values["num_epochs_per_update"]
        )
    return GRPOConfig(**values)
